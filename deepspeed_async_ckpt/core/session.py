"""The save session of one rank: ``begin`` opens a checkpoint (collective), ``end`` seals it
and hands it to the committer.

Call order, on the training thread of every rank::

    begin(ckpt_dir, tag=..., pointer=..., finalize=...)   # collective: agrees a save id, shares failures
    save(...) / save_packed(...)         # per file this rank writes (see :mod:`.files`)
    end()                                # seals: queued for the committer, or (sync) committed

The pointer and the finalize steps (rank 0 keeps them; the other ranks' are dropped) travel
with the save to the committer, which runs them in one commit (:mod:`.committer`).

``begin`` is where the ranks meet: rank 0 decides alone, before any rank can write, whether the
save is staged beside an existing checkpoint, and makes the directory it writes into; one
agreement (:func:`~..agreement.outcome`) then gives every rank that decision (rank 0's
``(save id, staged)``) and every rank's pending failure, so that all of them raise, or none.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Callable, Iterable

from ..agreement import KEY_DIFFERS, Exchange, by_rank, outcome
from ..commit import (META_DIR, FinalizeStep, Pointer, check_checkpoint_dir, check_name,
                      make_checkpoint_dir, remove_stale_temporaries, staging_dir)
from ..commit.finalize import declared_files
from ..config import AsyncCheckpointConfig
from ..errors import AgreementError, AsyncCheckpointError, CommitError, DurabilityError, Failure, describe
from ..storage import Storage
from ..tiers.config import refuse_overlap
from .committer import Committer
from .failures import FailureLedger, reraise, this_save_failed, what_stays
from .files import SaveFiles, missing_dirs
from .handle import CheckpointHandle
from .job import SaveJob
from .lifecycle import SaveDirClaims
from .loader import Loader
from .memory_saves import MemorySaves
from .retention import Retention
from .saves import Saves

logger = logging.getLogger(__name__)

REFUSED = "refused"
"""The kind of rank 0's :class:`~..errors.Failure` in ``begin`` when it refuses the save
directory (another job's), or could not prepare it: every rank raises it in rank 0's words."""


def _holds_files(path: str) -> bool:
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is not None
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:  # cannot tell: stage, so that nothing there is overwritten
        return True


def _write_dir(ckpt_dir: str, save_id: str, staged: bool) -> str:
    """The directory the save writes into: its staging directory if rank 0 decided it is
    staged (``ckpt_dir`` holds a checkpoint), else ``ckpt_dir``."""
    return staging_dir(ckpt_dir, save_id) if staged else ckpt_dir


def _remove_if_empty(storage: Storage, made: tuple[str, list[str]]) -> None:
    """Undo ``_make_write_dir`` for a save ``begin`` then refused: the empty marker, and the
    directories it created (deepest first), as long as nothing else is in them. A directory
    that was there before (empty, made by hand) stays."""
    write_dir, created = made
    try:
        storage.remove_dir(os.path.join(write_dir, META_DIR))
        for path in created:
            storage.remove_dir(path)
    except Exception:  # not empty, or a storage's own error: the refusal is what is raised
        pass


class Session:
    """Opens and seals the saves of one rank. ``exchange``: the transport of ``begin``'s
    agreement (see :func:`~..agreement.exchange_across_ranks`); ``begun(handle)``: called by ``begin``
    once the save is open (the checkpointer's begin callbacks)."""

    def __init__(self, saves: Saves, storage: Storage, config: AsyncCheckpointConfig, *, rank: int,
                 exchange: Exchange, ledger: FailureLedger,
                 claims: SaveDirClaims, retention: Retention, loader: Loader,
                 begun: Callable[[CheckpointHandle], None], files: SaveFiles, committer: Committer,
                 memory: MemorySaves | None = None) -> None:
        self._saves, self._storage, self._config, self._rank = saves, storage, config, rank
        self._memory = memory
        self.exchange = exchange
        self._ledger, self._claims, self._retention = ledger, claims, retention
        self._loader, self._begun, self._files, self._committer = loader, begun, files, committer

    def begin(self, ckpt_dir: str, *, tag: str, pointer: Pointer | None = None,
              finalize: Iterable[FinalizeStep] = (), rotation: bool = True) -> CheckpointHandle:
        """Open a checkpoint (collective: every rank); see :meth:`AsyncCheckpointer.begin
        <.checkpointer.AsyncCheckpointer.begin>`. If a previous save failed on any rank, raises
        on every rank and starts nothing; so does a durable tier that is, holds or lies in the
        save directory (ConfigError)."""
        called = time.perf_counter()
        saves = self._saves
        if saves.current is not None:
            raise AsyncCheckpointError(f"begin({tag!r}) while checkpoint {saves.current.handle.tag!r} "
                                       "is still open: call end() first")
        ckpt_dir = check_checkpoint_dir(ckpt_dir)
        refuse_overlap(self._config.tiers, os.path.dirname(ckpt_dir))  # a tier's copies stay apart
        if pointer is not None:  # written later, by the committer: not wherever the cwd is then
            # its text is read back as one name (a tag, an iteration): a readable one
            check_name(pointer.text, f"Pointer({pointer.path!r}, text)")
            pointer = Pointer(os.path.abspath(pointer.path), pointer.text)
        finalize = tuple(finalize)
        declared_files(finalize)  # a step that cannot run is refused now, not after the commit
        self._loader.forget(ckpt_dir)  # being saved again: its files will change
        with saves.dirs_lock:  # before the exchange, so before any rank writes into it
            saves.beginning = ckpt_dir  # retention leaves it alone (see retire_older)
        made: tuple[str, list[str]] | None = None
        save_dir = os.path.dirname(ckpt_dir)
        only = self._memory is not None and self._memory.next_only()
        if only:  # nothing of it reaches the checkpoint directory: no pointer (its finalize steps
            pointer = None  # write into the commit's memory, and their files go to the keeper)
        try:
            local, more = self._ledger.take()
            opening, made, refused = (uuid.uuid4().hex[:16], False), None, None
            if self._rank == 0 and not only:
                opening, made, refused = self._prepare(ckpt_dir, opening[0], local, pointer)
            failure = Failure(REFUSED, str(refused)) if refused is not None else \
                None if local is None else Failure.of(local)
            (save_id, staged), failed = outcome(f"begin({tag!r})", opening, local, failure=failure,
                                                exchange=self.exchange, key=ckpt_dir)
            try:
                self._raise_if_refused(ckpt_dir, local, more, refused, failed)
            except BaseException:
                if made is not None:  # refused: nothing of it is left
                    if save_dir in made[1]:  # its lock too, if claimed here
                        self._claims.unclaim(save_dir)
                    _remove_if_empty(self._storage, made)
                raise
            write_dir = _write_dir(ckpt_dir, save_id, staged)
            job = SaveJob(finalize=finalize if self._rank == 0 else (), memory_only=only)
            job.times["called"] = called  # the save call: from here to end()
            handle = job.handle = CheckpointHandle(ckpt_dir, str(tag), save_id, pointer, write_dir, job,
                                                   rotation=rotation)
            saves.open(job)
            if self._memory is not None:
                self._memory.counted(only)
            self._begun(handle)  # the begin callbacks: what it depends on
            if only:  # made nothing on disk
                pass
            elif self._rank == 0:  # and the marker's entry (made under another name, renamed), and
                # the save directory's, which Trainer makes for each checkpoint-N: the pointer in it
                job.new_dirs += [*(made[1] if made else ()), os.path.join(write_dir, META_DIR), save_dir]
            elif self._committer.leads_node:  # its node's copy (node-local storage): the same
                job.new_dirs += self._committer.mark_node_copy(write_dir)
        finally:
            with saves.dirs_lock:
                saves.beginning = None
        return handle

    def _prepare(self, ckpt_dir: str, save_id: str, local: BaseException | None,
                 pointer: Pointer | None
                 ) -> tuple[tuple[str, bool], tuple[str, list[str]] | None, AsyncCheckpointError | None]:
        """Rank 0, in ``begin`` before the exchange: claim the save directory, finish there
        what a crash cut short, decide whether this save is staged and, unless an earlier
        failure (``local``) stops it, make the directory it writes into. Returns what every
        rank is given (the save id, whether it is staged), what :meth:`_make_write_dir` made,
        and why the save is refused
        (None: it is not). A failure is returned, not raised: the other ranks would wait in
        the exchange."""
        save_dir = os.path.dirname(ckpt_dir)
        made: tuple[str, list[str]] | None = None
        refused: AsyncCheckpointError | None = None
        if os.path.isdir(save_dir):
            try:  # before anything in it is touched (another job's staging, say)
                self._claims.claim(save_dir)
            except AsyncCheckpointError as exc:
                refused = exc
        staged = False
        if refused is not None:
            return (save_id, staged), made, refused
        # staged or not: decided by rank 0 alone, before any rank can write
        try:  # never raise before the exchange: the other ranks would wait in it
            try:
                self._retention.recover(save_dir)
                if pointer is not None:
                    remove_stale_temporaries(self._storage, pointer.path)
            except OSError as exc:
                logger.warning("async checkpoint: cleaning up %s failed: %s",
                               save_dir, exc)
            staged = self._saves.busy(ckpt_dir) or _holds_files(ckpt_dir)
            if local is None:  # before the exchange, so before another rank writes into it
                made = self._make_write_dir(ckpt_dir, save_id, staged)
                if made is not None and save_dir in made[1]:
                    try:  # the save directory is new: claimed as soon as it exists
                        self._claims.claim(save_dir)
                    except AsyncCheckpointError as exc:  # another job made it meanwhile
                        refused = exc
        except Exception as exc:  # a Storage of the user's: every rank raises it, below
            if local is None:  # this save refused, not "a previous checkpoint failed"
                refused = AsyncCheckpointError(
                    f"preparing checkpoint {ckpt_dir!r} failed, nothing was written "
                    f"({what_stays(save_dir)}): {type(exc).__name__}: {describe(exc)}")
                refused.__cause__ = exc
            else:  # an earlier save's failure goes first; this one is only logged
                logger.warning("async checkpoint: preparing %s failed: %s", ckpt_dir, exc)
        return (save_id, staged), made, refused

    def _raise_if_refused(self, ckpt_dir: str, local: BaseException | None, more: int,
                          refused: AsyncCheckpointError | None, failed: AgreementError | None) -> None:
        """After ``begin``'s exchange, on every rank: raise this rank's earlier failure
        (``local``, with ``more``), rank 0's refusal, or what other ranks reported (``failed``)."""
        if local is not None:  # taken above: raised first, or it would be lost
            raise reraise(local, more, self._ledger.save_dir_of(local))  # behind a refusal
        if refused is not None:
            raise refused
        if failed is None:
            return
        failures = failed.failures
        if 0 in failures and failures[0].kind == REFUSED:  # rank 0's refusal, in its words
            raise AsyncCheckpointError(f"rank 0: {failures[0].message}") from failed
        elsewhere = {r: f.message for r, f in failures.items() if f.kind == KEY_DIFFERS}
        if elsewhere:  # a rank-specific tag, or a relative save_dir from another directory
            raise AsyncCheckpointError(
                f"the ranks are not saving the same checkpoint (rank {self._rank}: "
                f"{ckpt_dir!r}): rank(s) " + "; ".join(f"{r}: {m}" for r, m in sorted(elsewhere.items()))
                + "; every rank must pass the same save_dir and tag (nothing was written)") from failed
        if failed.only_durability:
            raise DurabilityError("a previous checkpoint's commit did not complete on "
                                  "rank(s) " + by_rank(failures)) from failed
        # this save's directory: the failed save was in it too, as a rule
        raise CommitError("a previous checkpoint failed and was not committed ("
                          f"{what_stays(os.path.dirname(ckpt_dir))}) on rank(s) {by_rank(failures)}") \
            from failed

    def _make_write_dir(self, ckpt_dir: str, save_id: str, staged: bool) -> tuple[str, list[str]] | None:
        """Rank 0, in ``begin`` before the exchange: the directory this save writes into, with
        this engine's marker, so that a crash leaves it partial (listed so, refused by loads,
        removed by retention), not a stranger's; and made before the exchange, because once
        it returns the other ranks create files in it (were rank 0 to rename the directory
        into place under them, their file creation would fail with ENOENT). Returns it and the
        directories made for it that were not there (it, the save directory on a first save),
        deepest first, for :func:`_remove_if_empty`; None if it could not be made (logged: the
        writes into it fail too, and report it to all ranks)."""
        write_dir = _write_dir(ckpt_dir, save_id, staged)
        created = missing_dirs(write_dir)
        try:
            if staged:  # a crash before its marker leaves a staging dir: swept anyway
                self._storage.makedirs(os.path.join(write_dir, META_DIR))
            else:
                make_checkpoint_dir(self._storage, write_dir, save_id)
        except OSError as exc:
            logger.warning("async checkpoint: cannot create %s: %s", write_dir, exc)
            return None
        return write_dir, created

    def end(self, *, commit: bool = True) -> CheckpointHandle:
        """Seal the open checkpoint. In sync mode, return once this rank's files are persisted
        and, on rank 0, the checkpoint is committed; raise this save's failure here (the
        adapters then share the outcome across ranks, so that every rank knows it).

        ``commit=False`` abandons it (the framework's save raised midway): its files still
        drain from the pool, but it is never recorded or committed.
        """
        saves = self._saves
        job = saves.current
        if job is None:
            raise AsyncCheckpointError("end() without begin()")
        handle = job.handle
        if saves.closed:  # closed under it by another thread (it had passed begin's check)
            saves.current = None
            raise AsyncCheckpointError(f"checkpoint {handle.tag!r} was not committed: the checkpointer "
                                       "was closed while it was being saved")
        job.abandoned = not commit
        job.times["end"] = time.perf_counter()
        saves.history.append(handle)
        saves.last = job
        if self._config.is_async:
            try:
                with saves.lock:
                    saves.inflight.append(job)
                saves.current = None  # only now: retention sees its directory as in use throughout
                self._files.seal(job, last=True)
            except BaseException:  # cut short (Ctrl-C, a SIGTERM handler's exit): never committed,
                job.abandoned = True  # and the committer still settles what was handed over
                saves.current = None
                raise
            finally:
                with saves.lock:
                    queued = job in saves.inflight
                if queued:  # in flight: wait() and close() wait until the committer settles it
                    self._committer.put(job)
        else:
            with saves.lock:
                saves.inflight.append(job)
            saves.current = None
            self._committer.commit_one(job)
            if handle.error is not None:  # this save's failure, not "a previous checkpoint's"
                self._ledger.discard(handle.error)  # (unless another thread's wait() took it)
                raise this_save_failed(handle, handle.error)
            self._ledger.raise_first()
        return handle

