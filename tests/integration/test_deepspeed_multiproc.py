"""Real multi-process DeepSpeed runs (CPU, gloo): equality with TorchCheckpointEngine, sync ==
async, kill mid-persist, corruption, engine selection and auto-activation."""

import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import time
import zipfile

import pytest
import torch

from _compare import assert_same
from conftest import REPO
from deepspeed_async_ckpt.tools.launch import launch

WORKER = os.path.join(REPO, "tests", "integration", "workers", "ds_worker.py")

pytestmark = pytest.mark.slow


BACKEND = os.environ.get("ASYNC_CKPT_TEST_BACKEND", "gloo")


def run_ranks(env, nproc, *args, expect_ok=True, timeout=300):
    if BACKEND == "nccl":
        if nproc > torch.cuda.device_count():
            pytest.skip(f"needs {nproc} GPUs for NCCL, {torch.cuda.device_count()} visible")
        env = dict(env, DS_ACCELERATOR="cuda")
    codes = launch(WORKER, [str(a) for a in args], nproc, timeout=timeout, env=env)
    if expect_ok:
        assert codes == [0] * nproc, f"rank exit codes {codes} for {args}"
    return codes


def record_bytes_within(path, start, end) -> int:
    """Bytes of the tensor records of the ``torch.save`` archive at ``path`` whose data starts
    in [start, end) (read from the zip's own headers)."""
    total = 0
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            if "/data/" not in info.filename or not info.file_size:
                continue
            f.seek(info.header_offset)
            name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
            if start <= info.header_offset + 30 + name_len + extra_len < end:
                total += info.file_size
    return total


def storage_bytes(obj) -> int:
    seen, total, stack = set(), 0, [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor) and o.layout == torch.sparse_coo:
            stack.extend((o._indices(), o._values()))  # the tensors its record holds
        elif isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return total


# tied: two layers share a weight (tied embeddings' shape), which DeepSpeed records in the
# model-states file's `shared_params` on global rank 0 only
# offload: ZeRO-Offload, the fp32 partitions and Adam's state in host memory (on a GPU, what
# the fence now helps copy; here every tensor is on the CPU, but DeepSpeed's offload paths run)
CASES = [
    pytest.param(2, 0, 0, 0, 0, 0, id="2ranks-zero0-fp32"),
    pytest.param(2, 1, 1, 0, 1, 0, id="2ranks-zero1-bf16-tied"),
    pytest.param(2, 2, 0, 0, 0, 0, id="2ranks-zero2-fp32"),
    pytest.param(2, 2, 1, 0, 0, 1, id="2ranks-zero2-bf16-offload"),
    pytest.param(2, 3, 1, 0, 0, 0, id="2ranks-zero3-bf16"),
    pytest.param(4, 2, 1, 0, 1, 0, id="4ranks-zero2-bf16-tied"),
    pytest.param(2, 0, 0, 2, 0, 0, id="2ranks-pipeline2-fp32"),
]


