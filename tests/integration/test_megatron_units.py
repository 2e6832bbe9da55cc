"""Fast, single-process tests of the Megatron-core adapter's pieces (no process groups)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from deepspeed_async_ckpt.errors import CommitError, ConfigError, IntegrityError  # noqa: E402
from deepspeed_async_ckpt.storage import LocalStorage  # noqa: E402
from megatron_adapter import torch_dist  # noqa: E402
from megatron_adapter.arguments import add_arguments, config_from_args  # noqa: E402
from megatron_adapter.checkpointer import (  # noqa: E402
    MegatronCheckpointer,
    checkpoint_dir,
    read_tracker,
    tracker_path,
    verify_checkpoint_dir,
)
from megatron_adapter.election import assign_balanced, check_mode, shard_id  # noqa: E402
from megatron_adapter.layout import ParallelLayout  # noqa: E402
from megatron_adapter.megatron_lm import extra_args_provider  # noqa: E402

from conftest import REPO  # noqa: E402
from helpers import run_rank_script  # noqa: E402


def parse(*argv: str) -> argparse.Namespace:
    return add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


# ---------------------------------------------------------------------------------- flags
def test_without_the_flag_the_same_pipeline_runs_inline():
    cfg = config_from_args(parse())
    assert cfg.enabled and cfg.mode == "sync"


def test_async_flag_and_example_config():
    args = parse("--async-ckpt", "--async-ckpt-config", os.path.join(REPO, "configs", "megatron_async.json"))
    cfg = config_from_args(args)
    assert cfg.enabled and cfg.is_async and cfg.checksum == "xxh128" and cfg.writer_threads == 2
    assert args.async_ckpt_writers == "replica"
    assert config_from_args(parse("--async-ckpt")).is_async


def test_config_file_uses_the_deepspeed_schema(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"async_checkpoint": {"mode": "sync", "host_buffer_gb": 2}}))
    cfg = config_from_args(parse("--async-ckpt", "--async-ckpt-config", str(path)))
    assert cfg.enabled and cfg.mode == "sync" and cfg.host_buffer_gb == 2  # the file's mode wins
    path.write_text(json.dumps({"mode": "async"}))  # without the flag too: the file's mode wins
    assert config_from_args(parse("--async-ckpt-config", str(path))).is_async
    path.write_text(json.dumps({"host_buffer_gb": 2}))  # no mode in the file: the flag decides
    assert config_from_args(parse("--async-ckpt", "--async-ckpt-config", str(path))).is_async
    assert not config_from_args(parse("--async-ckpt-config", str(path))).is_async
    path.write_text(json.dumps({"enabled": False}))
    assert not config_from_args(parse("--async-ckpt-config", str(path))).enabled
    # a bad file is refused when the flags are parsed (not at the first save, after that much
    # training), naming the flag, the file and the key
    path.write_text(json.dumps({"writers": "balanced"}))
    for bad, fragment in [(str(path), "async_checkpoint.writers"), (str(tmp_path / "missing.json"), "cannot read")]:
        with pytest.raises(SystemExit):
            parse("--async-ckpt-config", bad)
        err = capsys.readouterr().err
        assert "argument --async-ckpt-config" in err and bad in err and fragment in err, err
    # read once: not again at each save (a file edited or removed mid-run changed nothing)
    path.write_text(json.dumps({"enabled": False}))
    args = parse("--async-ckpt-config", str(path))
    path.unlink()
    assert not config_from_args(args).enabled
    with pytest.raises(ConfigError, match="cannot read .*missing.json"):  # a path set by other code
        config_from_args(argparse.Namespace(async_ckpt_config=str(tmp_path / "missing.json")))


def test_a_tier_that_is_contains_or_lies_inside_save_or_load_is_refused_before_the_engine(tmp_path):
    """--save and --load are known when the flags are read: a tier inside either, the directory
    itself, or one that holds it is refused there, naming the key and the flag, before the
    engine is built (which would make the tier's directory); the config file's secrets and
    the checkpoint stay apart. Megatron-LM saves ``args`` with every checkpoint: it holds the
    config file's path, never its content."""
    save = tmp_path / "ckpt"
    path = tmp_path / "c.json"
    for url, how, flag in [(save / "tier", "lies inside", "--save"), (save, "is", "--save"),
                           (tmp_path, "contains", "--save"), (tmp_path / "pretrained", "is", "--load")]:
        path.write_text(json.dumps({"tiers": [{"url": str(url)}]}))
        args = parse("--async-ckpt-config", str(path))
        args.save, args.load = str(save), str(tmp_path / "pretrained")
        with pytest.raises(ConfigError) as err:
            config_from_args(args)
        assert f"async_checkpoint.tiers[0].url '{url}' {how} the checkpoint directory ({flag})" in str(err.value)
        assert args.async_ckpt_config == str(path)
    assert os.listdir(tmp_path) == ["c.json"]
    path.write_text(json.dumps({"tiers": [{"url": str(tmp_path / "tier")}]}))
    args = parse("--async-ckpt-config", str(path))
    args.save = args.load = str(save)
    assert config_from_args(args).tiers[0].url == str(tmp_path / "tier")


def test_a_megatron_checkpointers_engine_is_a_deprecated_name_of_its_checkpointer():
    """``MegatronCheckpointer.checkpointer`` is the ``AsyncCheckpointer`` it drives, as on
    DeepSpeed's engine; ``.engine`` still returns it, with a DeprecationWarning."""
    import types

    ck = object()
    holder = types.SimpleNamespace(checkpointer=ck)
    with pytest.warns(DeprecationWarning, match=r"MegatronCheckpointer\.engine is deprecated: use \.checkpointer"):
        assert MegatronCheckpointer.engine.fget(holder) is ck


def test_writer_modes():
    assert parse("--async-ckpt-writers", "balanced").async_ckpt_writers == "balanced"
    with pytest.raises(SystemExit):
        parse("--async-ckpt-writers", "everyone")
    with pytest.raises(ValueError, match="replica"):
        check_mode("everyone")


def test_megatron_lm_extra_args_provider_chains():
    def inner(parser):
        parser.add_argument("--their-flag", type=int, default=0)
        return parser

    parser = extra_args_provider(inner)(argparse.ArgumentParser())
    args = parser.parse_args(["--their-flag", "3", "--async-ckpt"])
    assert args.their_flag == 3 and args.async_ckpt and args.async_ckpt_writers == "replica"


def test_megatron_lm_routes_only_saves_the_engine_can_honour(monkeypatch):
    import types

    from megatron_adapter.megatron_lm import has_modelopt_state, routed

    plain = {"iteration": 3, "model": [object()], "optimizer": None}
    assert routed(plain, "torch_dist")
    assert routed(dict(plain, rng_state_key_prefix="", tp_group=None), "torch_dist")  # defaults
    assert not routed(plain, "torch")
    for unroutable in ({"non_persistent_ckpt": True}, {"release": True}, {"pipeline_rank": 0},
                       {"tp_group": object()}, {"dp_cp_group": object()}, {"rng_state_key_prefix": "ema."}):
        assert not routed(dict(plain, **unroutable), "torch_dist"), unroutable
    assert not has_modelopt_state(plain["model"])  # ModelOpt is not installed here
    converted = object()
    opt = types.ModuleType("modelopt.torch.opt")
    opt.ModeloptStateManager = types.SimpleNamespace(is_converted=lambda m: m is converted)
    for name, module in (("modelopt", types.ModuleType("modelopt")),
                         ("modelopt.torch", types.ModuleType("modelopt.torch")), ("modelopt.torch.opt", opt)):
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["modelopt"].torch = sys.modules["modelopt.torch"]
    sys.modules["modelopt.torch"].opt = opt
    assert routed(plain, "torch_dist")
    assert not routed(dict(plain, model=[converted]), "torch_dist")  # Megatron-LM saves its state


def _run_one_rank(worker: str) -> dict:
    """Run ``tests/workers/<worker>`` as one gloo rank in a process of its own; its last line
    of output is JSON."""
    from deepspeed_async_ckpt.tools.launch import free_port

    out = run_rank_script(os.path.join(REPO, "tests", "integration", "workers", worker), [free_port()],
                          dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_two_ranks(worker: str, tmp_path, timeout: float = 120) -> list[dict]:
    """Run ``tests/workers/<worker> <tmp_path>`` as two gloo ranks (``scripts/launch.py``);
    each must exit 0 and leave ``rank<N>.json``, returned in rank order."""
    from deepspeed_async_ckpt.tools.launch import launch

    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    codes = launch(os.path.join(REPO, "tests", "integration", "workers", worker), [str(tmp_path)], 2, timeout=timeout, env=env)
    assert codes == [0, 0], codes
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_save_copies_the_buffers_of_ddp_wrapped_chunks_at_save_time():
    """``save(..., model=[chunk])`` with the chunk in megatron-core's DistributedDataParallel,
    as Megatron-LM's ``model`` is: DDP's ``buffers`` attribute is a list (its gradient
    buffers), which made ``chunk.buffers()`` raise. The buffer, changed before the fence with
    the copier held until then, is saved as it was at ``save``."""
    result = _run_one_rank("megatron_ddp_buffers.py")
    assert result == {"bias": [0.0] * 4, "ddp_buffers_is_a": "list"}


def test_a_truncated_metadata_is_named_by_every_check():
    """A load of some of a checkpoint (``MegatronCheckpointer.load``; the Megatron-LM hook
    under ``--no-load-optim``) reads megatron-core's ``.metadata`` to find what it reads,
    before rank 0 has checked that file: a truncated one is named by every check (the full
    one, the load's, the skipping one), as truncated or corrupted, not as a bare
    ``UnpicklingError`` naming no file."""
    result = _run_one_rank("megatron_truncated_metadata.py")
    metadata = os.path.join(result["dir"], ".metadata")
    assert result["full"].startswith(f"IntegrityError: {metadata}: size"), result
    for check in ("load", "skip"):
        assert result[check].startswith(f"IntegrityError: {metadata} cannot be read"), result
        assert "truncated or corrupted" in result[check], result


def test_wait_gives_up_at_its_timeout():
    """``wait(timeout=0.5)`` with a save held until that wait returns: the wait gives up at its
    bound with a CommitError, rather than returning once the save is done (an error here means
    wait gave up before the save finished)."""
    result = _run_one_rank("megatron_wait_timeout.py")
    assert result["error"] and result["error"].startswith("CommitError:"), result
    assert "not committed within 0.5 s" in result["error"], result


def test_a_sharding_megatron_refuses_fails_the_save_on_every_rank_at_once(tmp_path):
    """megatron-core validates a save's sharding on rank 0 alone, after its collectives, and
    raises there alone; rank 1 would go on into ``plan_save``'s collective and wait for rank 0
    for as long as rank 0 lived. Both ranks raise at once, and the next, valid, save
    commits."""
    got = _run_two_ranks("megatron_invalid_sharding.py", tmp_path)
    for case in ("two_main_replicas", "no_main_replica"):
        assert "Invalid access pattern" in got[0][case]["error"], got
        assert got[1][case]["error"].startswith("CommitError: checkpoint failed on rank(s) 0"), got
        assert got[0][case]["peer_raised_first"], got  # rank 0 waits for it, in no collective
    assert got[0]["tracker"] == got[1]["tracker"] == 3


def test_a_megatron_save_failing_on_one_rank_before_a_collective_fails_on_every_rank(tmp_path):
    """A save that fails on rank 1 alone before a collective (a sharded-tensor factory, with
    megatron-core's validation or without; an object that cannot be pickled, in the planning)
    would leave rank 0 waiting in that collective for good; so would a common part rank 0
    cannot pickle for the validation's broadcast (a lock). Both ranks raise, and the next save
    commits. An iteration that is no integer is refused (``True`` would be committed as
    ``iter_0000001`` with ``True`` in the tracker). A balanced writer election that rank 1
    cannot take part in fails on both ranks: rank 1 with its own error, rank 0 with the
    agreement naming it (rank 0 waited in the election's gather). ``close()`` is collective, as
    megatron-core's ``AsyncCallsQueue.close`` is: no rank returns from it before the tracker
    names the last checkpoint."""
    got = _run_two_ranks("megatron_rank_local_failures.py", tmp_path, timeout=180)
    for case, own in (("factory_validated", "factory failed on rank 1"), ("factory", "factory failed on rank 1"),
                      ("object", "rank 1: ")):
        assert own in got[1][case], (case, got)
        assert got[0][case] and ("rank(s) 1" in got[0][case] or own in got[0][case]), (case, got)
    for r, own in ((0, "cannot pickle '_thread.lock' object"), (1, "rank(s) 0")):  # rank 0's common part
        assert own in got[r]["common"], got
    for case in ("iteration_true", "iteration_tensor"):
        for r in range(2):
            assert got[r][case].startswith("ValueError: save(iteration="), (case, got)
    # the election's gather: rank 1's failure, typed, on both ranks (rank 0 waited in it for good)
    assert got[1]["election"] == "RuntimeError: cannot list its shards on rank 1", got
    assert got[0]["election"] == ("AgreementError: electing writers failed on rank(s) 1: RuntimeError: "
                                  "cannot list its shards on rank 1"), got
    for r in range(2):
        assert got[r]["tracker"] == 4 and got[r]["metadata"], got


def test_ranks_checking_different_megatron_checkpoints_are_refused(tmp_path):
    """Each rank hashes a share of the files, which together cover them only if every rank
    checks the same checkpoint; ranks that read the tracker on either side of a commit would
    each check part of a different one, and pass. Both raise, naming both checkpoints."""
    for got in _run_two_ranks("megatron_verify_elsewhere.py", tmp_path):
        error = got["error"]
        assert error and error.startswith("IntegrityError: the ranks are not checking the same checkpoint"), error
        assert "iter_0000002" in error and "iter_0000001" in error, error


def test_megatron_lm_hook_passes_other_formats_to_megatron_lm_and_refuses_partial_ones():
    """With --async-ckpt, the hooked load verified every checkpoint the tracker named and
    refused one without this engine's manifest or megatron-core's metadata.json: Megatron-LM's
    legacy and torch_dcp checkpoints, which Megatron-LM itself detects and loads. Run with
    stand-ins for megatron.training (not installable here), in a process of its own."""
    result = _run_one_rank("megatron_lm_stub_load.py")
    assert result["legacy"] == ["load"]
    assert result["partial"].startswith("IntegrityError") and "never committed" in result["partial"]


def test_megatron_lm_hook_ranks_reading_different_trackers_all_raise(tmp_path):
    """The hook's check is collective, but each rank reads the tracker itself: one that read it
    just before a commit must not go on into Megatron-LM's load while the other waits in the
    check. The ranks agree on what they read first, and all raise."""
    got = _run_two_ranks("megatron_lm_stub_load_race.py", tmp_path)
    for r in range(2):
        assert got[r]["error"].startswith("IntegrityError: load_checkpoint refused on every rank: "
                                          "the ranks read different checkpoints"), got
        assert got[r]["loaded"] == [], got  # neither went on into Megatron-LM's load


def test_megatron_lm_refuses_async_save_together_with_the_engine():
    from megatron_adapter.megatron_lm import _engine

    args = parse("--async-ckpt")
    args.async_save = True
    with pytest.raises(ConfigError, match="--async-save"):
        _engine(args)


def test_megatron_lm_hook_verifies_the_pretrained_checkpoint_megatron_lm_loads():
    """Megatron-LM's load_checkpoint finetunes from --pretrained-checkpoint when --load is
    unset or holds no tracker. The hook verifies that checkpoint too (one that never committed
    is refused), with --load unset, empty, or with --ckpt-step and no --load. Run with
    stand-ins for megatron.training."""
    result = _run_one_rank("megatron_lm_stub_pretrained.py")
    for case in ("no_load", "empty_load", "ckpt_step"):
        assert result[case].startswith("IntegrityError") and "never committed" in result[case], (case, result)


def test_megatron_lm_async_save_goes_with_the_engine_turned_off(tmp_path):
    """``"enabled": false`` in the engine's config leaves every save to Megatron-LM, so its
    own --async-save is then the only background save, and is accepted."""
    from megatron_adapter.megatron_lm import _engine

    config = tmp_path / "off.json"
    config.write_text('{"enabled": false}')
    args = parse("--async-ckpt-config", str(config))
    args.async_save = True
    assert _engine(args) is None


# ---------------------------------------------------------------------------------- election
def _tensor(key, offset, shape, replica_id):
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor(key=key, data=None, dtype=torch.float32, local_shape=shape,
                         global_shape=tuple(o + s for o, s in zip(offset, shape)),
                         global_offset=offset, axis_fragmentations=None, replica_id=replica_id)


def _dp_group(dp: int, tp_rank: int = 0):
    """What the ranks of one data-parallel group hold: two weights (one big), and a layer norm
    replicated across TP whose main replica lives on TP rank 0."""
    return [[_tensor("w_big", (0, 0), (64, 64), (0, 0, r)),
             _tensor("w_small", (0, 0), (8, 8), (0, 0, r)),
             _tensor("norm", (0,), (16,), (0, tp_rank, r))] for r in range(dp)]


def test_balanced_assigns_every_main_shard_once_to_a_holder():
    assignment = assign_balanced(_dp_group(2))
    assert set(assignment) == {shard_id(t) for t in _dp_group(1)[0]}
    assert len(set(assignment.values())) == 2  # the big weight on one rank, the rest on the other
    assert assignment[shard_id(_tensor("w_big", (0, 0), (64, 64), 0))] == 0


def test_balanced_leaves_other_groups_replicas_alone():
    # The DP group of TP rank 1 holds the layer norm only as a non-main replica: not its to write.
    assignment = assign_balanced(_dp_group(2, tp_rank=1))
    assert shard_id(_tensor("norm", (0,), (16,), 0)) not in assignment
    assert len(assignment) == 2


def test_balanced_is_deterministic():
    assert assign_balanced(_dp_group(4)) == assign_balanced(_dp_group(4))


# ---------------------------------------------------------------------------------- layout
def test_layout_description():
    layout = ParallelLayout(world_size=8, rank=3, tp=2, tp_rank=1, pp=2, pp_rank=0, dp=2,
                            dp_rank=1, cp=1, ep=1)
    assert layout.describe() == "TP=2,PP=2,DP=2" and layout.dp_cp == 2
    assert layout.to_dict()["tp_rank"] == 1


# ---------------------------------------------------------------------------------- files
def test_tracker_and_directory_names(tmp_path):
    assert checkpoint_dir("ckpt", 50) == os.path.join("ckpt", "iter_0000050")
    assert read_tracker(str(tmp_path)) is None
    with open(tracker_path(str(tmp_path)), "w", encoding="utf-8") as f:
        f.write("50\n")
    assert read_tracker(str(tmp_path)) == 50
    with open(tracker_path(str(tmp_path)), "w", encoding="utf-8") as f:
        f.write("release")
    with pytest.raises(IntegrityError, match="release"):
        read_tracker(str(tmp_path))


def test_markers_are_written_atomically(tmp_path):
    from deepspeed_async_ckpt.commit import FinalizeContext

    ctx = FinalizeContext(LocalStorage(fsync=True), str(tmp_path), str(tmp_path), "7", "id", {"files": {}},
                          frozenset(torch_dist.Markers(index=None).files))
    ctx.write_file(torch_dist.DCP_METADATA_FILE, b"\x00\xffbytes")
    path = str(tmp_path / torch_dist.DCP_METADATA_FILE)
    assert open(path, "rb").read() == b"\x00\xffbytes"
    assert os.listdir(tmp_path) == [torch_dist.DCP_METADATA_FILE]  # no temporary left behind
    assert torch_dist.distcp_name(3, 12) == "__3_12.distcp"


def _engine(storage=None, **config):
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from deepspeed_async_ckpt.core import AsyncCheckpointer

    return AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, **config),
                             storage=storage or LocalStorage())


