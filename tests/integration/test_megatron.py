"""Megatron-core adapter, end to end: real rank processes (4, gloo, CPU) running megatron-core.

Each ``saved_*`` fixture is one 4-rank run of ``megatron_workers/ckpt_worker.py`` in one layout:
it trains a tiny GPT (4 layers, hidden 32, vocab 64, distributed optimizer), saves the same state
three ways (sync, async ``replica``, async ``balanced``), takes one more optimizer step at once,
then reloads. Every rank dumps its shards keyed by (sharded key, global offset), so the tests
below compare tensors bitwise and count the bytes each rank wrote. The ``pretrain_*`` fixtures
run ``scripts/pretrain_gpt.py`` itself and compare loss sequences exactly.

The whole file runs in about 4 minutes on 2 CPU cores (nine 4-rank launches).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO  # noqa: E402
WORKER = os.path.join(REPO, "tests", "integration", "megatron_workers", "ckpt_worker.py")
KILL_WORKER = os.path.join(REPO, "tests", "integration", "megatron_workers", "kill_worker.py")
PRETRAIN = os.path.join(REPO, "scripts", "pretrain_gpt.py")
CONFIG = os.path.join(REPO, "configs", "megatron_async.json")
NPROC = 4

pytest.importorskip("megatron.core")
from deepspeed_async_ckpt.tools.launch import launch  # noqa: E402

from deepspeed_async_ckpt.commit import LOCK_FILE, META_DIR, read_manifest  # noqa: E402
from deepspeed_async_ckpt.errors import IntegrityError  # noqa: E402
from megatron_adapter.checkpointer import read_tracker, verify_checkpoint_dir  # noqa: E402

pytestmark = pytest.mark.slow

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


# ---------------------------------------------------------------------------------- launches
@pytest.fixture(scope="module")
def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([REPO, e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONWARNINGS"] = "ignore"
    return e


def run(script: str, args: list[str], env: dict, expect_ok: bool = True, per_node: int | None = None) -> list[int]:
    codes = launch(script, [str(a) for a in args], NPROC, timeout=240, env=env, per_node=per_node)
    if expect_ok:
        assert codes == [0] * NPROC, f"{os.path.basename(script)} {args}: rank exit codes {codes}"
    return codes


def save_run(tmp_path_factory, env, tp: int, pp: int, *extra: str) -> str:
    out = str(tmp_path_factory.mktemp(f"save_tp{tp}_pp{pp}"))
    run(WORKER, ["save", "--tp", tp, "--pp", pp, "--out", out, *extra], env)
    return out


@pytest.fixture(scope="module")
def saved_tp2_pp2(tmp_path_factory, env):
    """TP=2, PP=2, DP=1; also megatron-core interop both ways, and one iteration saved again."""
    return save_run(tmp_path_factory, env, 2, 2, "--interop", "--resave")


@pytest.fixture(scope="module")
def saved_tp1_pp2(tmp_path_factory, env):
    """TP=1, PP=2, DP=2."""
    return save_run(tmp_path_factory, env, 1, 2)


@pytest.fixture(scope="module")
def saved_tp2_pp1(tmp_path_factory, env):
    """TP=2, PP=1, DP=2."""
    return save_run(tmp_path_factory, env, 2, 1)


LAYOUTS = ("saved_tp2_pp2", "saved_tp1_pp2", "saved_tp2_pp1")


# ---------------------------------------------------------------------------------- dumps
def dumps(out: str, name: str) -> dict[int, dict]:
    return {r: torch.load(f"{out}/{name}.rank{r}.pt") for r in range(NPROC)}


def infos(out: str, name: str) -> dict[int, dict]:
    with_rank = {}
    for r in range(NPROC):
        with open(f"{out}/{name}.rank{r}.json", encoding="utf-8") as f:
            with_rank[r] = json.load(f)
    return with_rank


def records(out: str) -> dict[int, dict]:
    return infos(out, "records")


def assert_same_per_rank(out: str, name: str, reference: str = "reference") -> None:
    """``name`` holds, on every rank, exactly the shards of ``reference``, taken at save time:
    the model and optimizer state after the load, and the model tensors as read from the
    checkpoint (fp32 weights are overwritten by the optimizer's main weights on load, so only
    the latter shows a torn model tensor)."""
    for suffix in ("", ".model"):
        ref, got = dumps(out, reference + suffix), dumps(out, name + suffix)
        for r in range(NPROC):
            assert got[r].keys() == ref[r].keys(), f"rank {r}: {name}{suffix} holds other shards"
            bad = [k for k in ref[r] if not torch.equal(ref[r][k], got[r][k])]
            assert not bad, (f"rank {r}: {name}{suffix} differs from the state at save time in "
                             f"{len(bad)} of {len(ref[r])} shards, e.g. {bad[:3]}")
        assert sum(len(ref[r]) for r in ref) > (100 if not suffix else 40)
    assert {i["adam_steps"][0] for i in infos(out, name).values()} == \
        {i["adam_steps"][0] for i in infos(out, reference).values()}


def is_main(replica_id) -> bool:
    ids = replica_id if isinstance(replica_id, list) else [replica_id]
    return all(i == 0 for i in ids)


def full_tensors(out: str, name: str) -> dict[str, torch.Tensor]:
    """Assemble global tensors from every rank's shards; replicas must agree."""
    shapes = {s["key"]: s["global_shape"] for i in infos(out, "reference").values()
              for s in i["shards"] if s["kind"] == "tensor"}
    full: dict[str, torch.Tensor] = {}
    for shards in dumps(out, name).values():
        for (key, offset), value in shards.items():
            t = full.setdefault(key, torch.full(shapes[key], float("nan"), dtype=value.dtype))
            region = t[tuple(slice(o, o + n) for o, n in zip(offset, value.shape))]
            assert region.isnan().all() or torch.equal(region, value), f"replicas of {key} differ"
            region.copy_(value)
    for key, t in full.items():
        assert not t.isnan().any(), f"{key}: some part held by no rank"
    return full


