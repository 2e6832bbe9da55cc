"""The DeepSpeed checkpoint engine (``deepspeed_async_ckpt.integrations.deepspeed``) in
one process: config checks, tags, the exchange at a save's end, weight editors."""

import os
from types import SimpleNamespace

import pytest
import torch

from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.errors import Failure

from helpers import make


def test_deepspeed_node_local_storage_across_nodes_commits_on_every_node():
    """With ``use_node_local_storage`` on several nodes, rank 0 cannot see the other nodes'
    directories: the engine then commits through the process group's store, each node its own
    copy. On one node it is everyone's directory and the commit stays as it is; a launcher
    variable that contradicts the host count is refused, naming the key (ranks would be
    placed on the wrong node)."""
    from deepspeed_async_ckpt.errors import ConfigError
    from deepspeed_async_ckpt.integrations.deepspeed import replicas

    for name in replicas._LOCAL_SIZE_VARIABLES:
        os.environ.pop(name, None)
    try:
        os.environ["LOCAL_WORLD_SIZE"] = "8"
        assert replicas.needs_node_local(True, 16, 8)
        assert not replicas.needs_node_local(True, 8, 8)  # one node
        assert not replicas.needs_node_local(False, 16, 8)
        os.environ["LOCAL_WORLD_SIZE"] = "16"
        with pytest.raises(ConfigError, match=r"checkpoint.use_node_local_storage .* \(16 ranks, 8 on this node\)"):
            replicas.needs_node_local(True, 16, 8)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)


@pytest.mark.parametrize("env,hosts,across", [
    ({"LOCAL_SIZE": "1"}, ["node0", "node0"], True),  # DeepSpeed's launcher: LOCAL_SIZE, no LOCAL_WORLD_SIZE
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, ["node0", "node0"], True),  # mpirun
    ({}, ["node0", "node1"], "refused"),  # no variable: the host names tell, but not where each rank is
    ({}, ["node0", "node0"], False),  # one node
    ({"LOCAL_WORLD_SIZE": "2"}, ["node0", "node0"], False),
    # srun --ntasks-per-node=1 torchrun --nproc-per-node 2: torchrun's own variable wins
    ({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "1"}, ["node0", "node0"], False),
])
def test_node_local_storage_across_nodes_is_seen_whatever_the_launcher(monkeypatch, env, hosts, across):
    """Whether node-local storage spans nodes is read from torchrun's LOCAL_WORLD_SIZE,
    DeepSpeed's launcher (LOCAL_SIZE), mpirun's or srun's variable, and the host names: across
    nodes the engine commits on every node (``node_local``), on one node as before."""
    import torch.distributed as dist

    from deepspeed_async_ckpt.core import committer
    from deepspeed_async_ckpt.errors import ConfigError
    from deepspeed_async_ckpt.integrations.deepspeed import engine as deepspeed_engine
    from deepspeed_async_ckpt.integrations.deepspeed import replicas

    for name in replicas._LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, *a, **k: out.__setitem__(slice(None), hosts))
    monkeypatch.setattr(committer, "default_store", dist.HashStore)  # no process group here

    def build():
        engine = deepspeed_engine.AsyncCheckpointEngine(
            SimpleNamespace(use_node_local_storage=True),
            AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), zero_stage=1)
        engine.checkpointer.close()
        return engine.checkpointer.config.node_local

    if across == "refused":
        with pytest.raises(ConfigError, match="use_node_local_storage"):
            build()
    else:
        assert build() is across


@pytest.mark.parametrize("tag", ["", ".", "..", "a/b", "../escape", ".async_ckpt_x", " ", "global_step10\n",
                                 " global_step10", "step\t10", "step\x7f", "latest", "latest_universal"])