def _save_iteration(engine, root, iteration, steps):
    """One save as the adapter begins it: the tracker as the pointer, the markers as the
    finalize step (an index of nothing: ``write_markers`` is replaced in these tests)."""
    from deepspeed_async_ckpt.commit import Pointer

    d = os.path.abspath(checkpoint_dir(root, iteration))
    handle = engine.begin(d, tag=str(iteration), pointer=Pointer(tracker_path(root), str(iteration)),
                          finalize=[torch_dist.Markers(index=None)])
    engine.save({"steps": steps}, os.path.join(d, "common.pt"))
    engine.end()
    return handle


def _write_markers(ctx, index):
    for name in torch_dist.MARKER_FILES:
        ctx.write_file(name, "{}")


def test_a_resave_whose_markers_fail_leaves_the_tracker_and_the_old_iteration(tmp_path, monkeypatch):
    """A re-saved iteration is staged and swapped in by the commit after its marker files. If
    those fail, the tracker and the old directory stay put, and the next save sweeps the
    staging directory (the engine does not keep it until the process ends)."""
    root = str(tmp_path)
    engine = _engine()
    monkeypatch.setattr(torch_dist, "write_markers", _write_markers)
    _save_iteration(engine, root, 7, 1)
    engine.wait()

    def fail(ctx, index):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch_dist, "write_markers", fail)
    handle = _save_iteration(engine, root, 7, 2)
    with pytest.raises(CommitError, match="finalize step Markers failed .*No space left"):
        engine.wait()
    assert read_tracker(root) == 7 and os.path.isdir(handle.write_dir)
    monkeypatch.setattr(torch_dist, "write_markers", _write_markers)
    _save_iteration(engine, root, 8, 3)  # its begin() sweeps the staging directory
    engine.close()
    assert sorted(n for n in os.listdir(root) if not n.startswith(".async_ckpt")) == \
        ["iter_0000007", "iter_0000008", "latest_checkpointed_iteration.txt"]
    assert torch.load(os.path.join(checkpoint_dir(root, 7), "common.pt"), weights_only=False)["steps"] == 1
    verify_checkpoint_dir(checkpoint_dir(root, 7))


