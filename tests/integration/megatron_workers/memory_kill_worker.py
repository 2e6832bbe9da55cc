"""``scripts/pretrain_gpt.py``'s loop (:func:`megatron_adapter.mock_gpt.main`) that SIGKILLs
every rank right after issuing the save of iteration ``$KILL_AT_ITERATION``, once its node's
memory keeper has committed the save before it (the save is collective: no rank gets past it
before every node's keeper has): a crash between two disk saves, with the memory
tier on, while a save is in flight."""

from __future__ import annotations

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: the CPU shim
from megatron_cpu_shim import apply as apply_cpu_shim  # noqa: E402

from deepspeed_async_ckpt.commit.nodes import node_of  # noqa: E402
from deepspeed_async_ckpt.memory.client import KeeperClient  # noqa: E402
from megatron_adapter import mock_gpt  # noqa: E402
from megatron_adapter.checkpointer import checkpoint_dir  # noqa: E402


def _wait_for_memory_commit(save_dir: str, iteration: int, timeout_s: float = 120.0) -> None:
    """Until the keeper's newest checkpoint is ``iteration``'s (on a busy machine its commit may
    still be running when the next save is issued)."""
    want = os.path.basename(checkpoint_dir(save_dir, iteration))
    node = node_of(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))  # each rank its own node's
    deadline = time.monotonic() + timeout_s
    while KeeperClient.newest_name(save_dir, node=node) != want:
        if time.monotonic() > deadline:
            raise SystemExit(f"the memory keeper of {save_dir} did not commit {want} in {timeout_s:g} s")
        time.sleep(0.05)


if __name__ == "__main__":
    kill_at = int(os.environ["KILL_AT_ITERATION"])
    save = mock_gpt.save_checkpoint

    def save_then_kill(args, ckpt, gpt, optimizer, scheduler, iteration, validate):
        if iteration == kill_at:
            _wait_for_memory_commit(args.save, iteration - 1)
        record = save(args, ckpt, gpt, optimizer, scheduler, iteration, validate)
        if iteration == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return record

    mock_gpt.save_checkpoint = save_then_kill
    apply_cpu_shim()  # (changes nothing with CUDA)
    sys.exit(mock_gpt.main(sys.argv[1:]))
