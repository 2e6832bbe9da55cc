"""One rank of a checkpoint test: build a tiny megatron-core GPT in a given layout, then either

``save``: train a few steps; save the same state three ways with the engine (sync, async
    ``balanced``, async ``replica`` through a tiny host pool and slow storage) and take one
    more optimizer step right away (the checkpoints must still hold the pre-step values);
    reload both async ones with our loader (with ``--interop``: the balanced one with
    megatron-core's own ``dist_checkpointing.load``, then save once more with megatron-core's
    own ``dist_checkpointing.save`` and reload that with our loader);
``load``: load a checkpoint written in another layout (resharding).

Every rank dumps what it holds, keyed by (sharded key, global offset), to ``--out``: the
reference taken at save time, each reloaded state, and the engine's per-rank write records.
The test process compares them; this file asserts nothing itself.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: the CPU shim
from megatron_cpu_shim import apply as apply_cpu_shim  # noqa: E402

from deepspeed_async_ckpt.config import AsyncCheckpointConfig  # noqa: E402
from deepspeed_async_ckpt.storage import LocalStorage  # noqa: E402
from megatron_adapter import compat  # noqa: E402
from megatron_adapter import mock_gpt  # noqa: E402 - the model, optimizer and state dict of scripts/pretrain_gpt.py
from megatron_adapter.checkpointer import MegatronCheckpointer, verify_checkpoint_dir  # noqa: E402


def model_args(tp: int, pp: int) -> argparse.Namespace:
    return mock_gpt.parse_args([
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--use-distributed-optimizer", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "64",
        "--micro-batch-size", "2", "--train-iters", "100", "--lr", "0.01"])


def snapshot(state_dict: dict) -> tuple[dict, list]:
    """(key, offset) -> tensor clone, and the shard list (replica ids as megatron set them)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    sharded, _ = save_preprocess(state_dict, validate_access_integrity=False)
    tensors, shards = {}, []
    for v in nested_values(sharded):
        if isinstance(v, ShardedTensor):
            data = v.data.detach().to("cpu", copy=True).contiguous()
            # Stacked layers carry the layer axis in the global shape/offset only.
            data = data.view((1,) * v.prepend_axis_num + tuple(data.shape))
            tensors[(v.key, tuple(v.global_offset))] = data
            shards.append({"kind": "tensor", "key": v.key, "offset": list(v.global_offset),
                           "global_shape": list(v.global_shape), "replica_id": _rid(v.replica_id),
                           "bytes": data.numel() * data.element_size()})
        elif isinstance(v, ShardedObject):
            shards.append({"kind": "object", "key": v.unique_key, "replica_id": _rid(v.replica_id)})
    return tensors, shards


def _rid(replica_id):
    return list(replica_id) if isinstance(replica_id, tuple) else replica_id


def adam_steps(optimizer) -> list[float]:
    steps = set()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if "step" in state:
                steps.add(float(state["step"]))
    return sorted(steps)