def test_failed_finalizations_are_raised_together_not_one_per_call(tmp_path, monkeypatch):
    """Two saves whose marker files failed are raised together by the next wait (the first,
    with how many more there were), and all are consumed: the older failure does not come
    back at a later call, after its cause was fixed."""
    root = str(tmp_path)
    engine = _engine()

    def fail(ctx, index):
        raise OSError(28, f"No space left for {ctx.tag}")

    monkeypatch.setattr(torch_dist, "write_markers", fail)
    for iteration in (1, 2):
        _save_iteration(engine, root, iteration, iteration)
        engine.fence()
    with pytest.raises(CommitError) as raised:
        engine.wait()
    err = raised.value
    assert "iter_0000001" in str(err) and "No space left for 1" in str(err), err
    assert "and 1 more" in str(err), err
    engine.wait()
    assert read_tracker(root) is None
    engine.close()


def test_verify_accepts_megatron_checkpoints_and_rejects_partial_ones(tmp_path):
    with pytest.raises(IntegrityError, match="not a complete checkpoint"):
        verify_checkpoint_dir(str(tmp_path))
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    verify_checkpoint_dir(str(tmp_path))  # megatron-core's own: nothing of ours to check
    (tmp_path / ".async_ckpt").mkdir()
    with pytest.raises(IntegrityError, match="never committed"):
        verify_checkpoint_dir(str(tmp_path))
    with pytest.raises(ValueError, match="cannot skip 'model'"):
        verify_checkpoint_dir(str(tmp_path), skip=("optimizer", "model"))


