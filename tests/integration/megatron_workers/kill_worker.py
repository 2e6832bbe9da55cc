"""``scripts/pretrain_gpt.py``'s loop (:func:`megatron_adapter.mock_gpt.main`) whose checkpoint
storage SIGKILLs the rank the moment it starts writing the first tensor file of iteration
``$KILL_AT_ITERATION``: a crash mid-persist, on every rank that writes, before any of them can
record its part of that checkpoint."""

from __future__ import annotations

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: the CPU shim
from megatron_cpu_shim import apply as apply_cpu_shim  # noqa: E402

from deepspeed_async_ckpt.storage import LocalStorage  # noqa: E402
from megatron_adapter import mock_gpt  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's


class KillMidPersist(LocalStorage):
    def __init__(self, ckpt_dir_name: str) -> None:
        super().__init__(fsync=True)
        self.ckpt_dir_name = ckpt_dir_name

    def open_write(self, path: str):
        if os.path.basename(os.path.dirname(path)) == self.ckpt_dir_name \
                and os.path.basename(path).startswith("__"):
            # The saves before it are committed first (the tests assert the tracker names the
            # last of them): on a busy machine its commit could still be running at this point.
            tracker = os.path.join(os.path.dirname(os.path.dirname(path)), TRACKER)
            deadline = time.monotonic() + 120
            while not os.path.exists(tracker) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().open_write(path)


if __name__ == "__main__":
    kill_at = int(os.environ["KILL_AT_ITERATION"])
    apply_cpu_shim()  # (changes nothing with CUDA)
    sys.exit(mock_gpt.main(sys.argv[1:], storage=KillMidPersist(f"iter_{kill_at:07d}")))