@pytest.mark.parametrize("nproc,zero,bf16,pp,tied,offload", CASES)
def test_async_checkpoint_equals_torch_engine_and_sync_mode(tmp_path, repo_env, nproc, zero, bf16, pp, tied,
                                                           offload):
    out = str(tmp_path)
    flags = ["--out", out, "--zero-stage", zero, "--bf16", bf16, "--pipeline-stages", pp, "--tied", tied,
             "--offload", offload]
    run_ranks(repo_env, nproc, "save", *flags)

    torch_files = sorted(glob.glob(os.path.join(out, "torch", "global_step3", "*.pt")))
    assert torch_files
    for ref in torch_files:
        name = os.path.basename(ref)
        ours = os.path.join(out, "async", "global_step3", name)
        # every tensor and value equals what TorchCheckpointEngine wrote at the same step,
        # although training went on mutating them right after save_checkpoint returned
        assert_same(torch.load(ours, weights_only=False), torch.load(ref, weights_only=False), name)
        # the synchronous mode is the same pipeline run inline, and the replicas' shares make
        # the file the first replica writes alone: byte-identical files
        for other in ("sync", "whole"):
            with open(ours, "rb") as a, open(os.path.join(out, other, "global_step3", name), "rb") as b:
                assert a.read() == b.read(), f"{name}: {other} and async files differ"
    for variant in ("async", "sync"):
        with open(os.path.join(out, variant, "latest")) as f:
            assert f.read() == "global_step3"
        from deepspeed_async_ckpt.commit import verify_checkpoint
        manifest = verify_checkpoint(os.path.join(out, variant, "global_step3"))
        assert sorted(manifest["files"]) == sorted(os.path.basename(p) for p in torch_files)

    # Only what a rank writes is staged; each rank's bytes equal the tensors of its own files,
    # and of its share of the model-states file, which every data-parallel replica holds and
    # writes a share of (without ZeRO-3 and pipeline stages, here: every rank is a replica).
    ckpt = os.path.join(out, "async", "global_step3")
    manifest = json.load(open(os.path.join(ckpt, ".async_ckpt", "manifest.json")))
    split = not pp and zero < 3
    model_file = os.path.join(ckpt, "mp_rank_00_model_states.pt")
    shares = {}  # rank -> tensor bytes of its share of the model-states file
    for rank in range(nproc):
        stats = json.load(open(os.path.join(out, f"stats_rank{rank}.json")))
        own = manifest["ranks"][str(rank)]
        record, = glob.glob(os.path.join(ckpt, ".async_ckpt", f"rank_{rank:05d}.*.json"))
        expected = 0
        for name, entry in json.load(open(record))["files"].items():
            if "segments" in entry:
                (offset, length, _), = entry["segments"]
                shares[rank] = record_bytes_within(os.path.join(ckpt, name), offset, offset + length)
                expected += shares[rank]
            else:
                expected += storage_bytes(torch.load(os.path.join(ckpt, name), weights_only=False))
        assert stats["staged_bytes"] == stats["planned_bytes"] == expected, (rank, stats, own)
        if not pp and zero < 3:  # (else a model-states file per rank or pipeline stage)
            assert ("mp_rank_00_model_states.pt" in own) == (split or rank == 0), (rank, own)
    if tied:  # what rank 0 alone lists (the other replicas' states: none), yet split below
        assert torch.load(model_file, weights_only=False)["shared_params"] == {"3.weight": "0.weight"}
    if split:  # one share per rank, each with records, together the file end to end
        assert sorted(shares) == list(range(nproc)) and all(shares.values()), shares
        assert sum(shares.values()) == storage_bytes(torch.load(model_file, weights_only=False))
        segments = manifest["files"]["mp_rank_00_model_states.pt"]["segments"]
        assert len(segments) == nproc and segments[0][0] == 0
        assert all(a[0] + a[1] == b[0] for a, b in zip(segments, segments[1:]))
        assert segments[-1][0] + segments[-1][1] == os.path.getsize(model_file)
    else:
        assert not shares, shares
    for rank in range(nproc):
        stats = json.load(open(os.path.join(out, f"stats_rank{rank}.json")))
        assert stats["cpu_offload"] == bool(offload), stats  # DeepSpeed took the config as meant
        assert stats["pool_peak"] <= stats["pool_capacity"]
        # The pool was sized from the live state after the first step and faulted in then:
        # the first save allocated nothing, and the estimate did not reserve much more.
        assert stats["pool_allocations"] == stats["allocations_before_save"], (rank, stats)
        needed = stats["pool_bytes_needed"]
        assert needed <= stats["reserved_bytes"] <= 1.5 * needed, (rank, stats)

    # A fresh run restores exactly the same engine state from each variant.
    partial = int(zero == 1)
    run_ranks(repo_env, nproc, "load", *flags, "--partial", partial)
    if partial:  # load_optimizer_states=False / load_lr_scheduler_states=False are honoured
        for rank in range(nproc):
            got = torch.load(os.path.join(out, f"dump_partial_rank{rank}.pt"), weights_only=False)
            ref = torch.load(os.path.join(out, f"dump_torch_rank{rank}.pt"), weights_only=False)
            assert_same(got["module"], ref["module"], "partial-load module")
            assert_same(got["lr_scheduler"], got["fresh"]["lr_scheduler"], "scheduler not loaded")
            assert got["lr_scheduler"] != ref["lr_scheduler"]
    # Verification on load read every file of our checkpoints exactly once across the ranks
    # (each rank a share), not the shared model-states file once per rank; torch's: none.
    hashed = [json.load(open(os.path.join(out, f"hashed_rank{r}.json"))) for r in range(nproc)]
    for variant in ("async", "sync"):
        files = json.load(open(os.path.join(out, variant, "global_step3", ".async_ckpt", "manifest.json")))["files"]
        assert sum(h[variant] for h in hashed) == sum(e["bytes"] for e in files.values()), (variant, hashed)
        if split:  # the model-states file's shares are checked by different ranks, too
            assert all(h[variant] for h in hashed), (variant, hashed)
    assert all(h["torch"] == 0 for h in hashed)
    if partial:  # ZeRO: a load without optimizer states hashed every file but the optimizer's
        files = json.load(open(os.path.join(out, "async", "global_step3", ".async_ckpt", "manifest.json")))["files"]
        read = sum(e["bytes"] for name, e in files.items() if not name.endswith("optim_states.pt"))
        assert 0 < read < sum(e["bytes"] for e in files.values())
        assert sum(h["partial"] for h in hashed) == read, (read, hashed)
    for rank in range(nproc):
        ref = torch.load(os.path.join(out, f"dump_torch_rank{rank}.pt"), weights_only=False)
        assert ref["global_steps"] == 3
        # client_state's sparse mask as it was at the save, not as changed right after it
        mask = torch.load(os.path.join(out, f"mask_torch_rank{rank}.pt"), weights_only=True)
        assert mask._values().tolist() == [1.0, 2.0, 3.0]
        for variant in ("async", "sync"):
            got = torch.load(os.path.join(out, f"dump_{variant}_rank{rank}.pt"), weights_only=False)
            assert_same(got, ref, f"rank{rank}:{variant}")
            got = torch.load(os.path.join(out, f"mask_{variant}_rank{rank}.pt"), weights_only=True)
            assert_same(got, mask, f"rank{rank}:{variant}: client_state mask")

    if zero:  # DeepSpeed's own offline tool reads our files unchanged
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        ours = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out, "async"))
        theirs = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out, "torch"))
        assert_same(dict(ours), dict(theirs), "zero_to_fp32")


@pytest.mark.parametrize("zero", [1, 3])
def test_buffers_a_forward_updates_are_saved_as_they_were_at_save_time(tmp_path, repo_env, zero):
    """BatchNorm's running statistics change in the forward after ``save_checkpoint``, before
    the fence that guards the optimizer step. With the copier held until that fence, a lazy
    copy would take the next step's statistics (as it did before they were copied eagerly).
    The replicas' statistics differ (each sees its own batches): the model-states file holds
    the first replica's, as DeepSpeed's engine writes it, not a mix of the replicas' shares."""
    run_ranks(repo_env, 2, "buffers", "--out", tmp_path, "--zero-stage", zero)
    result = json.loads((tmp_path / "buffers.json").read_text())
    assert result.pop("changed_since"), "the forward after the save did not change the statistics"
    assert sorted(result) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    assert all(result.values()), result