def test_a_metadata_file_that_cannot_be_read_is_not_called_corrupted(tmp_path, monkeypatch):
    """Reading .metadata failing with an OSError (permissions, an I/O error) was reported as
    'file truncated or corrupted', sending the user after damage that is not there."""
    import errno

    from megatron_adapter import verify as mcp

    (tmp_path / ".async_ckpt").mkdir()
    for name in torch_dist.MARKER_FILES:
        (tmp_path / name).write_text("{}")
    monkeypatch.setattr(mcp, "read_manifest", lambda d: {"files": {}})

    def denied(ckpt_dir, wanted):
        raise PermissionError(errno.EACCES, "Permission denied", os.path.join(ckpt_dir, ".metadata"))

    monkeypatch.setattr(mcp, "_reads_of_load", denied)
    with pytest.raises(IntegrityError) as info:
        verify_checkpoint_dir(str(tmp_path), request={"model": {}})
    assert "Permission denied" in str(info.value) and "corrupted" not in str(info.value), info.value
    monkeypatch.setattr(mcp, "_reads_of_load", lambda d, w: (_ for _ in ()).throw(EOFError("Ran out of input")))
    with pytest.raises(IntegrityError, match="truncated or corrupted"):
        verify_checkpoint_dir(str(tmp_path), request={"model": {}})


