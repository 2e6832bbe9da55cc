"""The framework-neutral engine: one save runs snapshot -> persist -> commit.

Call order, on every rank, for one checkpoint::

    handle = ckpt.begin(ckpt_dir, tag=..., pointer=Pointer(...))   # collective (agrees a save id)
    ckpt.save(state, path)                                          # per file this rank writes
    ckpt.end()                                                      # seals; returns at once (async)
    # rank 0's committer thread, once every rank persisted: manifest -> finalize steps ->
    # swap of a re-saved checkpoint -> pointer -> commit callbacks, retention
    ...forward/backward...
    ckpt.fence()                      # before the optimizer step: waits for outstanding copies
    ckpt.wait()                       # optional: every sealed save committed (raises bg errors)

In ``"sync"`` mode the very same stages run inline inside ``save``/``end``; a test asserts both
modes write byte-identical files. Background failures are re-raised at the next ``begin`` or
``wait``; a failed save never moves the pointer, so the previous checkpoint stays loadable.

:class:`AsyncCheckpointer` builds one collaborator per job and delegates to them: the save
session (:mod:`.session`, :mod:`.files`), the committer thread (:mod:`.committer`), commit
reports (:mod:`.reports`), retention (:mod:`.retention`), the failure ledger
(:mod:`.failures`), the waits (:mod:`.waits`), loads (:mod:`.loader`) and the process-wide
lifecycle (:mod:`.lifecycle`). Their shared state is one :class:`~.saves.Saves`.

Integrations add their own writes to a save through seams, not options: ``submit_write``,
``add_begin_callback`` and :meth:`CheckpointHandle.depends_on`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

import torch

from ..agreement import Exchange, exchange_across_ranks, without_key
from ..commit import FinalizeStep, Pointer, RetentionPolicy
from ..commit.retire import step_in_name
from ..config import AsyncCheckpointConfig
from ..errors import AsyncCheckpointError, Failure
from ..persist import check_torch_writer
from ..qos import lower_this_thread
from ..snapshot import HostBufferPool, Stager
from ..storage import LocalStorage, Storage
from ..tiers.durable import DurableTiers, open_remotes
from . import lifecycle
from .collectives import Replicas
from .committer import Committer
from .failures import FailureLedger
from .files import SaveFiles
from .handle import CheckpointHandle, CommitInfo
from .lifecycle import SaveDirClaims
from .loader import Loader
from .memory_saves import MemorySaves
from .reports import Reporter
from .retention import Retention, policy_of
from .saves import Saves
from .session import Session
from .waits import Waits

logger = logging.getLogger(__name__)

#: How long ``close`` waits for the committer to finish once no save is left to wait for.
_COMMITTER_JOIN_S = 60.0


def _cuda_usable() -> bool:
    """Whether this process can use CUDA: a GPU is there, and this is not a child forked after
    its parent initialized CUDA (an evaluation process, a long-lived worker), where any CUDA
    call raises "Cannot re-initialize CUDA in forked subprocess". A checkpointer made there
    stages host tensors without CUDA, as on a machine without a GPU."""
    return torch.cuda.is_available() and not torch.cuda._is_in_bad_fork()


class AsyncCheckpointer:
    """Snapshot, persist and commit checkpoints for one rank.

    ``exchange`` is the transport of every agreement across ranks (:mod:`..agreement`): the
    one collective ``begin`` makes (on the training thread, every rank: rank 0's save id,
    every rank's pending background error, every rank saving into the same directory), and
    those of loads and collective waits. Its signature is
    :func:`~..agreement.exchange_across_ranks`'s (``value, failure, key=""`` to rank 0's
    value and ``{rank: Failure}``). Tests and single-process use may pass their own; one
    taking only ``(value, failure)`` is called without the key.

    ``retention``: which committed checkpoints rank 0 keeps once a commit moved the pointer (a
    :class:`~..commit.RetentionPolicy`: ``KeepAny(KeepLast(1), KeepEvery(1000))``, say); by
    default the config's ``keep_last`` as ``KeepLast(keep_last)``, and none (all kept) for 0.
    ``step_of``: the step a checkpoint's name holds, for the policy (default: the number the
    name ends with).
    """

    def __init__(self, config: AsyncCheckpointConfig, *, rank: int = 0, world_size: int = 1,
                 storage: Storage | None = None,
                 exchange: Callable[..., tuple[Any, dict[int, Failure]]] | None = None,
                 on_commit: Callable[[CommitInfo], None] | None = None,
                 retention: RetentionPolicy | None = None,
                 step_of: Callable[[str], int | None] = step_in_name,
                 ) -> None:
        check_torch_writer()  # before any thread starts: a clear error, not a failed first save
        if not isinstance(config, AsyncCheckpointConfig):  # a dict: AsyncCheckpointConfig.from_dict
            raise TypeError(f"AsyncCheckpointer(config=...): an AsyncCheckpointConfig, got a "
                            f"{type(config).__name__} (AsyncCheckpointConfig.from_dict reads a dict)")
        for name, value, least in (("world_size", world_size, 1), ("rank", rank, 0)):
            if type(value) is not int or value < least:  # bool is an int: not a rank
                raise ValueError(f"AsyncCheckpointer({name}={value!r}): an int >= {least}")
        if rank >= world_size:  # its records would never be waited for, or rank 0's never come
            raise ValueError(f"AsyncCheckpointer(rank={rank}, world_size={world_size}): rank must be "
                             "below world_size")
        policy = policy_of(config.keep_last, retention)  # before any thread starts
        remotes = open_remotes(config.tiers)  # each tier reached once: a bad one fails here
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.storage = storage or LocalStorage(fsync=config.fsync, direct_io=config.direct_io)
        if exchange is not None and "key" not in inspect.signature(exchange).parameters:
            exchange = functools.partial(without_key, exchange)
        self._exchange: Exchange = exchange or exchange_across_ranks
        use_cuda = _cuda_usable()
        self.pool = HostBufferPool(config.host_buffer_bytes, pin=use_cuda,
                                   shared=config.persist_in == "process")
        self._writers = ThreadPoolExecutor(config.writer_threads, thread_name_prefix="async-ckpt-writer",
                                           initializer=lower_this_thread)
        self._memory = MemorySaves(config.memory, rank=rank, world_size=world_size,
                                   commit_timeout_s=config.commit_timeout_s) if config.memory.enabled else None
        saves = self._saves = Saves()
        self.history = saves.history
        """The last 64 sealed checkpoints of this process, oldest first (timings, bytes, errors)."""
        self._failures = FailureLedger()
        self._begin_callbacks: list[Callable[[CheckpointHandle], None]] = []
        self._retention = Retention(saves, self.storage, policy, step_of)
        self._reporter = Reporter(saves, world_size=world_size, released=self._retention.released,
                                  callbacks=[on_commit] if on_commit else [])
        self._files = SaveFiles(saves, self.storage, config, rank=rank, pool=self.pool,
                                stager=Stager(self.pool, use_cuda), writers=self._writers, memory=self._memory)
        self._committer = Committer(saves, self.storage, config, rank=rank, world_size=world_size,
                                    ledger=self._failures, retention=self._retention,
                                    reporter=self._reporter, written=self._files.eager_written,
                                    memory=self._memory)
        self._loader = Loader(rank=rank, world_size=world_size, exchange=self._exchange,
                              verify_on_load=config.verify_on_load)
        self._waits = Waits(saves, self._files, self._failures, self._retention, rank=rank,
                            exchange=self._exchange, check=self._check_not_forked)
        self._claims = SaveDirClaims(saves, self._background_busy)
        self._session = Session(saves, self.storage, config, rank=rank, exchange=self._exchange,
                                ledger=self._failures, claims=self._claims, retention=self._retention,
                                loader=self._loader, begun=self._begun, files=self._files,
                                committer=self._committer, memory=self._memory)
        self.tiers = DurableTiers.attach(self, self._reporter.hold, remotes) if remotes else None
        """The durable tiers checkpoints drain to (config ``tiers``), or None."""
        self._pid = os.getpid()
        self._owner: threading.Thread | None = None
        """The thread that began the last save (the training loop's)."""
        self._forked = False
        """True in a child forked from the process that made this checkpointer (see
        :mod:`.lifecycle`): its threads do not run there."""
        lifecycle.register(self, self._at_exit)

    # ------------------------------------------------------------------ save path

    def begin(self, ckpt_dir: str, *, tag: str, pointer: Pointer | None = None,
              finalize: Iterable[FinalizeStep] = (), rotation: bool = True) -> CheckpointHandle:
        """Start a checkpoint (collective: every rank). If a previous save failed on any rank,
        raises on every rank (the failing one gets its own error) and starts nothing; so does a
        durable tier that is, contains or lies inside ``ckpt_dir``'s directory (ConfigError).

        ``pointer``: the small file rank 0 replaces atomically once the checkpoint is
        committed, naming it (DeepSpeed's ``latest`` holding the tag, Megatron's
        ``latest_checkpointed_iteration.txt`` holding the iteration); retention never removes
        the checkpoint it names. ``finalize``: steps rank 0's committer runs, in order, after
        the manifest and before the swap and the pointer (see :mod:`~..commit.finalize`:
        Megatron's marker files); a step's failure fails the save, which never moves the
        pointer. Only rank 0's steps run.

        If ``ckpt_dir`` already holds files (the checkpoint the pointer names, saved again
        under the same tag, say) or a save of it is still in flight, this save's files go to a
        staging directory beside it (``handle.write_dir``) and the commit swaps it in, after
        the finalize steps (:func:`~.commit.replace_checkpoint`): the old checkpoint stays
        whole and loadable until the new one is committed. ``rotation=False``: a checkpoint
        saved aside (DeepSpeed's ``save_latest=False``: a "best" model, say), which retention
        neither counts nor removes (its manifest says ``"rotation": false``)."""
        self._check_open()
        self._owner = threading.current_thread()
        return self._session.begin(ckpt_dir, tag=tag, pointer=pointer, finalize=finalize,
                                   rotation=rotation)

    def save(self, state: Any, path: str, *, eager_keys: Iterable[str] = (),
             eager_tensors: Iterable[torch.Tensor] = (), replicas: Replicas | None = None) -> int:
        """Add one file to the open checkpoint: ``state`` as ``torch.save`` would write it.

        Python values are frozen before this returns. Tensors are copied lazily, before the
        next :meth:`fence`, except what the loop may change outside the optimizer step, which
        is copied now: tensors reachable under ``state[k]`` for ``k`` in ``eager_keys``, and
        tensors viewing the memory of any of ``eager_tensors`` (a model's buffers: a forward
        updates BatchNorm's running statistics). Returns the tensor bytes this file stages
        (what it costs the host pool).

        ``replicas``: every rank of that group calls ``save`` for this ``path`` at this point
        (collective). If they all planned the same archive (the same pickle and record sizes:
        one all-gather of a digest), each copies and writes one share of its records, of
        about equal bytes (see :class:`~.persist.Share`), and the commit joins the shares into
        the same file the first replica would have written alone. Otherwise, or with
        ``zip_crc32`` (the zip directory's CRCs need every record), the first replica writes
        it alone and the others nothing.
        """
        return self._files.add(path, [state], None, eager_keys, eager_tensors, replicas)[0]

    def save_packed(self, path: str, parts: Iterable[tuple[str, Any]], *,
                    eager_tensors: Iterable[torch.Tensor] = ()) -> list[int]:
        """Add one file holding several ``torch.save`` archives back to back, one per
        ``(name, state)`` of ``parts``, each starting on a page. The committed manifest gives
        each name's offset and length (``files[<path in the checkpoint>]["parts"][name]``), so
        a reader can ``torch.load`` a view of just those bytes (what megatron-core's
        ``.distcp`` files are). Tensors are copied lazily, except those viewing the memory of
        any of ``eager_tensors`` (see :meth:`save`). Returns the tensor bytes each part stages.
        """
        parts = list(parts)
        return self._files.add(path, [state for _, state in parts], [name for name, _ in parts], (),
                               eager_tensors)

    def end(self, *, commit: bool = True) -> CheckpointHandle:
        """Seal the open checkpoint. In sync mode, return once this rank's files are persisted
        and, on rank 0, the checkpoint is committed; raise this save's failure here (the
        adapters then share the outcome across ranks, so that every rank knows it).

        ``commit=False`` abandons it (the framework's save raised midway): its files still
        drain from the pool, but it is never recorded or committed.
        """
        return self._session.end(commit=commit)

    def fence(self, unchanged: Callable[[], Iterable[torch.Tensor]] | None = None) -> None:
        """Call before parameters or optimizer state are modified (the optimizer step, or any
        in-place edit outside it: see :func:`fence_all`). ``unchanged``: what that change
        leaves alone (the optimizer step: frozen parameters), whose copies need not be waited
        for (see :meth:`~..snapshot.Stager.fence`)."""
        self._check_not_forked()
        t0 = time.perf_counter()
        current = self._saves.current
        if current is not None:  # fenced inside a save: its copies must come first
            self._files.seal(current)
        self._files.stager.fence(unchanged)
        last = self._saves.last
        if last is not None:
            last.fence_wait_s += time.perf_counter() - t0

    def reserve(self, nbytes: int) -> threading.Thread | None:
        """Prepare the host pool for saves of about ``nbytes`` on this rank: allocate it and
        fault it in now, in a background thread, instead of during the first save (whose
        stall would include it). Optional; the DeepSpeed plugin calls it after the first
        optimizer step. See :meth:`HostBufferPool.reserve`."""
        self._check_open()
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"reserve(nbytes={nbytes!r}): an int >= 0")
        return self.pool.reserve(nbytes)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every write of :meth:`submit_write` is done, every sealed checkpoint is
        committed and the retention its commit started (``keep_last``) is done; raise a
        background error if any: see :meth:`.waits.Waits.wait`."""
        self._waits.wait(timeout)

    def raise_background_error(self) -> None:
        """Raise (once) the first error a background stage recorded, if any, with how many
        more there were (consumed too)."""
        self._failures.raise_first()

    def wait_all_ranks(self, timeout: float | None = None, *, action: str = "wait_all_ranks()",
                       recover: str | None = None, error: Exception | None = None) -> None:
        """Collective :meth:`wait` (every rank), before a step that must start on all ranks or
        on none (a framework's ``load_checkpoint``): if a save failed, or the wait timed out,
        on any rank, every rank raises, naming ``action`` as refused, and the errors reported
        are cleared. ``recover``: a save directory about to be loaded from, which rank 0 first
        recovers (:meth:`recover`); ``error``: this rank failed already, shared without
        waiting and raised as it is. See :meth:`.waits.Waits.all_ranks`."""
        self._waits.all_ranks(timeout, action=action, recover=recover, error=error)

    # ------------------------------------------------------------------ integrations' seams
    def submit_write(self, path: str, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)``, an integration's write of the file ``path``, on a writer thread
        (any thread may call). Until its outcome is taken, :meth:`wait`, :meth:`close` and the
        exit flush wait for it, and its failure is raised at the next :meth:`begin` or
        :meth:`wait`, unless a save depends on it (:meth:`add_begin_callback`)."""
        self._check_open()
        future = self._writers.submit(fn, *args)
        self._failures.track(path, future)
        return future

    def submitted_writes(self) -> list[tuple[str, Future]]:
        """``(path, future)`` of the writes of :meth:`submit_write` whose outcome no
        :meth:`begin` or :meth:`wait` has taken yet (any thread)."""
        self._check_not_forked()
        return self._failures.tracked()

    def add_begin_callback(self, fn: Callable[[CheckpointHandle], None]) -> None:
        """Call ``fn(handle)`` in every :meth:`begin`, on its thread (every rank), once the save
        is open. ``fn`` must not raise; it may call :meth:`CheckpointHandle.depends_on`: the
        writes of :meth:`submit_write` it names are then the save's (their failure is its)."""
        self._begin_callbacks.append(fn)

    def _begun(self, handle: CheckpointHandle) -> None:
        for fn in list(self._begin_callbacks):
            fn(handle)
        self._failures.claim(handle.dependencies)

    def unreported_errors(self) -> list[BaseException]:
        """The background errors recorded and not raised yet, oldest first."""
        return self._failures.unreported()

    def exchange(self, value: Any, failure: Failure | None, key: str = "") -> tuple[Any, dict[int, Failure]]:
        """The transport of this checkpointer's agreements (every rank, training thread): see
        :func:`~..agreement.exchange_across_ranks`. Adapters agree through
        :func:`~..agreement.agree` and :func:`~..agreement.outcome` with it."""
        return self._exchange(value, failure, key=key)

    def remove_later(self, path: str) -> bool:
        """Rename the directory ``path`` out of sight now and delete it on the retention thread,
        which :meth:`wait` and :meth:`close` wait for: see :meth:`.retention.Retention.remove_later`."""
        return self._retention.remove_later(path)

    # ------------------------------------------------------------------ retention (rank 0)
    def retire_older(self, handle: CheckpointHandle) -> list[str]:
        """Retention now, on this thread (rank 0, once ``handle`` is committed and the pointer
        names it; the committer queues it by itself): see
        :meth:`.retention.Retention.retire_older`. Returns the names of the checkpoints removed."""
        return self._retention.retire_older(handle, self._saves.job_of(handle))

    def recover(self, save_dir: str, *, sweep: bool = True) -> list[str]:
        """Rank 0, before saving into or loading from ``save_dir``: see
        :meth:`.retention.Retention.recover`. Returns the names of the checkpoints it put back."""
        return self._retention.recover(save_dir, sweep=sweep)

    def _later(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """``fn(*args, **kwargs)`` on the retention thread, after what was queued there before
        (see :meth:`.retention.Retention.later`)."""
        return self._retention.later(fn, *args, **kwargs)

    # ------------------------------------------------------------------ load path
    def verify_all_ranks(self, ckpt_dir: str | None, *, action: str = "load",
                         include: Callable[[str], bool] | None = None) -> None:
        """Collective: check a checkpoint of this engine before any rank loads from it, each
        rank hashing a share of its files, and raise on every rank if any file is bad or the
        checkpoint was never committed: see :meth:`.loader.Loader.verify_all_ranks`."""
        self._loader.verify_all_ranks(ckpt_dir, action=action, include=include)

    def load(self, path: str, map_location: Any = None) -> Any:
        """``torch.load`` after checking the file against its checkpoint's committed manifest
        (unless :meth:`verify_all_ranks` checked that checkpoint, as it still is)."""
        if self._saves.inflight:
            self.wait()
        return self._loader.load(path, map_location)

    def collective_load(self, action: str = "load") -> contextlib.AbstractContextManager[None]:
        """Collective (every rank): a framework's load, whose files :meth:`load` reads;
        see :meth:`.loader.Loader.collective_load`."""
        return self._loader.collective_load(action)

    # ------------------------------------------------------------------ commit reports (rank 0)
    def add_commit_callback(self, fn: Callable[[CommitInfo], None]) -> None:
        """Call ``fn(info)`` (a :class:`CommitInfo`) on rank 0 for every checkpoint committed from
        now on, after the pointer moved. Callbacks run in commit order on a thread of their own,
        so a slow one (an upload, say) holds up neither training, nor :meth:`wait`, nor the next
        commit; :meth:`close` waits for them. An exception in one is logged: the checkpoint
        stays committed. The ``on_commit`` argument adds one. Retention (``keep_last``) leaves
        the checkpoint until its callbacks are done; a save of the same tag that commits
        meanwhile swaps the directory under them (a fixed tag such as ``"last"``: read it
        before saving that tag again). They run on rank 0 only: do not close the checkpointer
        from one (rank 0's next save would fail alone while the others wait for it)."""
        self._reporter.callbacks.append(fn)

    def report(self, fn: Callable[..., Any], *args: Any, about: str | None = None) -> None:
        """Run ``fn(*args)`` on the commit callbacks' thread, after those queued before (once
        closed: here, after those). Its exception is logged. ``about``: the checkpoint
        directory it reads, which retention leaves until it has run. Adapters use it for their
        own reports."""
        self._reporter.report(fn, *args, about=about)

    def _background_busy(self) -> bool:
        """Whether a report or a deletion is queued or running (claims stay meanwhile)."""
        with self._saves.lock:
            return bool(self._reporter.queued) or self._retention.running()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Flush: wait for every checkpoint to commit, then stop the background threads. In a
        forked child (whose copy of this checkpointer has no threads): only marks it closed."""
        if self._forked:
            self._saves.closed = True
            return
        if self._saves.closed:  # (by a commit callback, say: its thread could not wait for itself)
            self._reporter.drain()
            return
        try:
            if self._saves.current is not None:  # a save that never finished must not be committed
                self.end(commit=False)
            self.wait()
        finally:
            self._saves.closed = True
            self._committer.stop(timeout=_COMMITTER_JOIN_S)
            self._writers.shutdown(wait=True)
            self._files.close()
            self._retention.shutdown()
            self._files.stager.close()
            if self._memory is not None:  # after the last commit: the keeper ends if it persisted
                last = self.history[-1] if self.history else None
                persisted = last is not None and last.committed and not last.memory_only
                if last is not None and last.committed and last.memory_only and self.rank == 0:
                    logger.warning(
                        "async checkpoint: the last checkpoint, %s, is in the memory tier only: its "
                        "keeper keeps it for a restart for async_checkpoint.memory.idle_timeout_s (%g s), "
                        "and the checkpoint directory's newest is older; save once more (the next save "
                        "of a run persists) or choose persist_every so that the last save persists",
                        last.tag, self.config.memory.idle_timeout_s)
                self._memory.close(persisted=persisted)
            if self._committer.thread.is_alive():  # close interrupted (Ctrl-C), a commit still running:
                logger.warning("async checkpoint: closed while a commit still runs; the save "
                               "directory stays locked until it ends with the process")
            else:  # released under a running commit, another job could sweep its directory
                self._claims.release_all()
            lifecycle.unregister(self, self._at_exit)
            self._reporter.drain()
            if self.tiers is not None:  # every commit callback has queued its drain by now
                self.tiers.close()

    @property
    def memory_only(self) -> bool:
        """True while the open save stays in the memory keeper only (the memory tier): an
        adapter then makes nothing of it on disk (a directory, a file of its own)."""
        current = self._saves.current
        return current is not None and current.memory_only

    @property
    def is_open(self) -> bool:
        """True between begin() and end()."""
        return self._saves.current is not None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` began (or, in a forked child, was called)."""
        return self._saves.closed

    def in_flight(self) -> list[CheckpointHandle]:
        """Its saves sealed and not yet settled by the committer, oldest first."""
        return self._saves.pending()

    def dirs_in_use(self) -> set[str]:
        """The checkpoint directories of its open save and of its saves in flight."""
        return self._saves.dirs_in_use()

    @property
    def staged_bytes(self) -> int:
        """Bytes this rank copied to host so far (what non-writer ranks must keep at 0)."""
        return self._files.stager.staged_bytes

    @property
    def pooled_bytes(self) -> int:
        """Host pool bytes those copies took so far (each record rounded up to whole pages)."""
        return self._files.stager.pooled_bytes

    def join_training_thread(self) -> None:
        """At interpreter exit: wait for the training thread if it is another one and
        may still save (see :func:`.lifecycle.join_training_thread`)."""
        lifecycle.join_training_thread(self._owner, self._saves)

    def _at_exit(self) -> None:
        self.join_training_thread()
        try:
            self.close()
        except BaseException as exc:  # nothing left to raise to at interpreter exit
            print(f"deepspeed_async_ckpt: rank {self.rank}: final checkpoint not committed: {exc}",
                  file=sys.stderr)

    def _check_open(self) -> None:
        self._check_not_forked()
        if self._saves.closed:
            raise AsyncCheckpointError("the checkpointer is closed")

    def forget_in_child(self) -> None:
        """In a child forked from its process (:mod:`.lifecycle` calls it): its threads do
        not run here, so it refuses every use."""
        self._forked = True

    def _check_not_forked(self) -> None:
        if self._forked:
            raise AsyncCheckpointError(f"this checkpointer belongs to process {self._pid}; this is a "
                                       "child forked from it, where its background threads do not "
                                       "run: save from the parent, or make a checkpointer here")