@pytest.mark.parametrize("zero", [1, 3])
def test_save_16bit_model_writes_its_file_before_returning_and_saving_goes_on(tmp_path, repo_env, zero):
    """``save_16bit_model`` (DeepSpeed's 16-bit weights export) calls the checkpoint engine's
    create/save/commit outside ``save_checkpoint``. The file is written before the call
    returns, tensor for tensor what DeepSpeed's own engine writes, with no checkpoint
    directory beside it, and checkpointing goes on: a checkpoint opened and never ended
    would leave the file unwritten and the next ``save_checkpoint`` raising on every rank."""
    from deepspeed_async_ckpt.commit import verify_checkpoint

    run_ranks(repo_env, 2, "export", "--out", tmp_path, "--zero-stage", zero)
    assert json.loads((tmp_path / "export.json").read_text()) == {"returned": True, "exists_on_return": True}
    assert os.listdir(tmp_path / "export_async") == ["pytorch_model.bin"]
    ours, theirs = (torch.load(tmp_path / d / "pytorch_model.bin", weights_only=False)
                    for d in ("export_async", "export_torch"))
    assert_same(ours, theirs, "save_16bit_model")
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    verify_checkpoint(str(tmp_path / "ckpt" / "global_step2"))


def test_files_persisted_by_worker_processes_equal_the_writer_threads(tmp_path, repo_env):
    """``persist_in: "process"`` (each rank's files written by its worker process, the model
    states in shares across the replicas): the very bytes the writer threads write, in the
    synchronous mode and with the first replica writing the model states whole."""
    out = str(tmp_path)
    run_ranks(repo_env, 2, "save", "--out", out, "--zero-stage", 1, "--bf16", 1, "--tied", 1,
              "--persist-in", "process")
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "torch", "global_step3", "*.pt")))
    assert names
    for name in names:
        with open(os.path.join(out, "async", "global_step3", name), "rb") as f:
            ours = f.read()
        for other in ("sync", "whole"):
            with open(os.path.join(out, other, "global_step3", name), "rb") as f:
                assert ours == f.read(), f"{name}: {other} (threads) and process files differ"
    from deepspeed_async_ckpt.commit import verify_checkpoint
    assert sorted(verify_checkpoint(os.path.join(out, "async", "global_step3"))["files"]) == names


@pytest.mark.parametrize("zero", [0, 1])
def test_moe_expert_files_match_deepspeeds_and_load_back(tmp_path, repo_env, zero):
    """DeepSpeed's MoE save writes one file per expert and per-expert-parallel-rank optimizer
    files through the checkpoint engine, with writer rules of its own (the expert-data-parallel
    group): the same files as DeepSpeed's own engine, byte for byte in tensors, and each load
    restores the same state."""
    from deepspeed_async_ckpt.commit import verify_checkpoint

    run_ranks(repo_env, 2, "moe", "--out", tmp_path, "--zero-stage", zero)
    ours, theirs = tmp_path / "async" / "global_step3", tmp_path / "torch" / "global_step3"
    names = sorted(n for n in os.listdir(ours) if not n.startswith("."))
    assert names == sorted(os.listdir(theirs))
    assert {"layer_0_expert_0_mp_rank_00_model_states.pt", "layer_0_expert_1_mp_rank_00_model_states.pt"} <= set(names)
    for name in names:
        assert_same(torch.load(ours / name, weights_only=False), torch.load(theirs / name, weights_only=False), name)
    assert sorted(verify_checkpoint(str(ours))["files"]) == names
    for rank in (0, 1):
        got, ref = (torch.load(tmp_path / f"moe_{v}_rank{rank}.pt", weights_only=False) for v in ("async", "torch"))
        assert got["global_steps"] == 3
        assert_same(got, ref, f"rank {rank}'s load")


def test_deepspeed_universal_checkpoint_converts_and_loads_as_deepspeeds_own(tmp_path, repo_env):
    """DeepSpeed's ``ds_to_universal`` reads checkpoint files with ``torch.load`` directly: the
    conversion of this engine's checkpoint is tensor for tensor that of DeepSpeed's own at
    the same state (ZeRO-1, 2 ranks), and ``load_checkpoint`` with ``load_universal`` (through
    this engine's load path) restores the same state from either."""
    run_ranks(repo_env, 2, "universal", "--out", tmp_path, "--zero-stage", 1)
    converted = {}
    for variant in ("async", "torch"):
        src = tmp_path / variant
        out = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                              str(src / "global_step3"), "--output_folder", str(tmp_path / f"{variant}_u" / "u3"),
                              "--num_extract_workers", "1", "--num_merge_workers", "1"],
                             env=repo_env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        (tmp_path / f"{variant}_u" / "latest_universal").write_text("u3")
        root = tmp_path / f"{variant}_u" / "u3"
        converted[variant] = {str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file()}
    assert sorted(converted["async"]) == sorted(converted["torch"])
    assert any(name.startswith("zero" + os.sep) for name in converted["async"])
    for name, path in converted["async"].items():
        assert_same(*(torch.load(p, weights_only=False) for p in (path, converted["torch"][name])), name)
    run_ranks(repo_env, 2, "load", "--out", tmp_path, "--zero-stage", 1, "--universal", 1,
              "--variants", "async_u,torch_u")
    for rank in (0, 1):
        got, ref = (torch.load(tmp_path / f"dump_{v}_rank{rank}.pt", weights_only=False) for v in ("async_u", "torch_u"))
        assert got["global_steps"] == 3
        assert_same(got, ref, f"rank {rank}'s universal load")