def test_megatron_lm_loads_skip_what_its_flags_leave_out():
    """Megatron-LM builds its load request itself; the hook tells verification what its
    flags leave out, and which top-level names those are (chained optimizers' included)."""
    from megatron_adapter.checkpointer import SKIPPABLE
    from megatron_adapter.megatron_lm import skipped_by_load

    def args(**flags):
        return argparse.Namespace(**{"finetune": False, "no_load_optim": False, "no_load_rng": False, **flags})

    assert skipped_by_load(args()) == ()
    assert skipped_by_load(args(no_load_optim=True)) == ("optimizer",)
    assert skipped_by_load(args(no_load_rng=True)) == ("rng_state",)
    assert skipped_by_load(args(finetune=True)) == ("optimizer", "rng_state")
    assert skipped_by_load(argparse.Namespace()) == ()  # a Megatron-LM without these flags
    names = ["optimizer", "chained_0", "chained_12", "decoder", "embedding", "rng_state", "chained"]
    assert [n for n in names if SKIPPABLE["optimizer"](n)] == ["optimizer", "chained_0", "chained_12"]
    assert [n for n in names if SKIPPABLE["rng_state"](n)] == ["rng_state"]
    assert [torch_dist.top_name(k) for k in ("optimizer.state.exp_avg.decoder.x", "chained_1.optimizer.a",
                                             "decoder/layers.0", "rng_state")] == \
        ["optimizer", "chained_1", "decoder", "rng_state"]