# ---------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_reload_bitwise_equal(request, layout):
    """Both async checkpoints hold the state of the save, though an optimizer step followed
    right away. The ``replica`` one went through a host pool of one shard or two, with slow
    writes: most of its copies were still outstanding at that step, so only the fence kept
    them from being torn."""
    out = request.getfixturevalue(layout)
    assert_same_per_rank(out, "reloaded_replica")
    assert_same_per_rank(out, "reloaded_balanced")
    assert all(rec["replica"]["outstanding_at_step"] for rec in records(out).values()
               if rec["replica"]["files"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_unique_shard_written_once_by_its_elected_rank(request, layout):
    out = request.getfixturevalue(layout)
    shards = {r: i["shards"] for r, i in infos(out, "reference").items()}
    layouts = {r: i["layout"] for r, i in infos(out, "reference").items()}
    unique = {(s["key"], tuple(s["offset"])): s["bytes"]
              for ss in shards.values() for s in ss if s["kind"] == "tensor"}
    objects = {s["key"] for ss in shards.values() for s in ss if s["kind"] == "object"}
    recs = records(out)
    per_mode_bytes = {}
    for mode in ("sync", "replica", "balanced"):
        writer_of: dict = {}
        for r, rec in recs.items():
            files = rec[mode]["files"]
            for f in files:
                ident = (f["key"], tuple(f["offset"])) if f["offset"] is not None else f["key"]
                assert ident not in writer_of, f"{mode}: {ident} written by ranks {writer_of[ident]} and {r}"
                writer_of[ident] = r
                if f["offset"] is not None:
                    assert f["bytes"] == unique[ident], f"{mode}: {ident} staged {f['bytes']} bytes"
            # Non-writers copy nothing: the bytes a rank staged are exactly those it wrote.
            assert rec[mode]["staged_bytes"] == sum(f["bytes"] for f in files), (mode, r)
            # A few files per rank (writer_threads=2), not one per item, as megatron-core
            # writes them; the manifest says where each item lies in its file.
            items = [f for f in files if f["part"] is not None]
            distcp = sorted({f["path"] for f in items})
            assert distcp == [f"__{r}_{k}.distcp" for k in range(min(2, len(items)))], (mode, r, distcp)
            manifest = read_manifest(rec[mode]["ckpt_dir"])["files"]
            assert sorted(p for name in distcp for p in manifest[name]["parts"]) == \
                sorted(f["part"] for f in items), (mode, r)
        assert set(writer_of) == set(unique) | objects | {"common"}, mode
        assert writer_of["common"] == 0
        per_mode_bytes[mode] = {r: rec[mode]["staged_bytes"] for r, rec in recs.items()}
        if mode != "balanced":  # writers are the main replicas, as megatron-core numbers them
            for r, ss in shards.items():
                for s in ss:
                    if s["kind"] == "tensor":
                        assert (writer_of[(s["key"], tuple(s["offset"]))] == r) == is_main(s["replica_id"]), (mode, s)
    assert per_mode_bytes["sync"] == per_mode_bytes["replica"]
    assert sum(per_mode_bytes["balanced"].values()) == sum(per_mode_bytes["replica"].values())
    if layouts[0]["dp"] > 1:
        assert [r for r, b in per_mode_bytes["replica"].items() if b == 0], "a DP replica should write nothing"
        assert all(b > 0 for b in per_mode_bytes["balanced"].values()), per_mode_bytes["balanced"]
        assert max(per_mode_bytes["balanced"].values()) < max(per_mode_bytes["replica"].values())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reserve_sizes_the_pool_for_exactly_the_elected_shards(request, layout):
    """``reserve`` (after the same election as ``save``) faults in what the first save then
    stages through the pool on each rank, so that save allocates nothing more: 0 bytes on a
    data-parallel replica that writes nothing."""
    from deepspeed_async_ckpt.storage import aligned_size

    out = request.getfixturevalue(layout)
    for mode in ("sync", "balanced"):
        for r, rec in records(out).items():
            need = rec[mode]["pooled_bytes"]  # what the save took from the pool
            shards = sum(aligned_size(f["bytes"]) for f in rec[mode]["files"] if f["offset"] is not None)
            assert shards <= need, (mode, r)  # RNG-state objects hold tensors, too
            assert rec[mode]["reserved"] == need, (mode, r, rec[mode]["reserved"], need)
            assert rec[mode]["pool_allocations"] == (1 if need else 0), (mode, r)
    if infos(out, "reference")[0]["layout"]["dp"] > 1:
        assert any(rec["sync"]["reserved"] == 0 for rec in records(out).values())


def test_sync_and_async_checkpoints_are_byte_identical(saved_tp2_pp2):
    sync_dir = os.path.join(saved_tp2_pp2, "ckpt_sync", "iter_0000002")
    async_dir = os.path.join(saved_tp2_pp2, "ckpt_replica", "iter_0000002")
    names = sorted(n for n in os.listdir(sync_dir) if n != META_DIR)
    assert names == sorted(n for n in os.listdir(async_dir) if n != META_DIR)
    assert {"common.pt", ".metadata", "metadata.json"} <= set(names)
    for n in names:
        with open(os.path.join(sync_dir, n), "rb") as a, open(os.path.join(async_dir, n), "rb") as b:
            assert a.read() == b.read(), n
    assert read_manifest(sync_dir)["files"] == read_manifest(async_dir)["files"]


def test_committed_checkpoint_verifies_and_tracker_names_it(saved_tp2_pp2):
    save_dir = os.path.join(saved_tp2_pp2, "ckpt_replica")
    assert read_tracker(save_dir) == 2
    ckpt_dir = os.path.join(save_dir, "iter_0000002")
    verify_checkpoint_dir(ckpt_dir)
    with open(os.path.join(ckpt_dir, "metadata.json"), encoding="utf-8") as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"
    victim = sorted(glob.glob(os.path.join(ckpt_dir, "__*.distcp")))[0]
    data = bytearray(open(victim, "rb").read())
    data[-100] ^= 0xFF
    with open(victim, "wb") as f:
        f.write(data)
    with pytest.raises(IntegrityError, match=os.path.basename(victim)):
        verify_checkpoint_dir(ckpt_dir)


def test_marker_files_are_verified_and_a_checkpoint_without_them_is_unfinalized(saved_tp2_pp2, tmp_path,
                                                                              capsys):
    """``.metadata`` (where every item is in the .distcp files) and ``metadata.json`` are
    written after the commit, so the manifest could not checksum them: a truncated
    ``.metadata`` passed ``verify`` and the adapter's check, and megatron-core's load failed
    on it. They are recorded once written (``late_files.json``), and a checkpoint whose
    markers were never written shows as unfinalized in ``list`` and fails ``verify``."""
    import shutil

    from deepspeed_async_ckpt.tools.cli import main

    save_dir = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(saved_tp2_pp2, "ckpt_balanced"), save_dir)
    ckpt_dir = os.path.join(save_dir, "iter_0000002")
    assert read_manifest(ckpt_dir)["late_files"] == [".metadata", "metadata.json"]
    verify_checkpoint_dir(ckpt_dir)
    assert main(["verify", save_dir]) == 0
    metadata = os.path.join(ckpt_dir, ".metadata")
    data = open(metadata, "rb").read()
    with open(metadata, "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(IntegrityError, match=r"\.metadata: size"):
        verify_checkpoint_dir(ckpt_dir)
    assert main(["verify", save_dir]) == 1
    assert ".metadata" in capsys.readouterr().err
    for name in (".metadata", "metadata.json", os.path.join(META_DIR, "late_files.json")):
        os.remove(os.path.join(ckpt_dir, name))  # a crash between the commit and the markers
    assert main(["verify", ckpt_dir]) == 1
    assert "never finalized" in capsys.readouterr().err
    assert main(["list", save_dir, "--json"]) == 0
    assert [r["state"] for r in json.loads(capsys.readouterr().out)] == ["unfinalized"]


def test_resaving_the_trackers_iteration_keeps_it_whole_until_the_new_one_is_finalized(saved_tp2_pp2):
    """One iteration saved again with another state: the save that failed (rank 1's disk full)
    leaves the checkpoint the tracker names as it was, markers included (the re-save is staged
    beside it); the next one replaces it whole. No staging directory or replaced checkpoint is
    left behind."""
    out = saved_tp2_pp2
    assert all("No space left" in (i["failed"] or "") for i in infos(out, "resave_second").values())
    assert_same_per_rank(out, "resave_failed_reload", reference="resave_first")
    assert_same_per_rank(out, "resaved_reload", reference="resave_second")
    assert {i["adam_steps"][0] for i in infos(out, "resave_first").values()} != \
        {i["adam_steps"][0] for i in infos(out, "resave_second").values()}  # two different states
    save_dir = os.path.join(out, "ckpt_resave")
    iteration = read_tracker(save_dir)
    assert sorted(os.listdir(save_dir)) == [LOCK_FILE, f"iter_{iteration:07d}", "latest_checkpointed_iteration.txt"]
    verify_checkpoint_dir(os.path.join(save_dir, f"iter_{iteration:07d}"))


def test_a_load_without_the_optimizer_hashes_none_of_its_bytes(saved_tp2_pp2):
    """Verification before a load hashes what that load can read, each byte once across the
    ranks: everything for a full load; without the optimizer state (a fine-tuning start), the
    archives of the other items and ``common.pt`` only, whether the verification is given the
    load's request or told to skip the optimizer state, and also where the ranks request
    different parts (each archive any of them reads, once). Each archive of a .distcp file has
    a checksum of its own, so such a load hashes no optimizer byte."""
    import pickle

    out = saved_tp2_pp2
    hashed = infos(out, "hashed")
    ckpt_dir = records(out)[0]["balanced"]["ckpt_dir"]
    files = read_manifest(ckpt_dir)["files"]
    with open(os.path.join(ckpt_dir, ".metadata"), "rb") as f:
        storage = pickle.load(f).storage_data
    not_optimizer = {(i.relative_path, i.offset) for index, i in storage.items()
                     if not index.fqn.startswith("optimizer.")}
    markers = sum(os.path.getsize(os.path.join(ckpt_dir, n)) for n in (".metadata", "metadata.json"))
    expected = markers + files["common.pt"]["bytes"] + sum(
        length for name, entry in files.items() if name.endswith(".distcp")
        for offset, length, _ in entry["segments"]
        if any(name == n and offset <= o < offset + length for n, o in not_optimizer))
    assert sum(h["full"] for h in hashed.values()) == markers + sum(e["bytes"] for e in files.values())
    assert sum(h["without_optimizer"] for h in hashed.values()) == expected
    assert sum(h["skip_optimizer"] for h in hashed.values()) == expected  # the Megatron-LM hook's way
    assert sum(h["per_rank"] for h in hashed.values()) == expected  # what any rank reads, once
    assert expected < sum(e["bytes"] for e in files.values()) / 2


def test_interop_megatron_loads_ours(saved_tp2_pp2):
    """megatron-core's own ``dist_checkpointing.load`` read the engine's balanced checkpoint."""
    assert_same_per_rank(saved_tp2_pp2, "reloaded_balanced")
    assert not os.path.exists(os.path.join(saved_tp2_pp2, "ckpt_megatron", META_DIR))


def test_interop_ours_loads_megatron(saved_tp2_pp2):
    """Our loader read a checkpoint megatron-core's own ``dist_checkpointing.save`` wrote."""
    assert_same_per_rank(saved_tp2_pp2, "megatron_reloaded_by_ours")


@pytest.mark.parametrize("tp,pp", [(1, 4), (2, 1)], ids=["to_tp1_pp4", "to_tp2_pp1_dp2"])
def test_resharded_load_gives_identical_full_tensors(saved_tp2_pp2, env, tp, pp):
    """TP=2,PP=2,DP=1 -> TP=1,PP=4 and -> TP=2,PP=1,DP=2, model and optimizer state."""
    name = f"resharded_tp{tp}_pp{pp}"
    ckpt = os.path.join(saved_tp2_pp2, "ckpt_balanced", "iter_0000002")
    run(WORKER, ["load", "--tp", tp, "--pp", pp, "--out", saved_tp2_pp2, "--ckpt", ckpt,
                 "--name", name], env)
    assert {i["layout"]["pp"] for i in infos(saved_tp2_pp2, name).values()} == {pp}
    for suffix in ("", ".model"):  # after the load; as read from the checkpoint
        want = full_tensors(saved_tp2_pp2, "reference" + suffix)
        got = full_tensors(saved_tp2_pp2, name + suffix)
        assert got.keys() == want.keys()
        assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in got) == (suffix == "")
        for key in want:
            assert torch.equal(got[key], want[key]), f"{name}{suffix}: {key}"


# ---------------------------------------------------------------------------------- pretrain
TINY_GPT = ["--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
            "--use-distributed-optimizer", "--num-layers", 4, "--hidden-size", 32,
            "--num-attention-heads", 4, "--seq-length", 16, "--vocab-size", 64,
            "--micro-batch-size", 2, "--global-batch-size", 4, "--lr", 0.01, "--train-iters", 6]


def steps(log: str) -> dict[tuple[int, int], tuple[float, float]]:
    out = {}
    with open(log, encoding="utf-8") as f:
        for line in f:
            e = json.loads(line)
            if e["event"] == "step":
                out[(e["rank"], e["iteration"])] = (e["loss"], e["grad_norm"])
    return out


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, env):
    """Six iterations straight, saving synchronously (no --async-ckpt) every 3."""
    d = tmp_path_factory.mktemp("straight")
    log = str(d / "log.jsonl")
    run(PRETRAIN, [*TINY_GPT, "--save", d / "ckpt", "--save-interval", 3, "--log-json", log], env)
    return d, steps(log)