def test_zero3_weights_changed_through_gathered_parameters_after_a_save_keep_their_saved_values(tmp_path, repo_env):
    """``zero.GatheredParameters(modifier_rank=...)`` is DeepSpeed's way to change ZeRO-3
    parameters outside the optimizer step (the hybrid engine's generate() uses it to fuse LoRA
    weights into frozen ones). Only the optimizer step waited for a save's lazy copies, so such
    an edit before the next step reached the file (with the copier held until a fence); now
    entering the context fences first. The reference is DeepSpeed's own engine's save of the
    same state."""
    run_ranks(repo_env, 2, "gathered", "--out", tmp_path, "--zero-stage", 3)
    ours, theirs = tmp_path / "async" / "global_step2", tmp_path / "torch" / "global_step2"
    names = sorted(n for n in os.listdir(ours) if not n.startswith("."))
    assert names == sorted(os.listdir(theirs)) and len(names) == 4, names
    for name in names:
        assert_same(torch.load(ours / name, weights_only=False), torch.load(theirs / name, weights_only=False), name)


def test_sigkill_mid_persist_keeps_previous_checkpoint(tmp_path, repo_env):
    out = str(tmp_path)
    codes = run_ranks(repo_env, 2, "kill", "--out", out, "--kill-rank", "1", expect_ok=False)
    assert codes[1] == -9, f"rank 1 should have died by SIGKILL, exit codes {codes}"
    ckpt = os.path.join(out, "ckpt")
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "global_step2"
    assert not os.path.exists(os.path.join(ckpt, "global_step4", ".async_ckpt", "manifest.json"))
    # keep_last=1: global_step1 went once global_step2 committed; the failed save removed nothing
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("global_step")) == ["global_step2", "global_step4"]
    from deepspeed_async_ckpt.commit import abandoned_checkpoints, verify_checkpoint
    verify_checkpoint(os.path.join(ckpt, "global_step2"))
    verify_checkpoint(os.path.join(ckpt, "best"))  # saved aside (save_latest=False): kept
    # the killed save is this engine's, partial: the next commit's retention removes it
    assert abandoned_checkpoints(ckpt, before=time.time() + 1) == ["global_step4"]
    # the previous checkpoint loads in a fresh run (load phase restores `latest`)
    os.rename(ckpt, os.path.join(out, "killed"))
    run_ranks(repo_env, 2, "load", "--out", out, "--variants", "killed")
    state = torch.load(os.path.join(out, "dump_killed_rank0.pt"), weights_only=False)
    assert state["global_steps"] == 2


def test_sigkill_while_resaving_the_tag_latest_names_keeps_that_checkpoint(tmp_path, repo_env):
    """The same tag saved again (a final save at the step of the last periodic one, a save on
    preemption): the re-save goes to a staging directory, so the checkpoint `latest` names
    stays whole until the new one is committed. A re-save that removed its manifest first
    would leave nothing loadable after a crash (or a failed write)."""
    out = str(tmp_path)
    codes = run_ranks(repo_env, 2, "kill", "--out", out, "--kill-rank", "0", "--resave", "1",
                      expect_ok=False)
    assert codes[0] == -9, f"rank 0 should have died by SIGKILL, exit codes {codes}"
    ckpt = os.path.join(out, "ckpt")
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "global_step2"
    names = sorted(os.listdir(ckpt))
    staging = [n for n in names if n.startswith(".async_ckpt_staging.")]
    assert len(staging) == 1 and staging[0].endswith(".global_step2"), names  # the killed re-save
    from deepspeed_async_ckpt.commit import verify_checkpoint
    verify_checkpoint(os.path.join(ckpt, "global_step2"))
    os.rename(ckpt, os.path.join(out, "killed"))
    run_ranks(repo_env, 2, "load", "--out", out, "--variants", "killed")
    for rank in (0, 1):  # the state saved at step 2, not the re-save's (step 4)
        state = torch.load(os.path.join(out, f"dump_killed_rank{rank}.pt"), weights_only=False)
        assert state["global_steps"] == 2
    # the load leaves the staging directory (it could be another job's save in flight); the
    # next save's rank 0 removes it (tests/unit/test_commit_replace.py, the staging left by a crash)
    assert [n for n in os.listdir(os.path.join(out, "killed"))
            if n.startswith(".async_ckpt_staging.")] == staging


def test_weights_edited_after_a_save_without_fence_all_fail_that_save_at_the_next_step(tmp_path, repo_env):
    """Every rank scales its weights in place right after a save, without ``fence_all()``, the
    save's copies held until the next step's fence. The edited weights must not reach the
    file with no word: that step raises on every rank naming the model-states file and
    ``fence_all()``, the save is not committed (``wait()`` raises its failure), ``latest``
    keeps the previous checkpoint, and a later save commits."""
    out = str(tmp_path)
    run_ranks(repo_env, 2, "edit", "--out", out, "--zero-stage", 1)
    for rank in range(2):
        result = json.load(open(os.path.join(out, f"edit_rank{rank}.json")))
        assert result["step"].startswith("SnapshotError: staging "), result
        assert "model_states.pt: tensor record" in result["step"] and "fence_all()" in result["step"], result
        assert "changed in place after the save" in result["step"], result
        assert result["wait"].startswith("PersistError: a previous checkpoint failed") \
            and "global_step3/mp_rank_00_model_states.pt" in result["wait"], result
        assert result["latest_after_failure"] == "global_step2"
        assert result["latest_after_recovery"] == "recovered"
    from deepspeed_async_ckpt.commit import verify_checkpoint
    for tag in ("global_step2", "recovered"):
        verify_checkpoint(os.path.join(out, "ckpt", tag))


