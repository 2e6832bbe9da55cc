"""Test helper: hold the engine's background copier until the training thread reaches the fence,
so that whatever the loop changes before the fence would be in a lazily copied file."""

import threading

from deepspeed_async_ckpt.snapshot import Stager


def hold_copier_until_fence() -> threading.Event:
    """Patch :class:`Stager` for the rest of the process: the copier thread waits (up to 60 s)
    for the returned event, which every fence sets. ``clear()`` it to hold the next save."""
    real_copy, real_fence, release = Stager._copy, Stager.fence, threading.Event()

    def copy(self, item, ready=None):
        if threading.current_thread().name == "async-ckpt-copier":
            release.wait(60)
        return real_copy(self, item, ready)

    def fence(self, unchanged=None):
        release.set()
        return real_fence(self, unchanged)

    Stager._copy, Stager.fence = copy, fence
    return release
