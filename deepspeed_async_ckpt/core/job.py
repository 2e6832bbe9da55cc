"""A save in flight, as the pipeline keeps it: what its handle shows, and what only the
pipeline reads.

:meth:`Session.begin <.session.Session.begin>` makes one :class:`SaveJob` per save and the
save's :class:`~.handle.CheckpointHandle` over it, which reads it and never writes it; the job
keeps its handle (:attr:`SaveJob.handle`), to settle it and to read what the save is. The
core's queues carry the job (the open save, the saves in flight, the committer's queue), so
the modules that write it (the session, the save files, the committer, reports, retention)
are handed it, and never look it up from a handle. Callers never see it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..commit import FinalizeStep
from ..persist import Share
from ..snapshot import FilePlan, TensorItem

if TYPE_CHECKING:
    from .handle import CheckpointHandle, CommitInfo


@dataclass(eq=False)  # one save, found by identity (in flight, in the eager copies' counts)
class SaveJob:
    """One save of one rank, as the training thread, the writers and the committer fill it in."""

    handle: CheckpointHandle = field(init=False, repr=False)
    """The save's handle, made over this job in ``begin``: what the save is (its directory,
    tag, save id, pointer), and the wait points the committer sets."""

    finalize: tuple[FinalizeStep, ...] = ()
    """Rank 0: the steps its commit runs after the manifest (see :mod:`..commit.finalize`);
    emptied once run, so that what they hold is freed."""
    items: list[TensorItem] = field(default_factory=list)
    """This rank's tensor items of the save (the handle's ``wait_staged`` waits for their copies)."""
    files: list[Future] = field(default_factory=list)
    """This rank's file writes, one future each."""
    dependencies: list[Future] = field(default_factory=list)
    """Outside work this save waits for (the handle's ``depends_on``)."""
    nbytes: int = 0
    error: BaseException | None = None
    abandoned: bool = False
    fence_wait_s: float = 0.0
    """Time the training loop spent blocked at fences waiting for this save's copies."""
    eager_wait_s: float = 0.0
    """Time its ``save`` calls waited for earlier saves' eager copies to be written (their
    backpressure: see ``SaveFiles._eager_room`` in :mod:`.files`)."""
    retired: list[str] = field(default_factory=list)
    """Older checkpoints that retention removed after this one committed."""
    times: dict[str, float] = field(default_factory=lambda: {"begin": time.perf_counter()})
    commit_info: CommitInfo | None = None
    """Rank 0, once committed: what the commit wrote."""
    new_dirs: list[str] = field(default_factory=list)
    """Directories this rank made for the save (the save directory on a first save, the
    checkpoint's, its marker, subdirectories of files; on rank 0 also the save directory,
    whoever made it): their entries are made durable before this rank's record, so that
    no crash after the commit takes them back."""
    memory_only: bool = False
    """A save to the keeper's memory only (the memory tier): nothing of it touches the
    checkpoint directory, its records go through the process group's store, no pointer moves."""
    failure: str | None = None
    """Why a sync save's file failed on this rank (rank 0's commit error quotes it)."""
    # What the save has listed on this rank and not yet handed to the background, until it
    # is sealed (``end``, or a fence): under the seal lock of :class:`~.files.SaveFiles`.
    paths: set[str] = field(default_factory=set)
    """The files saved so far, by their path in the checkpoint (each may be saved once)."""
    copies: list[TensorItem] = field(default_factory=list)
    """Lazy items, queued for the copier when the save is sealed."""
    writes: list[tuple[str, list[FilePlan], list[str] | None, Share | None]] = field(default_factory=list)
    """Files (path, plans, part names, share), handed to the writers when it is sealed."""