def test_disk_full_on_one_rank_raises_on_every_rank_at_next_save(tmp_path, repo_env):
    out = str(tmp_path)
    run_ranks(repo_env, 2, "diskfull", "--out", out, "--kill-rank", "1")
    r0, r1 = (json.load(open(os.path.join(out, f"diskfull_rank{r}.json"))) for r in (0, 1))
    assert r0["latest_after_failure"] == r1["latest_after_failure"] == "global_step2"
    assert r1["raised"].startswith("PersistError") and "No space left on device" in r1["raised"]
    assert "zero_pp_rank_1" in r1["raised"]  # names the file
    assert r0["raised"] is not None and "rank(s) 1" in r0["raised"], r0["raised"]
    assert r0["latest_after_recovery"] == "recovered"
    from deepspeed_async_ckpt.commit import verify_checkpoint
    for tag in ("global_step2", "recovered"):
        verify_checkpoint(os.path.join(out, "ckpt", tag))
    assert not os.path.exists(os.path.join(out, "ckpt", "global_step4", ".async_ckpt", "manifest.json"))


@pytest.mark.parametrize("failing", [0, 1, -1])
def test_sync_mode_disk_full_on_one_rank_raises_from_that_save_on_every_rank(tmp_path, repo_env, failing):
    """Sync mode: the failing rank raised its write error out of DeepSpeed's save_checkpoint
    while the others went on into its closing barrier and waited there for good (DeepSpeed's
    own engine does the same). The error is now held until DeepSpeed's save is done on every
    rank, then shared: every rank raises from that save_checkpoint, the failing one its own
    error, the others naming it; nothing moved `latest`, and the next save commits."""
    out = str(tmp_path)
    run_ranks(repo_env, 2, "diskfull-sync", "--out", out, "--kill-rank", failing, timeout=120)
    results = [json.load(open(os.path.join(out, f"diskfull_sync_rank{r}.json"))) for r in (0, 1)]
    if failing == -1:  # every rank's disk, and rank 0's copy of zero_to_fp32.py after its writes
        for rank, r in enumerate(results):  # (DeepSpeed's own step, on rank 0 alone)
            assert r["raised"] is not None and r["raised"].startswith("PersistError"), results
            assert f"zero_pp_rank_{rank}" in r["raised"] or "model_states" in r["raised"], results
    else:
        mine, theirs = results[failing]["raised"], results[1 - failing]["raised"]
        assert mine is not None and mine.startswith("PersistError") and "No space left on device" in mine, results
        assert f"zero_pp_rank_{failing}" in mine or "model_states" in mine, mine  # names the file
        assert theirs is not None and theirs.startswith("CommitError"), results
        assert f"rank(s) {failing}" in theirs and "No space left on device" in theirs, theirs
        assert "global_step4" in theirs, theirs
    for r in results:
        assert r["latest_before"] == r["latest_after_failure"] == "global_step2", r
        assert r["latest_after_recovery"] == "recovered", r
    from deepspeed_async_ckpt.commit import verify_checkpoint
    for tag in ("global_step2", "recovered"):
        verify_checkpoint(os.path.join(out, "ckpt", tag))
    assert not os.path.exists(os.path.join(out, "ckpt", "global_step4", ".async_ckpt", "manifest.json"))


@pytest.mark.parametrize("failing", [0, 1])
def test_disk_full_on_one_rank_refuses_load_checkpoint_on_every_rank_then_retry_loads(tmp_path, repo_env,
                                                                                    failing):
    # failing=0: rank 1 has no error of its own and learns of rank 0's failure only through the
    # exchange; failing=1: rank 0's commit fails too (it waited for rank 1's part).
    out = str(tmp_path)
    run_ranks(repo_env, 2, "diskfull-load", "--out", out, "--kill-rank", failing, timeout=240)
    results = [json.load(open(os.path.join(out, f"diskfull_load_rank{r}.json"))) for r in (0, 1)]
    other = 1 - failing
    mine, theirs = results[failing]["raised"], results[other]["raised"]
    # every rank raised: none went on into DeepSpeed's load (to hang in its collectives, or to
    # load on some ranks only while the others raised)
    assert mine is not None and theirs is not None, results
    assert mine.startswith("PersistError: load_checkpoint refused on every rank"), mine
    assert "No space left on device" in mine, mine
    assert os.path.join("global_step4", "") in mine and ".pt" in mine  # names the file
    assert theirs.startswith("CommitError: load_checkpoint refused on every rank"), theirs
    assert f"rank(s) {failing}" in theirs, theirs  # names the failing rank
    for msg in (mine, theirs):
        assert "a previous checkpoint failed and was not committed (the last committed one is intact)" in msg
        assert "calling load_checkpoint again retries" in msg
    for rank, r in enumerate(results):
        assert r["global_steps_after_refusal"] == 4, r  # the refused load changed nothing
        # verify_on_load off checks no checksum, but still refuses, on every rank, a checkpoint
        # never committed (not into DeepSpeed's load, where one rank raised
        # FileNotFoundError, the other waited in a collective)
        assert "never committed" in (r["uncommitted_raised"] or ""), r
        assert r["latest"] == "global_step2"
        assert r["loaded"] is not None and r["loaded"].startswith("global_step2" + os.sep), r
        assert r["latest_after_save"] == "after_load"  # no error left pending on any rank
        # the retry restored exactly the state saved at step 2 (then training went on to step 4)
        saved = torch.load(os.path.join(out, f"diskfull_load_saved_rank{rank}.pt"), weights_only=False)
        loaded = torch.load(os.path.join(out, f"diskfull_load_loaded_rank{rank}.pt"), weights_only=False)
        assert saved["global_steps"] == 2
        assert_same(loaded, saved, f"rank{rank}: retried load")
    assert not os.path.exists(os.path.join(out, "ckpt", "global_step4", ".async_ckpt", "manifest.json"))


