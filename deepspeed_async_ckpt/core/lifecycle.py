"""What a process does with its checkpointers as a whole: the registry of the open ones, the
flush at interpreter exit, the fork of a child, waiting for a training thread at exit, and
the save directories a checkpointer claims (rank 0) so that no other job saves there.

The registry (:func:`open_checkpointers`, :func:`fence_all`, :func:`saves_in_flight`,
:func:`saving_dirs`) is read from any thread: the training loop, an evaluation thread, the
integrations' hooks. The exit flush runs on the thread
that runs Python's shutdown hooks (the main thread), before ``concurrent.futures`` pools stop
taking work; the fork handler runs in the child, right after ``fork``. Claims are taken on
the training thread (``begin``) and released there or by ``close``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Callable

from ..commit import claim_save_dir, forget_claims_in_child, release_save_dir

if TYPE_CHECKING:
    from .checkpointer import AsyncCheckpointer
    from .handle import CheckpointHandle
    from .saves import Saves


_exit_flushes: list[weakref.WeakMethod] = []
_exit_lock = threading.Lock()
_exit_hook_installed = False
_open_checkpointers: "weakref.WeakSet[AsyncCheckpointer]" = weakref.WeakSet()


def flush_at_exit(method: Callable[[], None]) -> None:
    """Call the bound ``method`` when the interpreter exits normally, while Python's thread
    pools still take work: the last checkpoint of a script that returns right after saving is
    then written and committed. Later registrations run first; the object is held weakly.

    ``atexit`` runs too late for that: Python calls it after ``threading``'s own shutdown hooks,
    one of which makes every ``concurrent.futures`` pool refuse new work, so a save still being
    written would fail instead. The hook goes to ``threading._register_atexit`` (what
    ``concurrent.futures`` itself uses; its hooks run newest first, so ours runs before the
    pools stop), or to ``atexit`` where that does not exist."""
    global _exit_hook_installed
    with _exit_lock:
        _exit_flushes.append(weakref.WeakMethod(method))
        if _exit_hook_installed:
            return
        _exit_hook_installed = True
    try:
        threading._register_atexit(_run_exit_flushes)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # another Python; or already shutting down
        atexit.register(_run_exit_flushes)


def cancel_flush_at_exit(method: Callable[[], None]) -> None:
    with _exit_lock:
        _exit_flushes[:] = [ref for ref in _exit_flushes if ref() not in (None, method)]


def _run_exit_flushes() -> None:
    while True:
        with _exit_lock:
            if not _exit_flushes:
                return
            method = _exit_flushes.pop()()
        if method is not None:
            method()


def register(checkpointer: AsyncCheckpointer, at_exit: Callable[[], None]) -> None:
    """Count ``checkpointer`` among this process's open ones, and call its ``at_exit`` (its
    flush) at exit."""
    flush_at_exit(at_exit)
    _open_checkpointers.add(checkpointer)


def unregister(checkpointer: AsyncCheckpointer, at_exit: Callable[[], None]) -> None:
    """``checkpointer`` is closed: no exit flush (the ``at_exit`` it registered), no longer
    listed."""
    cancel_flush_at_exit(at_exit)
    _open_checkpointers.discard(checkpointer)


def _forget_in_child() -> None:
    """In a forked child (a DataLoader worker, say): the parent's checkpointers have no
    threads here, so nothing they hold will ever commit. The child must not flush them at its
    exit (it would wait for ever for the parent's save in flight) and must not use them."""
    global _exit_lock
    _exit_lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _exit_flushes.clear()
    for ck in list(_open_checkpointers):
        ck.forget_in_child()
        _open_checkpointers.discard(ck)  # fence_all() in the child skips them
    forget_claims_in_child()  # the parent's save-directory locks are the parent's


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def fence_all() -> None:
    """:meth:`AsyncCheckpointer.fence` on every open checkpointer of this process: call it
    before changing model weights in place outside the optimizer step (an EMA copy swapped in
    for an evaluation, LoRA weights fused for generation, a manual edit). A save copies the
    weights lazily, and only the optimizer step waits for those copies; without a fence such
    an edit can reach the file. Returns at once when no save has copies outstanding."""
    for checkpointer in list(_open_checkpointers):
        if not checkpointer.closed:
            checkpointer.fence()


def saves_in_flight() -> list[CheckpointHandle]:
    """The saves of this process's open checkpointers that are sealed (``end``) and not yet
    committed or failed (or, on rank 0, not yet swapped in)."""
    return [h for c in list(_open_checkpointers) if not c.closed for h in c.in_flight()]


def open_checkpointers() -> list[AsyncCheckpointer]:
    """This process's checkpointers that are not closed."""
    return [c for c in list(_open_checkpointers) if not c.closed]


def saving_dirs() -> set[str]:
    """Real paths of the checkpoint directories that this process's open checkpointers have
    begun and not yet committed or failed (or, on rank 0, not yet swapped in): directories that
    must be neither deleted nor resumed from yet."""
    dirs: set[str] = set()
    for checkpointer in list(_open_checkpointers):
        if checkpointer.closed:
            continue
        dirs.update(checkpointer.dirs_in_use())
    return {os.path.realpath(d) for d in dirs}


def runs_a_task(thread: threading.Thread) -> bool:
    """Whether the ``concurrent.futures`` worker ``thread`` is running a task now (rather than
    waiting for one); True where that cannot be told."""
    from concurrent.futures import thread as futures_thread

    code = getattr(getattr(getattr(futures_thread, "_WorkItem", None), "run", None), "__code__", None)
    frame = sys._current_frames().get(thread.ident) if code is not None else None
    if frame is None:
        return True
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def join_training_thread(owner: threading.Thread | None, saves: Saves) -> None:
    """At interpreter exit: if the saves come from a thread other than this one (training
    in a non-daemon thread, the main thread returned), wait until it ends, as Python itself
    does right after (it runs the exit flush before it joins such threads, and closing
    under a save abandons it, or refuses the thread's next one). A ``concurrent.futures``
    worker that saved earlier and now idles stops only after this hook, so for one only a
    save still being made is waited for (from the start of ``begin``, whose collective may
    wait for the slowest rank, to ``end``)."""
    if owner is None or owner is threading.current_thread() or owner.daemon:
        return
    from concurrent.futures import thread as futures_thread

    if owner not in getattr(futures_thread, "_threads_queues", {}):
        owner.join()
        return
    # and only while the worker runs a task: one whose save raised between begin and end
    # left the save open and went idle, and the exit would otherwise hang for ever
    while (saves.current is not None or saves.beginning is not None) and owner.is_alive() \
            and runs_a_task(owner):
        owner.join(0.1)


class SaveDirClaims:
    """Rank 0: the save directories one checkpointer claimed (see
    :func:`~..commit.claim_save_dir`), each with the key to release. ``background_busy()``:
    whether a commit callback, report, retention or deletion is queued or running (then no
    claim is given back: a callback may read a checkpoint, retention delete one)."""

    def __init__(self, saves: Saves, background_busy: Callable[[], bool]) -> None:
        self._saves, self._background_busy = saves, background_busy
        self._claimed: dict[str, str | None] = {}

    def claim(self, save_dir: str) -> None:
        """Claim ``save_dir`` for this process on its first save there."""
        save_dir = os.path.abspath(save_dir)
        if save_dir not in self._claimed:
            self._claimed[save_dir] = claim_save_dir(save_dir)
        self._release_idle(keep=save_dir)

    def _release_idle(self, keep: str) -> None:
        """Give back the claims of the save directories other than ``keep`` that no save and no
        background task of this checkpointer uses any more: a job that saves into a new
        directory each time (Hugging Face Trainer's ``checkpoint-N``) would otherwise keep one
        lock file open per save until ``close``, and fail with "Too many open files" after
        some hundreds of saves. In use: saves in flight (their finalize steps, swap and
        pointer included: the commit runs them), and, for any directory, commit callbacks and
        reports still queued or running and retention or deletions still to run."""
        busy = {os.path.dirname(h.ckpt_dir) for h in self._saves.pending()}
        if self._background_busy():
            return  # the next begin
        for save_dir in [d for d in self._claimed if d != keep and d not in busy]:
            key = self._claimed.pop(save_dir)
            if key is not None:
                release_save_dir(key)

    def unclaim(self, save_dir: str) -> None:
        """Undo :meth:`claim` of a save directory a ``begin`` made and then gave up."""
        key = self._claimed.pop(os.path.abspath(save_dir), None)
        if key is not None:
            release_save_dir(key, remove=True)

    def release_all(self) -> None:
        """``close``, once no commit runs: give every claim back."""
        for key in self._claimed.values():
            if key is not None:
                release_save_dir(key)
        self._claimed.clear()