# ---------------------------------------------------------------------------------- CPU shim
def test_cpu_shim_redirects_cuda_calls_only_without_cuda():
    code = ("import sys; sys.path.insert(0, 'tests'); import torch, megatron_cpu_shim;"
            "applied = megatron_cpu_shim.apply();"
            "assert applied == (not torch.cuda.is_available());"
            "assert megatron_cpu_shim.apply() is False;"
            "assert torch.cuda.current_device() == 'cpu' and torch.cuda.device_count() == 0;"
            "torch.cuda.synchronize(); torch.cuda.manual_seed(1);"
            "assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state());"
            "t = torch.zeros(2, device='cuda'); assert t.device.type == 'cpu';"
            "assert t.cuda() is t and t.type() == 'torch.cuda.FloatTensor';"
            "assert t.type(torch.int32).dtype == torch.int32;"
            "assert not torch.cuda.is_available()")
    if __import__("torch").cuda.is_available():
        pytest.skip("the shim changes nothing where CUDA is present")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


@pytest.mark.parametrize("package", ["megatron_adapter", "deepspeed_async_ckpt"])
def test_every_public_name_resolves(package):
    """``from megatron_adapter import *`` raised AttributeError: ``__all__`` still named a
    function removed from ``arguments``."""
    import importlib

    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    namespace: dict = {}
    exec(f"from {package} import *", namespace)
    assert set(module.__all__) <= set(namespace)


def test_megatron_lm_hook_prints_megatron_lms_saved_line_for_log_monitors(monkeypatch, capsys):
    """Routed saves print Megatron-LM's own "successfully saved checkpoint" line once the
    tracker names the checkpoint: job monitors and the scripts that convert each new
    checkpoint wait for that line."""
    import re

    from megatron.core import mpu

    from deepspeed_async_ckpt.core import CommitInfo
    from megatron_adapter import megatron_lm

    for name, value in (("get_tensor_model_parallel_rank", 0), ("get_pipeline_model_parallel_rank", 0),
                        ("get_tensor_model_parallel_world_size", 2),
                        ("get_pipeline_model_parallel_world_size", 4)):
        monkeypatch.setattr(mpu, name, lambda value=value: value)
    info = CommitInfo(tag="50", ckpt_dir="/ckpt/iter_0000050", files=9, bytes=3 * 10**9,
                      world_size=8, seconds=1.5)
    megatron_lm._print_saved(50, info)
    out = capsys.readouterr().out
    # the pattern log monitors use for Megatron-LM's line
    match = re.search(r"successfully saved checkpoint from iteration\s+(?P<it>\d+) to (?P<path>\S+)", out)
    assert match and match["it"] == "50" and match["path"] == "/ckpt", out
    assert "iteration      50 to /ckpt [ t 1/2, p 1/4 ]" in out
    assert "checkpoint 50 committed: /ckpt/iter_0000050, 9 file(s), 3 GB from 8 rank(s), 1.50 s" in out