def test_training_script_that_returns_after_its_last_save_commits_it(tmp_path, repo_env):
    # Every rank returns from main while its last save is still being written: interpreter
    # exit finishes the writes on every rank, rank 0 commits, and a fresh run restores it.
    out = str(tmp_path)
    assert run_ranks(repo_env, 2, "exit", "--out", out) == [0, 0]
    assert_committed_at_exit_and_restored(repo_env, out, "exit", step=2, saved="exit_saved")


def assert_committed_at_exit_and_restored(repo_env, out, variant, *, step, saved):
    """``variant``'s `latest` names global_step<step>, which verifies and holds both ranks'
    parts, and a fresh run restores exactly the state the ranks dumped as ``saved``."""
    with open(os.path.join(out, variant, "latest")) as f:
        assert f.read() == f"global_step{step}"
    from deepspeed_async_ckpt.commit import verify_checkpoint
    manifest = verify_checkpoint(os.path.join(out, variant, f"global_step{step}"))
    assert sorted(manifest["ranks"]) == ["0", "1"]
    run_ranks(repo_env, 2, "load", "--out", out, "--variants", variant)
    for rank in range(2):
        before = torch.load(os.path.join(out, f"{saved}_rank{rank}.pt"), weights_only=False)
        loaded = torch.load(os.path.join(out, f"dump_{variant}_rank{rank}.pt"), weights_only=False)
        assert before["global_steps"] == step
        assert_same(loaded, before, f"rank{rank}: {variant} checkpoint committed at exit")


def test_sigterm_handled_by_the_script_saves_and_the_exit_flush_commits_it(tmp_path, repo_env):
    # The README's preemption recipe: SIGTERM at step 3 sets a flag, the loop saves at step 4
    # and returns while that save is still being written; interpreter exit commits it.
    out = str(tmp_path)
    assert run_ranks(repo_env, 2, "sigterm", "--out", out) == [0, 0]
    assert_committed_at_exit_and_restored(repo_env, out, "preempted", step=4, saved="sigterm_saved")


@pytest.mark.parametrize("zero,partial,tag", [(1, 0, None), (3, 1, None), (3, 1, "older")],
                         ids=["zero1", "zero3-without-optimizer", "zero3-without-optimizer-another-tag"])
def test_corrupted_byte_is_detected_on_load_naming_the_file(tmp_path, repo_env, zero, partial, tag):
    """Also under ZeRO-3 with ``load_optimizer_states=False``: DeepSpeed then rebuilds the
    module from the fp32 partitions in the optimizer files, which the check left out as if
    the load did not read them, so a damaged one loaded silently. It
    reads those of the checkpoint ``latest`` names even when asked for another tag: a load
    of ``older`` checks the optimizer files of ``global_step3`` too."""
    out = str(tmp_path)
    flags = ["--out", out, "--zero-stage", str(zero)]
    run_ranks(repo_env, 2, "save", *flags)
    if tag is not None:  # an older checkpoint beside the one `latest` names (a copy of it)
        shutil.copytree(os.path.join(out, "async", "global_step3"), os.path.join(out, "async", tag))
        flags += ["--partial-tag", tag]
    victim = os.path.join(out, "async", "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    log = tmp_path / "load.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "launch.py"), "--nproc", "2",
                               "--timeout", "300", WORKER, "load", *flags, "--variants", "async",
                               "--partial", str(partial)],
                              env=repo_env, stdout=f, stderr=subprocess.STDOUT)
    assert proc.returncode != 0
    text = log.read_text()
    assert "IntegrityError" in text and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in text and "corrupted" in text
    # Refused on every rank before DeepSpeed's load began (no rank left waiting in its
    # collectives): the rank whose share held the file names it, the other names that rank.
    errors = [open(os.path.join(out, f"load_error_rank{r}.txt")).read() for r in range(2)]
    for e in errors:
        assert e.startswith("IntegrityError: load_checkpoint refused on every rank"), e
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in e and "corrupted" in e, e
    assert sum("because of rank(s)" in e for e in errors) == 1, errors
    if partial:  # refused by the load without optimizer states, the worker's first
        assert not glob.glob(os.path.join(out, "dump_partial_rank*.pt"))


class _Engine:
    """What ``files_read_by_load`` asks of a ``DeepSpeedEngine``."""

    def __init__(self, stage: int, moe: bool = False, universal: bool = False) -> None:
        self.stage, self.has_moe_layers, self.universal = stage, moe, universal

    def zero_optimization(self):
        return self.stage > 0

    def zero_optimization_partition_weights(self):
        return self.stage == 3

    def zero_nvme_offload_optimizer(self):
        return False

    def load_universal_checkpoint(self):
        return self.universal


