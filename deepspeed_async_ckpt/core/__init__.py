"""The framework-neutral engine: :class:`AsyncCheckpointer` and what it is made of.

The modules, in the order a save goes through them:

- :mod:`.handle`: a save's handle and what a commit reports (:class:`CheckpointHandle`,
  :class:`CommitInfo`).
- :mod:`.collectives`: replicas writing one file together (agreement across ranks is
  :mod:`..agreement`'s: :func:`agree`, :func:`outcome`).
- :mod:`.saves`: the saves of one checkpointer and the lock that guards them.
- :mod:`.session`: ``begin``/``end``, the save session; :mod:`.files`: the files of the open
  save, handed to the writers and the copier when it is sealed.
- :mod:`.committer`: the committer thread; :mod:`.reports`: commit callbacks;
  :mod:`.retention`: the retention policy, deletions, crash recovery.
- :mod:`.failures`: background failures, raised at the next save or wait.
- :mod:`.loader`: verified loads.
- :mod:`.lifecycle`: the process's open checkpointers, exit flush, fork, save-directory claims.
- :mod:`.checkpointer`: :class:`AsyncCheckpointer`, the facade over all of them.
"""

from .checkpointer import AsyncCheckpointer
from ..agreement import agree, by_rank, exchange_across_ranks, outcome
from .collectives import Replicas, layout_digest
from .failures import what_stays
from .handle import CheckpointHandle, CommitInfo
from .lifecycle import (cancel_flush_at_exit, fence_all, flush_at_exit, open_checkpointers,
                        saves_in_flight, saving_dirs)

__all__ = [
    "AsyncCheckpointer",
    "CheckpointHandle",
    "CommitInfo",
    "Replicas",
    "agree",
    "by_rank",
    "cancel_flush_at_exit",
    "exchange_across_ranks",
    "fence_all",
    "flush_at_exit",
    "layout_digest",
    "open_checkpointers",
    "outcome",
    "saves_in_flight",
    "saving_dirs",
    "what_stays",
]
