"""The engine's figures of each committed save, as monitor events: ``(name, value, step)``
tuples, the form DeepSpeed's ``MonitorMaster.write_events`` takes and Megatron's TensorBoard
writer (``add_scalar(name, value, step)``) and W&B (``log({name: value}, step)``) take apart.

Rank 0 only, where the commit happens. :class:`CommitFigures` is attached to a checkpointer by
an adapter whose framework has a monitor configured (nothing is attached, nothing written,
otherwise), through the checkpointer's public seams: a begin callback notes each save's step,
a commit callback writes its figures at that step, and each durable tier's drainer tells when
a checkpoint is on the tier. Every write runs on the commit callbacks' thread, in order, never
on the training thread. The figures come from the ranks' records (:mod:`..commit.records`): the
largest over the ranks needs no collective of its own.

Names, at the step the save was made at (DeepSpeed's global step, Megatron's iteration):

================================  =============================================================
``async-ckpt/save-call-ms``       the save call, the largest over the ranks (ms)
``async-ckpt/fence-wait-ms``      the training loop's wait at fences for its copies, the
                                  largest over the ranks (ms)
``async-ckpt/bytes``              bytes in the checkpoint (its manifest's files)
``async-ckpt/persisted-s``        from the save's begin to every rank's files persisted (s)
``async-ckpt/committed-s``        from the save's begin to the commit: the pointer moved (s)
``async-ckpt/memory-committed-s`` with the memory tier: from the save's begin to its slot
                                  committed in the node's keeper (s)
``async-ckpt/memory-only``        with the memory tier: 1 for a save in the keeper's memory
                                  only, 0 for one also on disk
``async-ckpt/tier<i>/drained-s``  from the save's begin to the checkpoint committed on durable
                                  tier ``i`` (``tiers[i]``), written when that drain ends (s)
``async-ckpt/tier<i>/behind``     at this commit: checkpoints committed before it that tier
                                  ``i`` does not hold yet, counted from the newest it holds
                                  (0: it keeps up; with ``every: N``, up to N - 1 by design)
================================  =============================================================
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import Any, Callable, Iterable

from .handle import CheckpointHandle, CommitInfo

Event = tuple[str, float, int]
PREFIX = "async-ckpt/"

#: Saves whose begin is remembered until their commit (older ones are forgotten).
_REMEMBERED = 256


def commit_events(info: CommitInfo, step: int) -> list[Event]:
    """The figures of one committed save, at ``step`` (times to the microsecond)."""
    return [(f"{PREFIX}save-call-ms", round(info.save_call_s * 1e3, 3), step),
            (f"{PREFIX}fence-wait-ms", round(info.fence_wait_s * 1e3, 3), step),
            (f"{PREFIX}bytes", info.bytes, step),
            (f"{PREFIX}persisted-s", round(info.persisted_s, 6), step),
            (f"{PREFIX}committed-s", round(info.seconds, 6), step)] + memory_events(info, step)


def memory_events(info: CommitInfo, step: int) -> list[Event]:
    """With the memory tier: when the save's slot committed, and whether it is in memory only."""
    seconds = getattr(info, "memory_committed_s", None)
    if seconds is None:
        return []
    return [(f"{PREFIX}memory-committed-s", round(seconds, 6), step),
            (f"{PREFIX}memory-only", int(info.memory_only), step)]


def tier_name(index: int, figure: str) -> str:
    return f"{PREFIX}tier{index}/{figure}"


class CommitFigures:
    """Rank 0: writes each committed save's figures through ``write(events)`` at the step
    ``step_of(handle)`` gives for it when it begins (None: that save is not reported).
    :meth:`attach` registers it on a checkpointer."""

    def __init__(self, write: Callable[[list[Event]], Any],
                 step_of: Callable[[CheckpointHandle], int | None]) -> None:
        self._write, self._step_of = write, step_of
        self._lock = threading.Lock()
        self._begun: collections.OrderedDict[str, tuple[int, float, bool]] = collections.OrderedDict()
        """save id -> (step, begin time, drained to the tiers), from begin to commit."""
        self._committed: collections.OrderedDict[str, tuple[int, int, float]] = collections.OrderedDict()
        """checkpoint directory -> (commit number, step, begin time) of its latest commit."""
        self._commits = 0
        self._newest_on_tier: dict[int, int] = {}
        """tier index -> the commit number of the newest checkpoint drained there."""
        self._report: Callable[..., None] = lambda fn, *args: fn(*args)
        self._tiers = 0

    def attach(self, checkpointer: Any) -> "CommitFigures":
        """Register on ``checkpointer`` (rank 0's): its begin and commit callbacks and, with
        durable tiers, each drainer's ``on_drained``. Returns self."""
        checkpointer.add_begin_callback(self.begun)
        checkpointer.add_commit_callback(self.committed)
        self._report = checkpointer.report
        tiers = getattr(checkpointer, "tiers", None)
        for i, drainer in enumerate(getattr(tiers, "drainers", ())):
            drainer.on_drained.append(functools.partial(self.drained, i))
            self._tiers = i + 1
        return self

    def begun(self, handle: CheckpointHandle) -> None:
        """Begin callback (training thread): note the save's step and begin time."""
        step = self._step_of(handle)
        if step is None:
            return
        with self._lock:
            self._begun[handle.save_id] = (int(step), handle.times["begin"], handle.pointer is not None)
            while len(self._begun) > _REMEMBERED:
                self._begun.popitem(last=False)

    def committed(self, info: CommitInfo) -> None:
        """Commit callback (the commit callbacks' thread): write its figures."""
        with self._lock:
            begun = self._begun.pop(info.save_id, None)
            if begun is None:
                return
            step, began, drains = begun
            events = commit_events(info, step)
            if drains:  # saved aside (no pointer moved): never drained, not counted
                number = self._commits
                self._commits += 1
                self._committed[info.ckpt_dir] = (number, step, began)
                self._committed.move_to_end(info.ckpt_dir)
                while len(self._committed) > _REMEMBERED:
                    self._committed.popitem(last=False)
                events += [(tier_name(i, "behind"), number - self._newest_on_tier.get(i, -1) - 1, step)
                           for i in range(self._tiers)]
        self._write(events)

    def drained(self, tier: int, ckpt_dir: str) -> None:
        """A drainer's ``on_drained`` (its thread): ``ckpt_dir`` is committed on tier ``tier``;
        its figure is written on the commit callbacks' thread, after those queued before."""
        now = time.perf_counter()
        with self._lock:
            committed = self._committed.get(ckpt_dir)
            if committed is None:
                return
            number, step, began = committed
            self._newest_on_tier[tier] = max(number, self._newest_on_tier.get(tier, -1))
        self._report(self._write, [(tier_name(tier, "drained-s"), round(now - began, 6), step)])


def write_to(writers: Iterable[Any]) -> Callable[[list[Event]], None]:
    """``write(events)`` for TensorBoard-like writers (``add_scalar(name, value, step)``, each
    flushed) and W&B-like ones (``log({name: value}, step=step)``), as Megatron holds them."""
    writers = [w for w in writers if w is not None]

    def write(events: list[Event]) -> None:
        for w in writers:
            if hasattr(w, "add_scalar"):
                for name, value, step in events:
                    w.add_scalar(name, value, step)
                if hasattr(w, "flush"):
                    w.flush()
            else:
                by_step: dict[int, dict[str, float]] = {}
                for name, value, step in events:
                    by_step.setdefault(step, {})[name] = value
                for step, values in by_step.items():
                    w.log(values, step=step)
    return write