@pytest.mark.parametrize("stage,moe,universal,arguments,optimizer_files_read", [
    (0, False, False, {"load_optimizer_states": False}, True),  # without ZeRO: one file holds all
    (1, False, False, {}, True),
    (1, False, False, {"load_optimizer_states": False}, False),
    (2, False, False, {"load_module_only": True}, False),
    (1, False, True, {"load_optimizer_states": False}, True),
    (3, False, False, {}, True),
    (3, False, False, {"load_optimizer_states": False}, True),  # the module from their fp32 partitions
    (3, False, False, {"load_module_only": True}, False),
    (3, True, False, {"load_module_only": True}, True),
])
def test_files_a_deepspeed_load_reads(stage, moe, universal, arguments, optimizer_files_read):
    from deepspeed_async_ckpt.integrations.deepspeed.loading import files_read_by_load

    include = files_read_by_load(_Engine(stage, moe, universal), dict(arguments, load_dir="d"))
    assert include is None or include("mp_rank_00_model_states.pt")
    assert (include is None or include("zero_pp_rank_1_mp_rank_00_optim_states.pt")) == optimizer_files_read


def test_a_zero3_load_without_optimizer_takes_the_module_from_the_checkpoint_latest_names(tmp_path):
    """DeepSpeed's ZeRO-3 load without optimizer states reads the module from the checkpoint
    ``latest`` names, whatever tag was asked for: that one is named (warned about, and its
    optimizer files checked); an unreadable ``latest`` names none (rank 0 alone warns, between
    two collectives: it must not raise there)."""
    from deepspeed_async_ckpt.integrations.deepspeed.loading import zero3_module_source

    (tmp_path / "latest").write_text("global_step4")
    asked = {"load_dir": str(tmp_path), "tag": "global_step2", "load_optimizer_states": False}
    for engine, arguments in ((_Engine(1), asked), (_Engine(3, moe=True), asked),
                              (_Engine(3), dict(asked, load_optimizer_states=True)),
                              (_Engine(3), dict(asked, tag="global_step4")), (_Engine(3), dict(asked, tag=None))):
        assert zero3_module_source(engine, arguments) is None, arguments
    assert zero3_module_source(_Engine(3), asked) == str(tmp_path / "global_step4")
    (tmp_path / "latest").write_bytes(b"\xff\xfe")
    assert zero3_module_source(_Engine(3), asked) is None


def test_the_ranks_load_the_tag_rank_0_read_from_latest(tmp_path):
    """Each rank read `latest` itself (the plugin's check, then DeepSpeed's load again): when
    another job wrote its first `latest` between the ranks' reads, one rank loaded nothing and
    the other loaded, and they parted ways in the collectives. The tag
    is now rank 0's read, exchanged, and passed to DeepSpeed; a rank that cannot read its copy
    makes every rank raise. A ZeRO-3 load without optimizer states checks the module's
    source on every rank alike."""
    from deepspeed_async_ckpt.integrations.deepspeed.loading import agreed_latest_tag, takes_module_from_latest
    from deepspeed_async_ckpt.errors import CommitError, Failure

    class Checkpointer:
        def __init__(self, rank0_reads, failed=None):
            self.rank0_reads, self.failed, self.sent = rank0_reads, failed or {}, []

        def exchange(self, value, error, key=""):
            self.sent.append((value, error))
            return self.rank0_reads, self.failed

    # this rank sees no `latest` yet; rank 0 saw global_step4: every rank loads global_step4
    ck = Checkpointer("global_step4")
    assert agreed_latest_tag(ck, str(tmp_path)) == "global_step4" and ck.sent == [(None, None)]
    (tmp_path / "latest").write_text("global_step6\n")
    ck = Checkpointer(None)  # the other way round: rank 0 saw none, so no rank loads
    assert agreed_latest_tag(ck, str(tmp_path)) is None and ck.sent == [("global_step6", None)]
    # an empty `latest` is not "no checkpoint" (a script would start over): every rank raises,
    # as DeepSpeed does (not loading nothing, silently)
    (tmp_path / "latest").write_text(" \n")
    with pytest.raises(CommitError, match="latest is empty"):
        agreed_latest_tag(Checkpointer(""), str(tmp_path))
    (tmp_path / "latest").write_bytes(b"\xff\xfe")
    ck = Checkpointer("global_step4", failed={1: Failure("UnicodeDecodeError", "invalid start byte")})
    with pytest.raises(CommitError, match=r"load_checkpoint refused on every rank: cannot read .*latest: "
                                          r"invalid start byte \(rank\(s\) 1: UnicodeDecodeError"):
        agreed_latest_tag(ck, str(tmp_path))
    assert ck.sent[0][1].kind == "UnicodeDecodeError"
    asked = {"load_dir": str(tmp_path), "tag": "global_step2", "load_optimizer_states": False}
    assert takes_module_from_latest(_Engine(3), asked)
    assert not takes_module_from_latest(_Engine(3), dict(asked, tag=None))
    assert not takes_module_from_latest(_Engine(1), asked)


def test_engine_selection_and_config_errors(tmp_path, repo_env):
    run_ranks(repo_env, 1, "engines", "--out", str(tmp_path))
    result = json.load(open(tmp_path / "engines.json"))
    assert result["absent"] == "TorchCheckpointEngine"
    assert result["disabled"] == "TorchCheckpointEngine"
    assert result["enabled"] == "AsyncCheckpointEngine"
    assert result["bad"].startswith("ConfigError") and "async_checkpoint.writer_thread" in result["bad"]
    assert "writer_threads" in result["bad"]  # names the allowed keys