class Rank:
    def __init__(self, tp: int, pp: int) -> None:
        self.args = model_args(tp, pp)
        apply_cpu_shim()  # (changes nothing with CUDA)
        mock_gpt.init_distributed(self.args)
        compat.install()
        mock_gpt.set_seeds(self.args.seed)
        self.ddp, self.gpt, config = mock_gpt.build_model(self.args)
        self.optimizer, self.scheduler = mock_gpt.build_optimizer(self.args, self.ddp, config)
        self.metadata = mock_gpt.sharded_metadata(self.args)
        self.iteration = 0
        self.rank = dist.get_rank()

    def state(self, is_loading: bool = False, with_rng: bool = True) -> dict:
        return mock_gpt.state_dict_for(self.args, self.gpt, self.optimizer, self.scheduler,
                                           self.iteration, metadata=self.metadata,
                                           is_loading=is_loading, with_rng=with_rng)

    def train_step(self, checkpointers=(), before_fence=None) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        a = self.args
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        batches = iter([mock_gpt.mock_batch(a, self.iteration, m) for m in range(a.num_microbatches)])
        get_forward_backward_func()(forward_step_func=mock_gpt.forward_step, data_iterator=batches,
                                    model=[self.ddp], num_microbatches=a.num_microbatches,
                                    seq_length=a.seq_length, micro_batch_size=a.micro_batch_size,
                                    forward_only=False)
        if before_fence is not None:
            before_fence()
        for ckpt in checkpointers:
            ckpt.fence()
        self.optimizer.step()
        self.scheduler.step(increment=a.global_batch_size)
        self.iteration += 1

    def load_into_model(self, ckpt_dir: str, loader, same_grid: bool = True) -> dict:
        """Load and apply; returns the model tensors exactly as read from the checkpoint (fp32
        model weights are then overwritten by the optimizer's main weights, so the state after
        the load alone would not show a torn model tensor)."""
        # RNG states are per (PP, TP) coordinate: a different grid does not load them (as in
        # Megatron-LM).
        request = self.state(is_loading=True, with_rng=same_grid)
        for key in ("opt_param_scheduler", "args", "iteration", "checkpoint_version",
                    "num_floating_point_operations_so_far"):
            request.pop(key)
        state = loader(request, ckpt_dir)
        read = {k: v.detach().clone() for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
        self.gpt.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["opt_param_scheduler"])
        self.iteration = int(state["iteration"])
        return read

    def model_shards(self, by_name: dict | None = None) -> dict:
        """Model tensors keyed like :func:`snapshot`: the live ones, or ``by_name`` (state-dict
        key -> tensor, as a load returns them) placed with this layout's global offsets."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        out = {}
        for name, sh in self.gpt.sharded_state_dict(metadata=dict(self.metadata)).items():
            if isinstance(sh, ShardedTensor):
                t = (sh.data if by_name is None else by_name[name]).detach().to("cpu", copy=True)
                t = t.contiguous().view((1,) * sh.prepend_axis_num + tuple(t.shape))
                out[(sh.key, tuple(sh.global_offset))] = t
        return out

    def dump(self, out: str, name: str, extra: dict | None = None, read: dict | None = None) -> None:
        """Write ``name.rank<r>.pt`` (model and optimizer shards as the live objects hold them),
        ``name.model.rank<r>.pt`` (the model tensors as read from the checkpoint when ``read``
        is given, else the live ones) and ``name.rank<r>.json`` (shard list, layout)."""
        tensors, shards = snapshot(self.state())
        torch.save(tensors, os.path.join(out, f"{name}.rank{self.rank}.pt"))
        torch.save(self.model_shards(read), os.path.join(out, f"{name}.model.rank{self.rank}.pt"))
        info = {"rank": self.rank, "iteration": self.iteration, "shards": shards,
                "adam_steps": adam_steps(self.optimizer), "layout": self.layout(), **(extra or {})}
        with open(os.path.join(out, f"{name}.rank{self.rank}.json"), "w", encoding="utf-8") as f:
            json.dump(info, f)

    def layout(self) -> dict:
        from megatron_adapter.layout import ParallelLayout

        return ParallelLayout.from_parallel_state().to_dict()


def engine_config(mode: str, host_buffer_gb: float = 0.25) -> AsyncCheckpointConfig:
    return AsyncCheckpointConfig(enabled=True, mode=mode, host_buffer_gb=host_buffer_gb,
                                 writer_threads=2, fsync=False)


class SlowStorage(LocalStorage):
    """Files open only once ``released`` is set (right before the next step's fence), and
    then a few ms each: with a host pool smaller than the checkpoint, copies wait for writes
    to free room, and are still outstanding when the optimizer step comes. The fence must
    hold that step back, or the save fails (an in-place change before the copy) or holds
    post-step values. With the delay alone, a fast machine could finish a small rank's save
    before the step, its copies done during forward and backward anyway, and the test would
    pass with the fence removed."""

    def __init__(self, fsync: bool) -> None:
        super().__init__(fsync=fsync)
        self.released = threading.Event()

    def open_write(self, path: str):
        self.released.wait(60)
        time.sleep(0.01)
        return super().open_write(path)


class DiskFullOnRank(LocalStorage):
    """``rank``'s disk is full: opening a tensor file fails there with ENOSPC."""

    def __init__(self, rank: int) -> None:
        super().__init__(fsync=False)
        self.rank = rank

    def open_write(self, path: str):
        if dist.get_rank() == self.rank and ".distcp" in os.path.basename(path):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return super().open_write(path)


def run_resave(r: Rank, out: str) -> None:
    """The tracker's iteration saved again with another state: first while one rank's disk is
    full (the save fails on every rank; a copy of the directory is taken then), then for real.
    Both copies are loaded at the end."""
    save_dir, iteration = os.path.join(out, "ckpt_resave"), r.iteration
    first = MegatronCheckpointer(engine_config("sync"))
    first.save(r.state(), save_dir, iteration, content_metadata=r.metadata)
    first.close()
    r.dump(out, "resave_first")
    r.train_step()
    failing = MegatronCheckpointer(engine_config("sync"), storage=DiskFullOnRank(1))
    failed = None
    try:
        failing.save(r.state(), save_dir, iteration, content_metadata=r.metadata)
    except Exception as exc:  # raised on every rank
        failed = f"{type(exc).__name__}: {exc}"
    try:
        failing.close()
    except Exception:
        pass  # the same failure, reported again
    if r.rank == 0:
        shutil.copytree(save_dir, os.path.join(out, "ckpt_resave_failed"))
    dist.barrier()
    r.dump(out, "resave_second", extra={"failed": failed})
    good = MegatronCheckpointer(engine_config("async"))
    record = good.save(r.state(), save_dir, iteration, content_metadata=r.metadata)
    r.train_step([good])  # the async copies must come before this step changes the weights
    good.close()
    reader = MegatronCheckpointer(engine_config("async"))
    read = r.load_into_model(record.ckpt_dir, reader.load)
    r.dump(out, "resaved_reload", read=read)
    failed_dir = os.path.join(out, "ckpt_resave_failed", os.path.basename(record.ckpt_dir))
    read = r.load_into_model(failed_dir, reader.load)
    r.dump(out, "resave_failed_reload", read=read)
    reader.close()


#: Room for the largest shard of the test model (16 KiB at TP=1) and little more: a rank's
#: checkpoint (about 250 KiB) goes through it a shard or two at a time.
TINY_POOL_GB = 16 * 1024 / 1024**3


def run_save(r: Rank, out: str, steps: int, interop: bool) -> None:
    from megatron.core import dist_checkpointing

    for _ in range(steps):
        r.train_step()
    r.dump(out, "reference")
    checkpointers, handles, records = {}, {}, {}
    saves = {"sync": (engine_config("sync"), "replica", None),
             "balanced": (engine_config("async"), "balanced", None),
             "replica": (engine_config("async", TINY_POOL_GB), "replica", SlowStorage(fsync=False))}
    for name, (config, writers, storage) in saves.items():
        ckpt = MegatronCheckpointer(config, writers=writers, storage=storage)
        reserved = ckpt.reserve(r.state()) if name != "replica" else None  # not the tiny pool
        record = ckpt.save(r.state(), os.path.join(out, f"ckpt_{name}"), r.iteration,
                           content_metadata=r.metadata)
        checkpointers[name], handles[name] = ckpt, record.handle
        if name != "replica":  # the lazy copies take their pool buffers after save returns
            record.handle.wait_staged()
        records[name] = {"files": record.files, "ckpt_dir": record.ckpt_dir, "reserved": reserved,
                         "pool_allocations": ckpt.checkpointer.pool.allocations,
                         "pooled_bytes": ckpt.checkpointer.pooled_bytes}
    # The next optimizer step changes every weight: the async checkpoints must not see it.
    # With the tiny pool, a rank that writes more than the pool holds is still copying now.
    records["replica"]["outstanding_at_step"] = not handles["replica"].wait_persisted(0)
    # the writes go on once forward and backward are done, right before the fence
    r.train_step(checkpointers.values(), before_fence=saves["replica"][2].released.set)
    for name, ckpt in checkpointers.items():
        ckpt.wait()
        records[name]["staged_bytes"] = ckpt.staged_bytes
        ckpt.close()
    with open(os.path.join(out, f"records.rank{r.rank}.json"), "w", encoding="utf-8") as f:
        json.dump(records, f)

    reader = MegatronCheckpointer(engine_config("async"))
    read = r.load_into_model(records["replica"]["ckpt_dir"], reader.load)
    r.dump(out, "reloaded_replica", read=read)
    r.train_step()
    # With --interop, megatron-core's own loader reads the balanced checkpoint.
    read = r.load_into_model(records["balanced"]["ckpt_dir"],
                             dist_checkpointing.load if interop else reader.load)
    r.dump(out, "reloaded_balanced", read=read)
    if interop:
        theirs = os.path.join(out, "ckpt_megatron")
        if r.rank == 0:
            os.makedirs(theirs, exist_ok=True)
        dist.barrier()
        _fork_result_queue()
        dist_checkpointing.save(r.state(), theirs, content_metadata=r.metadata)
        r.train_step()
        read = r.load_into_model(theirs, reader.load)
        r.dump(out, "megatron_reloaded_by_ours", read=read)
    reader.close()
    hashed = hashed_bytes_of_loads(r, records["balanced"]["ckpt_dir"])
    with open(os.path.join(out, f"hashed.rank{r.rank}.json"), "w", encoding="utf-8") as f:
        json.dump(hashed, f)


def hashed_bytes_of_loads(r: Rank, ckpt_dir: str) -> dict[str, int]:
    """Bytes this rank hashes to verify ``ckpt_dir`` before a load of everything, before a
    load without the optimizer state (``--no-load-optim``, a fine-tuning start), before one
    where the ranks request different parts, and told only to skip the optimizer state (the
    Megatron-LM hook, which never sees the request)."""
    import deepspeed_async_ckpt.commit.verify as commit

    real, hashed = commit.hash_ranges, {}

    def counting(path, algorithm, ranges):
        result = real(path, algorithm, ranges)
        hashed[name] += sum(n for n, _ in result)
        return result

    commit.hash_ranges = counting
    reader = MegatronCheckpointer(engine_config("async"))
    try:
        for name, with_optim in (("full", True), ("without_optimizer", False)):
            hashed[name] = 0
            request = mock_gpt.state_dict_for(r.args, r.gpt, r.optimizer, r.scheduler, r.iteration,
                                                  metadata=r.metadata, is_loading=True, with_optim=with_optim)
            for key in ("opt_param_scheduler", "args", "iteration", "checkpoint_version",
                        "num_floating_point_operations_so_far"):
                request.pop(key, None)
            reader.load(request, ckpt_dir)
        # ranks requesting different parts (pipeline stages do: only the first holds the
        # embedding, only the last an untied output layer; each stage its own layers): here
        # only rank 0 requests the decoder's layers, which every file holds; whatever any rank
        # reads must still be hashed, once
        name = "per_rank"
        hashed[name] = 0
        request = mock_gpt.state_dict_for(r.args, r.gpt, r.optimizer, r.scheduler, r.iteration,
                                              metadata=r.metadata, is_loading=True, with_optim=False)
        if r.rank != 0:
            request["model"] = {k: v for k, v in request["model"].items() if not k.startswith("decoder.")}
        verify_checkpoint_dir(ckpt_dir, rank=r.rank, world_size=dist.get_world_size(), request=request)
        name = "skip_optimizer"  # as the Megatron-LM hook verifies under --no-load-optim
        hashed[name] = 0
        verify_checkpoint_dir(ckpt_dir, rank=r.rank, world_size=dist.get_world_size(), skip=("optimizer",))
    finally:
        commit.hash_ranges = real
        reader.close()
    return hashed


def _fork_result_queue() -> None:
    # megatron-core's writer collects results through a multiprocessing Manager it starts with
    # "spawn" (seconds: a fresh interpreter imports torch); a forked one is the same queue, faster.
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


def run_load(r: Rank, out: str, ckpt_dir: str, name: str) -> None:
    reader = MegatronCheckpointer(engine_config("async"))
    read = r.load_into_model(ckpt_dir, reader.load, same_grid=False)
    r.dump(out, name, read=read)
    reader.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=("save", "load"))
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--name", default="resharded")
    p.add_argument("--interop", action="store_true",
                   help="also reload with megatron-core's loader and save with its own save")
    p.add_argument("--resave", action="store_true",
                   help="also save one iteration again, failing first (see run_resave)")
    a = p.parse_args()
    r = Rank(a.tp, a.pp)
    if a.action == "save":
        run_save(r, a.out, a.steps, a.interop)
        if a.resave:
            run_resave(r, a.out)
    else:
        run_load(r, a.out, a.ckpt, a.name)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