def test_resume_gives_the_same_losses(straight_run, tmp_path, env):
    d, straight = straight_run
    assert read_tracker(str(d / "ckpt")) == 6
    log = str(tmp_path / "log.jsonl")
    run(PRETRAIN, [*TINY_GPT, "--load", d / "ckpt", "--ckpt-step", 3, "--save", tmp_path / "ckpt",
                   "--save-interval", 3, "--async-ckpt", "--async-ckpt-config", CONFIG,
                   "--log-json", log, *(["--tensorboard-dir", tmp_path / "tb"] if HAVE_TENSORBOARD else [])],
        env)
    resumed = steps(log)
    assert sorted({i for _, i in resumed}) == [4, 5, 6]
    assert resumed == {k: v for k, v in straight.items() if k[1] > 3}
    assert read_tracker(str(tmp_path / "ckpt")) == 6
    # The pool was reserved after the first step (building a state dict for it changed no
    # loss, above) for exactly what the first save then took from it, on every rank.
    events = [json.loads(line) for line in open(log, encoding="utf-8")]
    reserve = {e["rank"]: e for e in events if e["event"] == "reserve"}
    saves = [e for e in events if e["event"] == "save"]
    pool = {e["rank"]: e for e in events if e["event"] == "pool"}  # after the run's last commit
    assert sorted(reserve) == sorted(pool) == list(range(4))
    assert sorted((e["rank"], e["iteration"]) for e in saves) == [(r, 6) for r in range(4)]
    for r in range(4):
        assert reserve[r]["iteration"] == 4
        assert reserve[r]["bytes"] == pool[r]["pooled_bytes"], (r, reserve[r], pool[r])
        assert pool[r]["pool_allocations"] == (1 if reserve[r]["bytes"] else 0), pool[r]
    assert sum(reserve[r]["bytes"] > 0 for r in range(4)) >= 2
    # rank 0 reports the save once the tracker names it (on_saved), with the manifest's figures
    saved = [e for e in events if e["event"] == "saved"]
    manifest = read_manifest(str(tmp_path / "ckpt" / "iter_0000006"))
    assert [(e["rank"], e["iteration"]) for e in saved] == [(0, 6)]
    assert saved[0]["files"] == len(manifest["files"]) and saved[0]["seconds"] > 0
    assert saved[0]["bytes"] == sum(f["bytes"] for f in manifest["files"].values())
    # --tensorboard-dir: the loss (the last rank, as Megatron-LM) and, from rank 0, the commit's
    # figures at its iteration, those of the manifest and of the on_saved report
    if not HAVE_TENSORBOARD:
        pytest.skip("tensorboard is not installed (the test extra installs it): scalars not read back")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    scalars = {tag: [(e.step, e.value) for e in board.Scalars(tag)] for tag in board.Tags()["scalars"]}
    assert [step for step, _ in scalars["lm loss"]] == [4, 5, 6]
    assert scalars["lm loss"][-1][1] == pytest.approx(resumed[(3, 6)][0])
    timings = manifest["timings"]
    assert scalars["async-ckpt/bytes"] == [(6, pytest.approx(saved[0]["bytes"], rel=1e-6))]  # float32
    assert scalars["async-ckpt/committed-s"] == [(6, pytest.approx(saved[0]["seconds"], abs=1e-6))]
    assert scalars["async-ckpt/save-call-ms"] == [(6, pytest.approx(timings["save_call_s"]["max"] * 1e3))]
    assert scalars["async-ckpt/fence-wait-ms"] == [(6, pytest.approx(timings["fence_wait_s"]["max"] * 1e3))]
    assert scalars["async-ckpt/persisted-s"] == [(6, pytest.approx(timings["persisted_s"]["max"]))]