def test_auto_activation_comes_from_the_installed_pth_and_can_be_switched_off(tmp_path, repo_env):
    pth = os.path.join(sysconfig.get_paths()["purelib"], "deepspeed_async_ckpt.pth")
    assert os.path.exists(pth), "run `pip install .` (a regular install carries the .pth hook)"
    probe = ("import deepspeed.runtime.engine as e;"
             "print(hasattr(e.create_checkpoint_engine, '__wrapped__'));"
             "import deepspeed_async_ckpt as d; d.install(); print(hasattr(e.create_checkpoint_engine, '__wrapped__'))")
    on = subprocess.run([sys.executable, "-c", probe], env=repo_env, capture_output=True, text=True)
    assert on.returncode == 0, on.stderr
    assert on.stdout.split()[-2:] == ["True", "True"]
    off = subprocess.run([sys.executable, "-c", probe], env=dict(repo_env, DS_ASYNC_CKPT_AUTOLOAD="0"),
                         capture_output=True, text=True)
    assert off.returncode == 0, off.stderr
    # switched off: DeepSpeed untouched until install() is called explicitly
    assert off.stdout.split()[-2:] == ["False", "True"]
    # The hook runs at every interpreter start in the environment: it must stay cheap. With
    # wrapt it imported asyncio, inspect and importlib.metadata (43 of 50 ms of `python -c pass`).
    startup = "import sys; print(len(sys.modules), sorted({'asyncio', 'inspect', 'importlib.metadata', 'wrapt'} & set(sys.modules)))"
    counts = {}
    for switch in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", startup], env=dict(repo_env, DS_ASYNC_CKPT_AUTOLOAD=switch),
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        n, heavy = out.stdout.split(maxsplit=1)
        assert heavy.strip() == "[]", (switch, heavy)
        counts[switch] = int(n)
    assert counts["1"] - counts["0"] <= 3, counts  # the hook module itself
    # An activation that fails (a DeepSpeed whose engine module changed, say) must not break
    # `import deepspeed` for everyone in the environment: it did, raising out of the import.
    broken = tmp_path / "broken" / "deepspeed_async_ckpt"
    (broken / "integrations").mkdir(parents=True)
    (broken / "__init__.py").write_text("")
    (broken / "integrations" / "__init__.py").write_text("")
    (broken / "integrations" / "activation.py").write_text(
        "def install():\n    raise AttributeError('no create_checkpoint_engine here')\n")
    out = subprocess.run([sys.executable, "-c", "import deepspeed.runtime.engine; print('imported')"],
                         env=dict(repo_env, PYTHONPATH=f"{broken.parent}{os.pathsep}{REPO}"),
                         capture_output=True, text=True,
                         cwd=tmp_path)  # (not the working tree, which `-c` puts first on sys.path)
    assert out.returncode == 0 and out.stdout.split()[-1] == "imported", out.stderr[-2000:]
    assert "auto-activation failed, DeepSpeed runs without this engine" in out.stderr
    assert "AttributeError: no create_checkpoint_engine here" in out.stderr


def test_each_commit_is_in_deepspeeds_log_and_monitor_from_rank_0(tmp_path, repo_env):
    """With DeepSpeed's ``log_level`` at info, rank 0 logs every commit through DeepSpeed's own
    logger (the line users look for to know a checkpoint is safe; DeepSpeed's engine logs that
    a checkpoint "is about to be saved"), with the manifest's figures; the other rank does not.
    With DeepSpeed's CSV monitor on, rank 0 writes each commit's figures through it, at the
    global step of the save: the largest over the ranks from the manifest's timings, its
    bytes, and the seconds to committed of the log line."""
    import csv

    from deepspeed_async_ckpt.commit import read_manifest

    config = json.load(open(os.path.join(REPO, "configs", "deepspeed_async.json")))
    config["log_level"] = "info"
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"}
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(config))
    save = tmp_path / "ckpt"
    codes = launch(os.path.join(REPO, "scripts", "ds_train.py"),
                   ["--config", str(cfg), "--save-dir", str(save), "--steps", "4", "--save-every", "2",
                    "--hidden", "32", "--layers", "2"], 2, timeout=300, env=repo_env,
                   log_prefix=str(tmp_path / "train"))
    logs = [(tmp_path / f"train.rank{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], logs
    for tag in ("global_step2", "global_step4"):
        manifest = read_manifest(str(save / tag))
        nbytes = sum(f["bytes"] for f in manifest["files"].values())
        line = f"[AsyncCheckpointEngine] checkpoint {tag} committed: {save / tag}, " \
               f"{len(manifest['files'])} file(s), {nbytes / 1e9:.3g} GB from 2 rank(s), "
        assert logs[0].count(line) == 1, logs[0]
    assert "committed:" not in logs[1]
    rows = {}
    for path in glob.glob(str(tmp_path / "csv" / "run" / "async-ckpt_*.csv")):
        with open(path, newline="") as f:
            (header, *values) = list(csv.reader(f))
        rows[header[1]] = {int(step): float(value) for step, value in values}
    assert sorted(rows) == ["bytes", "committed-s", "fence-wait-ms", "persisted-s", "save-call-ms"]
    for step in (2, 4):
        manifest = read_manifest(str(save / f"global_step{step}"))
        slowest = {key: t["max"] for key, t in manifest["timings"].items()}
        assert rows["save-call-ms"][step] == round(slowest["save_call_s"] * 1e3, 3) > 0
        assert rows["fence-wait-ms"][step] == round(slowest["fence_wait_s"] * 1e3, 3)
        assert rows["persisted-s"][step] == slowest["persisted_s"] > 0
        assert rows["bytes"][step] == sum(f["bytes"] for f in manifest["files"].values())
        assert f"{rows['committed-s'][step]:.2f} s after the save began" in logs[0]
    assert sorted(rows["bytes"]) == [2, 4]