def test_megatron_lm_hook_writes_each_commits_figures_through_megatron_lms_writers(monkeypatch, tmp_path):
    """Rank 0 holding Megatron-LM's TensorBoard and W&B writers (a one-rank run): each commit's
    figures go to both, at its iteration, named beside Megatron-LM's ``save-checkpoint-time``;
    without a writer and without ``--tensorboard-dir`` nothing is attached."""
    import types

    from deepspeed_async_ckpt.commit import Pointer
    from deepspeed_async_ckpt.core import AsyncCheckpointer
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from megatron_adapter import megatron_lm

    class Board:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, name, value, step):
            self.scalars.append((name, value, step))

    class WandB:
        def __init__(self):
            self.logged = []

        def log(self, values, step=None):
            self.logged.append((step, values))

    board, wandb = Board(), WandB()
    mt = types.ModuleType("megatron.training")
    mt.get_tensorboard_writer, mt.get_wandb_writer = lambda: board, lambda: wandb
    monkeypatch.setitem(sys.modules, "megatron.training", mt)
    for writers in (True, False):
        before = len(board.scalars)
        if not writers:
            mt.get_tensorboard_writer = mt.get_wandb_writer = lambda: None
        ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
        engine = types.SimpleNamespace(rank=0, checkpointer=ck)
        megatron_lm._attach_figures(engine, argparse.Namespace(tensorboard_dir=None, wandb_project=None))
        d = str(tmp_path / f"{writers}" / "iter_0000050")
        ck.begin(d, tag="50", pointer=Pointer(str(tmp_path / f"{writers}" / "tracker"), "50"))
        ck.save({"w": torch.ones(64)}, os.path.join(d, "common.pt"))
        ck.end()
        ck.close()
        assert (len(board.scalars) > before) is writers
        if writers:
            info = ck.history[-1].commit_info
    names = ["async-ckpt/save-call-ms", "async-ckpt/fence-wait-ms", "async-ckpt/bytes",
             "async-ckpt/persisted-s", "async-ckpt/committed-s"]
    assert [(name, step) for name, _, step in board.scalars] == [(name, 50) for name in names]
    assert [(step, sorted(values)) for step, values in wandb.logged] == [(50, sorted(names))]
    assert ("async-ckpt/bytes", info.bytes, 50) in board.scalars


def test_on_saved_runs_in_order_on_its_own_thread_through_close():
    """Megatron's ``on_saved`` callbacks run one after the other, in iteration order, on the
    engine's callback thread, including that of a save committed while ``close()`` runs (not
    at the same time as a slow earlier one), and the checkpoint a callback reads is still
    there (retention, keep_last=1, waits for it)."""
    got = _run_one_rank("megatron_on_saved.py")
    assert got["tracker"] == 2
    assert [e[:2] for e in got["events"]] == [["start", 1], ["end", 1], ["start", 2], ["end", 2]]
    assert {e[2] for e in got["events"]} == {"async-ckpt-reporter_0"}
    assert all(e[3] for e in got["events"] if e[0] == "end")  # each read its checkpoint


# ---------------------------------------------------------------------------------- mock_gpt.py
def _pretrain_gpt():
    """The loop of ``scripts/pretrain_gpt.py``."""
    from megatron_adapter import mock_gpt

    return mock_gpt


@pytest.mark.parametrize("flag,value", [("--log-interval", "0"), ("--save-interval", "0"),
                                        ("--save-interval", "-5"), ("--save-retain-interval", "0"),
                                        ("--micro-batch-size", "0"), ("--train-iters", "-1"),
                                        ("--train-iters", "0")])
def test_pretrain_gpt_refuses_a_count_out_of_range_naming_the_flag(flag, value, capsys):
    """A count out of range is refused at parse, naming the flag: ``--log-interval 0`` would
    crash the first step with ZeroDivisionError, ``--save-interval -5`` save at every fifth
    step."""
    parse_args = _pretrain_gpt().parse_args
    assert parse_args(["--train-iters", "4", flag, "3"]) is not None  # a good value parses
    with pytest.raises(SystemExit):
        parse_args(["--train-iters", "4", flag, value])
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and value in err, err