def test_deepspeed_tags_that_are_not_one_plain_name_are_refused(tmp_path, tag):
    """A tag names the checkpoint's directory in ``save_dir`` and ``latest`` holds it: "a/b"
    and "../escape" (outside ``save_dir``) are refused, with ``save_latest`` or without, as
    well as the names the core refuses; nothing is written. Also refused: control
    characters and whitespace at either end (``latest``'s readers strip it: "global_step10\n"
    was committed and then loaded as "global_step10", " " as the save directory itself), and
    the pointers' own names ("latest" made every later save fail at its commit)."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from deepspeed_async_ckpt.integrations.deepspeed.engine import AsyncCheckpointEngine

    engine = AsyncCheckpointEngine(None, AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    save_dir = tmp_path / "sd"
    for save_latest in (True, False):
        with pytest.raises(ValueError, match=r"save_checkpoint\(tag=.*cannot name a checkpoint"):
            engine.create(CheckpointCommitInfo(tag=tag, save_dir=str(save_dir), save_latest=save_latest))
        assert not engine.checkpointer.is_open
    engine.cleanup()
    assert os.listdir(tmp_path) == []


def test_a_ctrl_c_in_a_sync_deepspeed_saves_end_still_joins_the_exchange(tmp_path, monkeypatch):
    """Sync mode: the other ranks wait for this one in the exchange that ends a DeepSpeed save;
    a Ctrl-C in its commit left them there until the process group timed out. It joins the
    exchange with the interrupt, then raises it."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from deepspeed_async_ckpt.integrations.deepspeed import engine as deepspeed_engine

    engine = deepspeed_engine.AsyncCheckpointEngine(
        None, AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01))
    import types
    engine.begin_save(types.SimpleNamespace(zero_optimization_partition_weights=lambda: True), None)
    engine.create(CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path), save_latest=True))
    engine.save({"w": torch.ones(4)}, str(tmp_path / "t1" / "model.pt"))
    exchanged = []
    monkeypatch.setattr(deepspeed_engine, "exchange_across_ranks",
                        lambda value, error, key="": (exchanged.append(error), (None, {}))[1])
    monkeypatch.setattr(engine.checkpointer, "end",
                        lambda commit=True: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        engine.end_save(True)
    assert exchanged == [Failure("KeyboardInterrupt", "KeyboardInterrupt")], exchanged
    monkeypatch.undo()
    engine.checkpointer.end(commit=False)
    engine.cleanup()


def test_fence_all_and_the_hybrid_engines_lora_fusion_come_before_an_in_place_edit(tmp_path, monkeypatch, held_copier):
    """Weights changed in place outside the optimizer step, after a save and before the next
    step: DeepSpeed's hybrid engine fuses LoRA products into the frozen weights in generate()
    (``_fuse_lora_layer``: ``weight.data += scaling * A @ B``), a user swaps EMA weights in for
    an evaluation. Only the optimizer step waited for the save's lazy copies, so the edit
    would reach the file (off by 0.5 here, also after a resume). The patched fusion
    and ``fence_all()`` fence first; the copier is held until a fence here."""
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

    import deepspeed_async_ckpt
    from deepspeed_async_ckpt.integrations.deepspeed.weight_editors import patch_weight_editors, unpatch_weight_editors

    release = held_copier
    monkeypatch.setattr(DeepSpeedHybridEngine, "_fuse_lora_layer", DeepSpeedHybridEngine._fuse_lora_layer)
    patch_weight_editors()
    try:
        weight = torch.zeros(64, 64)

        class Container:  # what the hybrid engine's inference container does to the base weight
            def fuse_lora(self):
                weight.data += 0.5

        class Hybrid:
            _inference_containers = [Container()]

        ck = make()
        for name, edit in [("lora", lambda: DeepSpeedHybridEngine._fuse_lora_layer(Hybrid(), 0)),
                           ("ema", lambda: (deepspeed_async_ckpt.fence_all(), weight.copy_(torch.ones(64, 64))))]:
            release.clear()
            before = weight.clone()
            ck.begin(str(tmp_path / name), tag=name)
            ck.save({"w": weight}, str(tmp_path / name / "model.pt"))
            ck.end()
            edit()
            ck.fence()  # the next optimizer step
            ck.wait()
            saved = torch.load(tmp_path / name / "model.pt", weights_only=True)["w"]
            assert torch.equal(saved, before), name
            assert not torch.equal(weight, before), name  # the edit happened
        ck.close()
        deepspeed_async_ckpt.fence_all()  # a closed checkpointer: nothing to do
    finally:
        unpatch_weight_editors()


@pytest.mark.parametrize("enabled", [True, False])
def test_deepspeeds_monitor_gets_each_commits_figures_at_its_global_step_only_when_enabled(tmp_path, enabled):
    """DeepSpeed's ``monitor`` (its ``MonitorMaster``) gets the figures of each committed save,
    at the engine's global step when it was saved, through ``write_events``; with the
    monitor off, nothing is attached and nothing written."""
    from types import SimpleNamespace as NS

    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from deepspeed_async_ckpt.integrations.deepspeed.engine import AsyncCheckpointEngine

    written = []
    monitor = NS(enabled=enabled, write_events=written.extend)
    engine = AsyncCheckpointEngine(None, AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    ds = NS(monitor=monitor, global_steps=7, zero_optimization_partition_weights=lambda: True)
    for step in (7, 9):
        ds.global_steps = step
        engine.begin_save(ds, None)
        engine.create(CheckpointCommitInfo(tag=f"global_step{step}", save_dir=str(tmp_path), save_latest=True))
        engine.save({"w": torch.ones(256)}, str(tmp_path / f"global_step{step}" / "model.pt"))
        engine.end_save(True)
        engine.checkpointer.wait()
    engine.cleanup()
    if not enabled:
        assert written == [] and engine.checkpointer._reporter.callbacks[1:] == []
        return
    assert sorted({step for _, _, step in written}) == [7, 9]
    assert [name for name, _, step in written if step == 9] == [
        "async-ckpt/save-call-ms", "async-ckpt/fence-wait-ms", "async-ckpt/bytes",
        "async-ckpt/persisted-s", "async-ckpt/committed-s"]
    info = engine.checkpointer.history[-1].commit_info
    assert ("async-ckpt/bytes", info.bytes, 9) in written
    assert ("async-ckpt/committed-s", round(info.seconds, 6), 9) in written


def test_the_optimizer_steps_fence_leaves_frozen_parameters_to_the_copier():
    """What the fence before DeepSpeed's optimizer step need not wait for: parameters that
    do not require a gradient, unless they share a storage with one that does (a flattened
    buffer of both, which the step writes)."""
    from deepspeed_async_ckpt.integrations.deepspeed.engine import frozen_parameters

    flat = torch.zeros(20)
    m = torch.nn.Module()
    m.frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    m.trained = torch.nn.Parameter(flat[:10])
    m.beside_trained = torch.nn.Parameter(flat[10:], requires_grad=False)  # same storage as trained
    m.empty = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    assert [p is m.frozen for p in frozen_parameters(m)] == [True]