def test_resume_from_a_truncated_common_pt_names_it(straight_run, tmp_path, env):
    """``pretrain_gpt.py`` reads ``common.pt`` (to build its load request) before the engine's
    check of the checkpoint: it is checked against the manifest first, so a truncated one
    fails the resume naming the file, not with torch.load's bare ``OSError: [Errno 22]
    Invalid argument``."""
    import shutil

    d, _ = straight_run
    shutil.copytree(d / "ckpt" / "iter_0000003", tmp_path / "ckpt" / "iter_0000003")
    common = tmp_path / "ckpt" / "iter_0000003" / "common.pt"
    os.truncate(common, common.stat().st_size // 2)
    prefix = str(tmp_path / "resume")
    codes = launch(PRETRAIN, [str(a) for a in [*TINY_GPT, "--load", tmp_path / "ckpt", "--ckpt-step", 3,
                                                "--async-ckpt"]],
                   NPROC, timeout=240, env=env, log_prefix=prefix)
    assert all(c != 0 for c in codes), codes
    for r in range(NPROC):
        log = open(f"{prefix}.rank{r}.log", encoding="utf-8").read()
        assert f"IntegrityError: {common}: size" in log and "file truncated" in log, log[-3000:]


def test_save_retain_interval_keeps_every_nth_iteration_and_the_newest(tmp_path, env):
    """Megatron-LM's ``--save-retain-interval``, which routed saves honour: a checkpoint every
    iteration, only iterations 3 and 6 (multiples of 3) and the newest, 7, are left."""
    save = tmp_path / "ckpt"
    args = [*TINY_GPT, "--train-iters", 7, "--save", save, "--save-interval", 1,
            "--save-retain-interval", 3, "--async-ckpt", "--async-ckpt-config", CONFIG]
    save.mkdir()  # a tracker no iteration: Megatron-LM's "release" (nothing to remove for it;
    (save / "latest_checkpointed_iteration.txt").write_text("release")  # it failed the save once)
    run(PRETRAIN, args, env)
    assert read_tracker(str(save)) == 7
    lock = [LOCK_FILE]
    assert sorted(os.listdir(save)) == [*lock, "iter_0000003", "iter_0000006", "iter_0000007",
                                        "latest_checkpointed_iteration.txt"]
    for it in (3, 6, 7):
        verify_checkpoint_dir(str(save / f"iter_{it:07d}"))
    # resumed: the checkpoint it started from (7, not a multiple of 3) goes at its first save,
    # as in Megatron-LM, which reads the tracker
    run(PRETRAIN, [*args, "--train-iters", 8, "--load", save], env)
    assert sorted(os.listdir(save)) == [*lock, "iter_0000003", "iter_0000006", "iter_0000008",
                                        "latest_checkpointed_iteration.txt"]


_MAX_WEIGHT_CHANGE = """
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core.dist_checkpointing.serialization import load_plain_tensors
a, b = (load_plain_tensors(d) for d in sys.argv[1:3])
keys = [k for k in a if k.startswith(("decoder", "embedding", "output")) and torch.is_tensor(a[k])]
print(max((a[k].float() - b[k].float()).abs().max().item() for k in keys))
"""


def test_a_bf16_resume_without_the_optimizer_steps_from_the_loaded_weights(tmp_path, env):
    """``--bf16 --no-load-optim`` (or a ``--no-save-optim`` checkpoint) loads the weights and
    must not leave the optimizer's fp32 main copies at the initial ones (the first step would
    copy those back, and training go on from near-random weights, 0.07 from the loaded ones
    after one step of lr 0.01). One Adam step from fresh moments moves each weight by about
    lr."""
    from deepspeed_async_ckpt.tools.launch import free_port

    bf16 = [*TINY_GPT, "--bf16", "--lr-decay-style", "constant"]
    first, second = tmp_path / "first", tmp_path / "second"
    run(PRETRAIN, [*bf16, "--train-iters", 3, "--save", first, "--save-interval", 3], env)
    run(PRETRAIN, [*bf16, "--train-iters", 4, "--load", first, "--no-load-optim", "--save", second,
                   "--save-interval", 4], env)
    out = subprocess.run([sys.executable, "-c", _MAX_WEIGHT_CHANGE, str(first / "iter_0000003"),
                          str(second / "iter_0000004"), str(free_port())],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    change = float(out.stdout.split()[-1])
    assert 0 < change < 0.015, change  # lr 0.01, and bf16's rounding


def test_kill_mid_persist_keeps_the_previous_checkpoint(straight_run, tmp_path, env):
    _, straight = straight_run
    save = tmp_path / "ckpt"
    # Retention on (keep_last=1): it must not cost the one committed checkpoint when the next
    # save dies, and it removes it once the resumed run's save commits and the tracker moves.
    config = tmp_path / "keep1.json"
    config.write_text(json.dumps(dict(json.load(open(CONFIG, encoding="utf-8")), keep_last=1)))
    args = [*TINY_GPT, "--save", save, "--save-interval", 3, "--async-ckpt",
            "--async-ckpt-config", config, "--async-ckpt-writers", "balanced"]
    codes = run(KILL_WORKER, args, dict(env, KILL_AT_ITERATION="6"), expect_ok=False)
    assert all(c != 0 for c in codes), codes
    assert read_tracker(str(save)) == 3
    verify_checkpoint_dir(str(save / "iter_0000003"))
    with pytest.raises(IntegrityError):
        verify_checkpoint_dir(str(save / "iter_0000006"))  # never committed

    log = str(tmp_path / "log.jsonl")
    run(PRETRAIN, [*TINY_GPT, "--load", save, "--save", save, "--save-interval", 3,
                   "--async-ckpt", "--async-ckpt-config", config, "--log-json", log], env)
    resumed = steps(log)
    assert resumed == {k: v for k, v in straight.items() if k[1] > 3}
    assert read_tracker(str(save)) == 6
    verify_checkpoint_dir(str(save / "iter_0000006"))
    assert not (save / "iter_0000003").exists()  # keep_last=1, once iteration 6 is the tracker's


MEMORY_KILL_WORKER = os.path.join(REPO, "tests", "integration", "megatron_workers", "memory_kill_worker.py")


@pytest.mark.parametrize("per_node", [None, 2], ids=["one_node", "two_nodes"])
def test_tp2_killed_between_disk_saves_resumes_from_the_memory_tier(straight_run, tmp_path, env, per_node):
    """Memory tier on, a save every iteration and every third on disk (1 and 4): every rank
    SIGKILLed right after issuing iteration 6's save resumes from iteration 5, in memory only,
    with the straight run's losses; the keeper ends with the resumed job, leaving no memory. On
    two nodes (two ranks each, a keeper each), each node's keeper holds its ranks' shards only,
    and the restore fetches the rest from the other node."""
    from deepspeed_async_ckpt.memory.address import KeeperAddress
    from deepspeed_async_ckpt.memory.client import KeeperClient

    _, straight = straight_run
    save = tmp_path / "ckpt"
    config = tmp_path / "memory.json"
    config.write_text(json.dumps(dict(json.load(open(CONFIG, encoding="utf-8")), memory={
        "enabled": True, "persist_every": 3, "idle_timeout_s": 120})))
    run_env = dict(env, XDG_RUNTIME_DIR=str(tmp_path))  # the keeper's log: the test's
    args = [*TINY_GPT, "--save", save, "--save-interval", 1, "--async-ckpt", "--async-ckpt-config", config]
    codes = run(MEMORY_KILL_WORKER, args, dict(run_env, KILL_AT_ITERATION="6"), expect_ok=False, per_node=per_node)
    assert all(c == -9 for c in codes), codes
    assert read_tracker(str(save)) == 4  # disk: iterations 1 and 4
    assert not (save / "iter_0000005").exists()  # memory only
    nodes = NPROC // (per_node or NPROC)
    for node in range(nodes):
        keeper = KeeperClient.find(str(save), node=node)
        assert keeper is not None  # outlived every rank
        newest = keeper.newest()
        assert newest.name == "iter_0000005" and sorted(newest.late) == [".metadata", "metadata.json"]
        assert sorted(newest.ranks) == list(range(node * NPROC // nodes, (node + 1) * NPROC // nodes))
        newest.close()
        keeper.close()

    log = str(tmp_path / "log.jsonl")
    run(PRETRAIN, [*args, "--load", save, "--log-json", log], run_env, per_node=per_node)
    events = [json.loads(line) for line in open(log, encoding="utf-8")]
    assert {e["iteration"] for e in events if e["event"] == "resumed"} == {5}
    resumed = steps(log)
    assert resumed and resumed == {k: v for k, v in straight.items() if k[1] > 5}
    assert read_tracker(str(save)) == 6  # the resumed run's first save persists
    verify_checkpoint_dir(str(save / "iter_0000006"))
    for node in range(nodes):
        key = KeeperAddress.of(str(save), node=node).key
        deadline = time.monotonic() + 30  # its last save persisted: the keepers end, their memory freed
        while (KeeperClient.find(str(save), node=node) is not None
               or [n for n in os.listdir("/dev/shm") if key in n]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert KeeperClient.find(str(save), node=node) is None
        assert not [n for n in os.listdir("/dev/shm") if key in n], os.listdir("/dev/shm")