@pytest.mark.parametrize("args,named", [(["--train-iters", "4", "--lr-warmup-iters", "4"], "--lr-warmup-iters"),
                                        (["--train-iters", "4", "--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr")])
def test_pretrain_gpt_refuses_a_schedule_megatron_core_would_assert_on(args, named, capsys):
    """megatron-core's scheduler asserts warmup < decay steps and min_lr <= lr after the process
    group and the model were built, with a bare ``AssertionError`` naming no flag; the script
    refuses such a schedule at parse, naming the flag (``--train-iters 0``, above, too)."""
    parse_args = _pretrain_gpt().parse_args
    assert parse_args(["--train-iters", "5", "--lr-warmup-iters", "4", "--min-lr", "1e-3"]) is not None
    with pytest.raises(SystemExit):
        parse_args(args)
    assert named in capsys.readouterr().err


# --------------------------------------------------------------------------------- compat.py
@pytest.mark.parametrize("extra", [{}, {"padding": True, "gbuf_local_start": 0, "gbuf_local_end": 8},
                                   {"padding": False, "step": torch.tensor(9.0)}],
                         ids=["fully_reshardable", "dp_reshardable", "dp_reshardable_request_with_a_step"])
def test_compat_copies_the_states_the_optimizer_has_whatever_else_the_checkpoint_holds(extra):
    """The patched ``_set_main_param_and_optimizer_states`` copies the keys the live state has:
    a ``dp_reshardable`` entry (Megatron-LM's default distributed-optimizer format) also holds
    ``padding`` and its buffer offsets, which copying every key of the entry would fail on
    (``KeyError: 'padding'``). A live ``step`` the checkpoint lacks (``fully_reshardable``, the
    reason for the patch) is left alone, and one a ``dp_reshardable`` load request carries (the
    live one, which would replace the loaded step after a resume) is not copied; an fp32 main
    param, a view of a leaf that requires grad, is copied into under ``no_grad`` (else "a view
    of a leaf Variable ... in-place")."""
    import torch
    from megatron.core.optimizer import DistributedOptimizer
    from megatron_adapter import compat

    assert compat.install() or compat._INSTALLED  # torch's Adam here: no Apex, no TE
    leaf = torch.zeros(16, requires_grad=True)  # fp32: the main param is a view of a leaf
    main, model_param = leaf[:8], torch.nn.Parameter(torch.zeros(8))
    state = {"exp_avg": torch.zeros(8), "exp_avg_sq": torch.zeros(8), "step": torch.tensor(3.0)}
    fake = argparse.Namespace(
        config=argparse.Namespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        model_param_group_index_map={model_param: (0, 0)},
        optimizer=argparse.Namespace(param_groups=[{"params": [main]}], state={main: state}))
    tensors = {"param": torch.full((8,), 1.0), "exp_avg": torch.full((8,), 2.0),
               "exp_avg_sq": torch.full((8,), 3.0), **extra}
    DistributedOptimizer._set_main_param_and_optimizer_states(fake, model_param, tensors)
    assert main.eq(1).all() and state["exp_avg"].eq(2).all() and state["exp_avg_sq"].eq(3).all()
    assert state["step"].item() == 3.0  # load_state_dict's, from param_groups: not overwritten


@pytest.mark.parametrize("mode", ["tracker_fsync", "two_renames"])
def test_a_megatron_finalization_failing_after_the_checkpoint_is_in_place_says_so(tmp_path, monkeypatch, mode):
    """The tracker renamed and its fsync failed, or a re-save without an exchange whose second
    rename failed (the old iteration in the trash): neither is "the tracker still names the
    previous checkpoint". A DurabilityError says where the new one is, and retention keeps
    what the tracker names."""
    import errno

    from deepspeed_async_ckpt.errors import DurabilityError

    monkeypatch.setattr(torch_dist, "write_markers", _write_markers)

    class Failing(LocalStorage):
        failing = None

        def swap(self, a, b):
            return False if self.failing == "two_renames" else super().swap(a, b)

        def replace(self, src, dst, *, durable=True):
            if self.failing == "two_renames" and os.path.basename(src).startswith(".async_ckpt_staging."):
                raise OSError(errno.EIO, "Input/output error", src)
            super().replace(src, dst, durable=durable)
            if self.failing == "tracker_fsync" and os.path.basename(dst) == os.path.basename(tracker_path(root)):
                raise OSError(errno.EIO, "Input/output error", dst)

    root, storage = str(tmp_path), Failing(fsync=True)
    ck = _engine(storage)

    def save_and_finalize(iteration, steps):
        _save_iteration(ck, root, iteration, steps)
        try:
            ck.wait()
        except DurabilityError as exc:
            return exc
        return None

    assert save_and_finalize(10, 5) is None
    storage.failing = mode
    iteration = 20 if mode == "tracker_fsync" else 10
    error = save_and_finalize(iteration, 9)
    storage.failing = None
    assert isinstance(error, DurabilityError), error
    assert "still names the previous" not in str(error)
    if mode == "tracker_fsync":
        assert "latest_checkpointed_iteration.txt names it" in str(error)
        assert ck._retention.pointed[root] == os.path.abspath(checkpoint_dir(root, 20))
    else:
        assert "renaming it into place failed" in str(error)
    ck.recover(root)
    assert read_tracker(root) == iteration
    assert torch.load(os.path.join(checkpoint_dir(root, iteration), "common.pt"), weights_only=False)["steps"] == 9
    ck.close()


def test_megatron_lm_hook_loads_the_keepers_newer_checkpoint_then_disk_once_it_is_gone():
    """With the memory tier on, the keeper holding iter_0000002 and the save directory only
    iter_0000001: Megatron-LM's load reads --load pointed at the keeper's tmpfs copy (its
    tracker naming 2, the bytes saved), --load is put back and no copy stays; with the keeper
    killed, it reads iteration 1 from --load. Run with stand-ins for megatron.training."""
    result = _run_one_rank("megatron_lm_stub_memory.py")
    memory, killed = result["memory"], result["killed"]
    assert memory["dir"].startswith("/dev/shm/dsack-load.") and memory["tracker"] == "2" and memory["same_bytes"]
    assert memory["load_after"] == result["load_dir"] and memory["left"] == []
    assert killed["dir"] == result["load_dir"] and killed["tracker"] == "1" and killed["left"] == []
