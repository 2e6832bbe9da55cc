"""The framework-neutral engine: one save runs snapshot -> persist -> commit.

Call order, on every rank, for one checkpoint::

    handle = ckpt.begin(ckpt_dir, tag=..., pointer=Pointer(...))   # collective (agrees a save id)
    ckpt.save(state, path)                                          # per file this rank writes
    ckpt.end()                                                      # seals; returns at once (async)
    ...forward/backward...
    ckpt.fence()                      # before the optimizer step: waits for outstanding copies
    ckpt.wait()                       # optional: every sealed save committed (raises bg errors)

In ``"sync"`` mode the very same stages run inline inside ``save``/``end``; a test asserts both
modes write byte-identical files. Background failures are re-raised at the next ``begin`` or
``wait``; a failed save never moves the pointer, so the previous checkpoint stays loadable.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import inspect
import logging
import math
import os
import queue
import sys
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable

import torch
import xxhash

from .commit import (META_DIR, Pointer, check_checkpoint_dir, check_name, claim_save_dir, commit,
                     find_checkpoint_dir, finish_replacements, forget_claims_in_child,
                     make_checkpoint_dir, read_manifest,
                     release_save_dir, remove_stale_temporaries, remove_trash, replace_checkpoint,
                     retire_checkpoints, staging_dir, verify_checkpoint, verify_file,
                     write_rank_failure, write_rank_record)
from .config import AsyncCheckpointConfig
from .errors import (AsyncCheckpointError, CommitError, DurabilityError, IntegrityError, PersistError,
                     describe)
from .persist import FileRecord, Share, check_torch_writer, split_items, write_file
from .snapshot import (FilePlan, HostBufferPool, Stager, TensorItem, plan_file, storage_addresses,
                       tensor_ids)
from .storage import LocalStorage, Storage, aligned_size, temporary_path

logger = logging.getLogger(__name__)


def _reraise(exc: BaseException, more: int = 0) -> AsyncCheckpointError:
    """A background stage's error ``exc`` raised for the caller, with ``more`` failed saves
    after it reported together."""
    more_text = f" (and {more} more failed save(s))" if more else ""
    if isinstance(exc, DurabilityError):  # in place, not "not committed"
        err: AsyncCheckpointError = DurabilityError(f"a previous checkpoint's commit did not complete: "
                                                    f"{exc}{more_text}", pointer_moved=exc.pointer_moved)
        err.__cause__ = exc
        return err
    cls = exc.__class__ if isinstance(exc, AsyncCheckpointError) else PersistError
    err = cls(f"a previous checkpoint failed and was not committed (the last committed one is "
              f"intact): {exc}" + more_text)
    err.__cause__ = exc
    return err


def _this_save_failed(handle: "CheckpointHandle", exc: BaseException) -> BaseException:
    """A sync save's own failure, raised by its ``end``: as it is where it says what failed
    (a commit error; Ctrl-C), else named as this checkpoint's."""
    if isinstance(exc, (AsyncCheckpointError, KeyboardInterrupt, SystemExit)):
        return exc
    err = PersistError(f"checkpoint {handle.ckpt_dir!r} (tag {handle.tag}) not committed (the last "
                       f"committed one is intact): {type(exc).__name__}: {describe(exc)}")
    err.__cause__ = exc
    return err


@dataclass(frozen=True)
class CommitInfo:
    """What rank 0 knows of a checkpoint once it is committed: what the commit log line says,
    and what an ``on_commit`` callback gets."""

    tag: str
    ckpt_dir: str
    files: int
    bytes: int
    world_size: int
    seconds: float
    """From ``begin`` (once the ranks agreed to save) to the commit (the pointer moved):
    staging, writing and the commit, beside training. ``str()`` gives bytes over it as GB/s,
    which is not the disk's bandwidth."""

    def __str__(self) -> str:
        rate = self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")
        return (f"checkpoint {self.tag} committed: {self.ckpt_dir}, {self.files} file(s), "
                f"{self.bytes / 1e9:.3g} GB from {self.world_size} rank(s), {self.seconds:.2f} s "
                f"after the save began ({rate:.3g} GB/s)")


def _cuda_usable() -> bool:
    """Whether this process can use CUDA: a GPU is there, and this is not a child forked after
    its parent initialized CUDA (an evaluation process, a long-lived worker), where any CUDA
    call raises "Cannot re-initialize CUDA in forked subprocess". A checkpointer made there
    stages host tensors without CUDA, as on a machine without a GPU."""
    return torch.cuda.is_available() and not torch.cuda._is_in_bad_fork()


class CheckpointHandle:
    """One checkpoint of one rank, with named wait points: staged, persisted, committed.

    "Committed" means: on rank 0, the manifest and pointer are durable; on other ranks, this
    rank's files are durable and its record is published (its part of the commit).
    """

    def __init__(self, ckpt_dir: str, tag: str, save_id: str, pointer: Pointer | None,
                 write_dir: str | None = None, swap_at_commit: bool = True,
                 late_files: tuple[str, ...] = (), rotation: bool = True) -> None:
        self.ckpt_dir, self.tag, self.save_id, self.pointer = ckpt_dir, tag, save_id, pointer
        self.rotation = rotation
        """False for a save that moves no pointer: retention neither counts nor removes it."""
        self.write_dir = write_dir or ckpt_dir
        """Where this save's files go: ``ckpt_dir``, or, when that already held files, a
        staging directory beside it that the commit swaps in (see :meth:`AsyncCheckpointer.begin`)."""
        self.swap_at_commit = swap_at_commit
        self.late_files = late_files
        """Files rank 0's caller writes after the commit (see :meth:`AsyncCheckpointer.begin`)."""
        self.new_dirs: list[str] = []
        """Directories this rank made for the save (the save directory on a first save, the
        checkpoint's, its marker, subdirectories of files; on rank 0 also the save directory,
        whoever made it): their entries are made durable before this rank's record, so that
        no crash after the commit takes them back."""
        self.paths: set[str] = set()
        """The files saved so far, by their path in the checkpoint (each may be saved once)."""
        self.items: list[TensorItem] = []
        self.unsubmitted: list[TensorItem] = []
        """Lazy items of an open save, queued for the copier when it is sealed."""
        self.unwritten: list[tuple[str, list[FilePlan], list[str] | None, Share | None]] = []
        """Files of an open save, handed to the writers when it is sealed."""
        self.files: list[Future] = []
        self.beside: list[Future] = []
        """Files written beside it (:meth:`AsyncCheckpointer.write_beside`) into its save
        directory before it began: this rank's part is persisted once they are durable too."""
        self.nbytes = 0
        self.error: BaseException | None = None
        self.abandoned = False
        self.failure: str | None = None
        """Why a sync save's file failed on this rank (rank 0's commit error quotes it)."""
        self.fence_wait_s = 0.0
        """Time the training loop spent blocked at fences waiting for this save's copies."""
        self.eager_wait_s = 0.0
        """Time its ``save`` calls waited for earlier saves' eager copies to be written (their
        backpressure: see ``AsyncCheckpointer._eager_room``)."""
        self.retired: list[str] = []
        """Older checkpoints that retention (``keep_last``) removed after this one committed
        (filled in the background, after the commit: see :meth:`AsyncCheckpointer.wait`)."""
        self.times: dict[str, float] = {"begin": time.perf_counter()}
        self.commit_info: CommitInfo | None = None
        """Rank 0, once committed: what the commit wrote (see :class:`CommitInfo`)."""
        self._persisted = threading.Event()
        self._committed = threading.Event()

    def wait_staged(self) -> None:
        for item in self.items:
            item.wait_copied()
        self.times.setdefault("staged", time.perf_counter())

    def wait_persisted(self, timeout: float | None = None) -> bool:
        return self._persisted.wait(timeout)

    def wait_committed(self, timeout: float | None = None) -> bool:
        return self._committed.wait(timeout)

    @property
    def committed(self) -> bool:
        return self._committed.is_set() and self.error is None and not self.abandoned


_EXCHANGE_VALUE_BYTES = 64
_STAGED = "+staged"  # appended by rank 0 to the save id it sends when the save is staged


def _runs_a_task(thread: threading.Thread) -> bool:
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


def _holds_files(path: str) -> bool:
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is not None
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:  # cannot tell: stage, so that nothing there is overwritten
        return True


def _write_dir(ckpt_dir: str, save_id: str) -> tuple[str, str]:
    """The save id without its staged mark, and the directory the save writes into: its
    staging directory if rank 0 marked it staged (``ckpt_dir`` holds a checkpoint), else
    ``ckpt_dir``."""
    save_id, staged, _ = save_id.partition(_STAGED)
    return save_id, staging_dir(ckpt_dir, save_id) if staged else ckpt_dir


def _missing_dirs(path: str) -> list[str]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while path != os.path.dirname(path) and not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove_if_empty(made: tuple[str, list[str]]) -> None:
    """Undo ``_make_write_dir`` for a save ``begin`` then refused: the empty marker, and the
    directories it created (deepest first), as long as nothing else is in them. A directory
    that was there before (empty, made by hand) stays."""
    write_dir, created = made
    try:
        os.rmdir(os.path.join(write_dir, META_DIR))
        for path in created:
            os.rmdir(path)
    except OSError:
        pass


def by_rank(errors: dict[int, str]) -> str:
    """``"1: msg; 3: msg"``: the per-rank errors an exchange returned, in rank order."""
    return "; ".join(f"{r}: {m}" for r, m in sorted(errors.items()))


def only_durability(errors: dict[int, str]) -> bool:
    """Whether every per-rank error an exchange returned is a :class:`DurabilityError` (the
    checkpoint is in place, a later step failed): then that is what every rank raises."""
    return all(m.startswith(f"{DurabilityError.__name__}:") for m in errors.values())


def _collective_device(group: Any = None) -> torch.device:
    """Where a collective's tensors go: the current CUDA device under NCCL, else the CPU."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def _without_key(exchange: Callable[[str, str | None], tuple[str, dict[int, str]]], value: str,
                 error: str | None, key: str = "") -> tuple[str, dict[int, str]]:
    return exchange(value, error)


#: How an exchange's error for a rank whose ``key`` differs from rank 0's begins.
_ELSEWHERE = "works in "
#: How long ``close`` waits for the committer to finish once no save is left to wait for.
_COMMITTER_JOIN_S = 60.0
_REFUSED = "refused: "  # rank 0's message in begin's exchange: the save directory is another job's


def exchange_across_ranks(value: str, error: str | None, key: str = "") -> tuple[str, dict[int, str]]:
    """Collective: rank 0's ``value``, and every rank's error message (rank -> message) so that
    a failure on one rank is raised on all of them instead of leaving the others waiting in the
    next collective. A no-op without an initialized process group. ``key``: what every rank
    must agree on (``begin``'s checkpoint directory); a rank whose key differs from rank 0's
    gets an error naming both (it would persist elsewhere, and rank 0 wait for its record
    until ``commit_timeout_s`` and then blame it for not finishing).

    One all-reduce of a fixed-size tensor (how many ranks failed, rank 0's value in up to
    64 bytes, the sum of a 20-bit hash of ``key`` and of its square, which are n * h and
    n * h^2 only if every rank's hash is h) on the training thread of every save: O(log
    ranks) and no pickling, where an ``all_gather_object`` moves every rank's object to every
    rank (two collectives). Only when a rank failed, the keys differ (or rank 0's value is
    longer) do the messages follow, gathered as objects."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value, ({0: error} if error else {})
    device = _collective_device()
    # [ranks that failed, length of rank 0's value (-1: too long), sum of key hashes, sum of
    # their squares, rank 0's value's bytes...]: a sum over ranks in which only rank 0
    # contributes the value
    msg = torch.zeros(4 + _EXCHANGE_VALUE_BYTES, dtype=torch.int64)
    msg[0] = error is not None
    h = xxhash.xxh3_64_intdigest(key.encode()) & 0xFFFFF
    msg[2], msg[3] = h, h * h
    if dist.get_rank() == 0:
        encoded = value.encode()
        if len(encoded) <= _EXCHANGE_VALUE_BYTES:
            msg[1] = len(encoded)
            msg[4:4 + len(encoded)] = torch.tensor(list(encoded), dtype=torch.int64)
        else:
            msg[1] = -1
    msg = msg.to(device)
    dist.all_reduce(msg)
    failed, length, hashes, squares, *data = msg.tolist()
    if not failed and length >= 0 and hashes * hashes == dist.get_world_size() * squares:
        return bytes(data[:length]).decode(), {}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (value, error, key))
    errors = {r: e for r, (_, e, _) in enumerate(gathered) if e}
    first = gathered[0][2]
    for r, (_, _, other) in enumerate(gathered):
        if other != first and r not in errors:
            errors[r] = f"{_ELSEWHERE}{other!r}, rank 0 in {first!r}"
    return gathered[0][0], errors


@dataclass(frozen=True)
class Replicas:
    """Ranks that all save the same file from the same state (DeepSpeed's model states, on
    every data-parallel replica) and can write it together: ``rank`` is this rank's index
    among them, ``size`` their number, ``group`` their ``torch.distributed`` process group
    (None: the default group). See :meth:`AsyncCheckpointer.save`."""

    rank: int
    size: int
    group: Any = None

    def gather(self, digest: bytes) -> list[bytes]:
        """Collective over the group: every replica's ``digest`` (all of one length), in
        replica order. One all-gather of a few bytes per replica, on the training thread."""
        import torch.distributed as dist

        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(_collective_device(self.group))
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        return [bytes(t.cpu().tolist()) for t in every]


def layout_digest(plan: FilePlan) -> bytes:
    """What replicas must agree on to write a file in shares (xxh128): what its archive is
    laid out from (the pickle, the record sizes) and the values of its eager records. Those
    hold what the loop changes outside the optimizer step, which data-parallel replicas need
    not agree on (BatchNorm's running statistics follow each replica's own batches); the
    other records are weights and optimizer state, the same on every replica."""
    h = xxhash.xxh3_128(plan.pickle_bytes)
    h.update(b"".join(i.nbytes.to_bytes(8, "little") for i in plan.items))
    for item in plan.items:
        if item.eager and item.nbytes:
            src = item.src.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
            h.update(src.view(torch.uint8).cpu().numpy())
    return h.digest()


_exit_flushes: list[weakref.WeakMethod] = []
_exit_lock = threading.Lock()
_exit_hook_installed = False


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


def _forget_in_child() -> None:
    """In a forked child (a DataLoader worker, say): the parent's checkpointers have no
    threads here, so nothing they hold will ever commit. The child must not flush them at its
    exit (it would wait for ever for the parent's save in flight) and must not use them."""
    global _exit_lock
    _exit_lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _exit_flushes.clear()
    for ck in list(_open_checkpointers):
        ck._forked = True
        _open_checkpointers.discard(ck)  # fence_all() in the child skips them
    forget_claims_in_child()  # the parent's save-directory locks are the parent's


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _run_exit_flushes() -> None:
    while True:
        with _exit_lock:
            if not _exit_flushes:
                return
            method = _exit_flushes.pop()()
        if method is not None:
            method()


_open_checkpointers: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()


def fence_all() -> None:
    """:meth:`AsyncCheckpointer.fence` on every open checkpointer of this process: call it
    before changing model weights in place outside the optimizer step (an EMA copy swapped in
    for an evaluation, LoRA weights fused for generation, a manual edit). A save copies the
    weights lazily, and only the optimizer step waits for those copies; without a fence such
    an edit can reach the file. Returns at once when no save has copies outstanding."""
    for checkpointer in list(_open_checkpointers):
        if not checkpointer._closed:
            checkpointer.fence()


def saves_in_flight() -> list[CheckpointHandle]:
    """The saves of this process's open checkpointers that are sealed (``end``) and not yet
    committed or failed (or, on rank 0, not yet swapped in)."""
    return [h for c in list(_open_checkpointers) if not c._closed for h in c._pending()]


def open_checkpointers() -> list[AsyncCheckpointer]:
    """This process's checkpointers that are not closed."""
    return [c for c in list(_open_checkpointers) if not c._closed]


def wait_beside(directory: str | None = None) -> None:
    """:meth:`AsyncCheckpointer.wait_beside` on every open checkpointer of this process."""
    for checkpointer in list(_open_checkpointers):
        if not checkpointer._closed:
            checkpointer.wait_beside(directory)


def saving_dirs() -> set[str]:
    """Real paths of the checkpoint directories that this process's open checkpointers have
    begun and not yet committed or failed (or, on rank 0, not yet swapped in), and of the files
    they are still writing beside them (:meth:`AsyncCheckpointer.write_beside`): directories
    that must be neither deleted nor resumed from yet (see :mod:`.hf_trainer`)."""
    dirs: set[str] = set()
    for checkpointer in list(_open_checkpointers):
        if checkpointer._closed:
            continue
        current = checkpointer._current  # before _pending(), as in retire_older's protected()
        dirs.update(h.ckpt_dir for h in checkpointer._pending())
        dirs.update(e.directory for e in checkpointer._beside_in() if not e.future.done())
        if current is not None:
            dirs.add(current.ckpt_dir)
    return {os.path.realpath(d) for d in dirs}


class _Beside:
    """A file written beside the checkpoints (:meth:`AsyncCheckpointer.write_beside`), until its
    write is done and its outcome taken: by the save beside it, or as a background error."""

    __slots__ = ("path", "future", "by_save")

    def __init__(self, path: str, future: Future) -> None:
        self.path, self.future = path, future
        self.by_save = False  # its failure is the failure of the save beside it

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path)


class AsyncCheckpointer:
    """Snapshot, persist and commit checkpoints for one rank.

    ``exchange`` is the one collective ``begin`` makes (on the training thread, every rank):
    agree on rank 0's save id, share every rank's pending background error and check that
    every rank saves into the same directory, see :func:`exchange_across_ranks`, whose
    signature it has (``value, error, key=""``). Tests and single-process use may pass their
    own; one taking only ``(value, error)``, as before the key, is still called that way.
    """

    def __init__(self, config: AsyncCheckpointConfig, *, rank: int = 0, world_size: int = 1,
                 storage: Storage | None = None,
                 exchange: Callable[..., tuple[str, dict[int, str]]] | None = None,
                 on_commit: Callable[[CommitInfo], None] | None = None,
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
        self.config = config
        self._commit_callbacks: list[Callable[[CommitInfo], None]] = [on_commit] if on_commit else []
        self._reporter: ThreadPoolExecutor | None = None  # commit callbacks, started on first use
        self._reporter_thread: threading.Thread | None = None
        self._reporting: collections.Counter[str] = collections.Counter()
        """Checkpoint directories whose commit callbacks are queued or running: retention
        leaves them (a callback may be uploading the checkpoint), and runs again when the last
        of them is done."""
        self._reports = 0  # reports (commit callbacks included) queued or running
        self._last_retention: tuple[CheckpointHandle, int | None, Callable[[str], bool] | None] | None = None
        self.rank, self.world_size = rank, world_size
        self.storage = storage or LocalStorage(fsync=config.fsync, direct_io=config.direct_io)
        if exchange is not None and "key" not in inspect.signature(exchange).parameters:
            exchange = functools.partial(_without_key, exchange)  # the signature before the key
        self._exchange = exchange or exchange_across_ranks
        use_cuda = _cuda_usable()
        self.pool = HostBufferPool(config.host_buffer_bytes, pin=use_cuda)
        self._stager = Stager(self.pool, use_cuda)
        self._writers = ThreadPoolExecutor(config.writer_threads, thread_name_prefix="async-ckpt-writer")
        self._commits: queue.SimpleQueue[CheckpointHandle | None] = queue.SimpleQueue()
        self._committer = threading.Thread(target=self._commit_loop, name="async-ckpt-committer", daemon=True)
        self._committer.start()
        self._current: CheckpointHandle | None = None
        self._beginning: str | None = None  # directory of a begin() still agreeing its save id
        self._dirs_lock = threading.Lock()  # retention vs. saves announcing their directories
        self._pointed: dict[str, str] = {}
        """Under ``_dirs_lock``: save directory -> the checkpoint its pointer names, as this
        checkpointer last moved it (:meth:`pointer_moved`); retention never removes it."""
        # checkpoint dir -> (save id, include, the paths its manifest lists) of the last
        # verify_all_ranks that passed
        self._verified: dict[str, tuple[str, Callable[[str], bool] | None, frozenset[str]]] = {}
        self._warned_replicas_differ = False
        self._warned_pool_too_small = False
        self._retirer: ThreadPoolExecutor | None = None  # retention, started on first use
        self._retiring: collections.deque[Future] = collections.deque()
        self._inflight: collections.deque[CheckpointHandle] = collections.deque()
        self._unswapped: set[CheckpointHandle] = set()
        """Rank 0: staged saves begun with ``swap_at_commit=False``, not yet through
        :meth:`swap_in`. Committed or not, their staging directory is not abandoned and
        their target not to be retired (:meth:`_pending`)."""
        self._beside: list[_Beside] = []  # files beside the checkpoints, until taken
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._eager_held: dict[CheckpointHandle, int] = {}
        """Bytes of each save's eager copies (outside the pool) until its files are written."""
        self._eager_cond = threading.Condition()
        self._seal_lock = threading.Lock()
        """Held while an open save's files and lazy copies are listed (``save``) or handed to the
        writers and the copier (``end``, or a fence): a fence on another thread (an eval
        thread's :func:`fence_all`) may seal them while the training thread is still saving."""
        self._closed = False
        self._pid = os.getpid()
        self._claimed: dict[str, str | None] = {}
        """Rank 0: the save directories this checkpointer claimed (see
        :func:`~.commit.claim_save_dir`), each with the key to release at close."""
        self._owner: threading.Thread | None = None
        """The thread that began the last save (the training loop's)."""
        self._forked = False
        """True in a child forked from the process that made this checkpointer (see
        :func:`_forget_in_child`): its threads do not run there."""
        self._replaced_seen: list[str] | None = None
        """Inside :meth:`collective_load`: what :meth:`load` found replaced, for its end."""
        self.history: collections.deque[CheckpointHandle] = collections.deque(maxlen=64)
        """The last 64 sealed checkpoints of this process, oldest first (timings, bytes, errors)."""
        flush_at_exit(self._at_exit)
        _open_checkpointers.add(self)

    # ------------------------------------------------------------------ save path
    def begin(self, ckpt_dir: str, *, tag: str, pointer: Pointer | None = None,
              swap_at_commit: bool = True, late_files: Iterable[str] = (),
              own_pointer: str | None = None, rotation: bool = True) -> CheckpointHandle:
        """Start a checkpoint (collective: every rank). If a previous save failed on any rank,
        raises on every rank (the failing one gets its own error) and starts nothing.

        If ``ckpt_dir`` already holds files (the checkpoint the pointer names, saved again
        under the same tag, say) or a save of it is still in flight, this save's files go to a
        staging directory beside it (``handle.write_dir``) and the commit swaps it in
        (:func:`~.commit.replace_checkpoint`): the old checkpoint stays whole and loadable
        until the new one is committed. ``swap_at_commit=False``: rank 0 calls
        :meth:`swap_in` itself once the commit is done (the Megatron adapter, whose marker
        files come after the commit). ``late_files``: files (paths in the checkpoint) that
        rank 0's caller writes after the commit and records with
        :func:`~.commit.record_late_files`; until then the checkpoint does not verify.
        ``own_pointer``: the path of a pointer the caller writes itself, after the commit
        (Megatron's tracker), instead of ``pointer``: rank 0 removes the temporaries of it
        that a killed process left, as it does ``pointer``'s. ``rotation=False``: a checkpoint
        saved aside (DeepSpeed's ``save_latest=False``: a "best" model, say), which retention
        neither counts nor removes (its manifest says ``"rotation": false``)."""
        self._check_open()
        self._owner = threading.current_thread()
        if self._current is not None:
            raise AsyncCheckpointError(f"begin({tag!r}) while checkpoint {self._current.tag!r} is "
                                       "still open: call end() first")
        ckpt_dir = check_checkpoint_dir(ckpt_dir)
        if pointer is not None:  # written later, by the committer: not wherever the cwd is then
            # what it names must be a checkpoint beside it (retention keeps that one alone)
            check_name(pointer.text, f"Pointer({pointer.path!r}, text)")
            pointer = Pointer(os.path.abspath(pointer.path), pointer.text)
        self._verified.pop(ckpt_dir, None)  # being saved again: its files will change
        with self._dirs_lock:  # before the exchange, so before any rank writes into it
            self._beginning = ckpt_dir  # retention leaves it alone (see retire_older)
        made: tuple[str, list[str]] | None = None
        save_dir = os.path.dirname(ckpt_dir)
        try:
            local, more = self._take_background_errors()
            save_id = uuid.uuid4().hex[:16]
            refused: AsyncCheckpointError | None = None
            if self.rank == 0 and os.path.isdir(save_dir):
                try:  # before anything in it is touched (another job's staging, say)
                    self._claim(save_dir)
                except AsyncCheckpointError as exc:
                    refused = exc
            if self.rank == 0 and refused is None:  # decided by rank 0 alone, before any rank can write: staged?
                try:  # never raise before the exchange: the other ranks would wait in it
                    try:
                        self.recover(save_dir)
                        for path in (pointer.path if pointer is not None else None, own_pointer):
                            if path is not None:
                                remove_stale_temporaries(self.storage, path)
                    except OSError as exc:
                        logger.warning("async checkpoint: cleaning up %s failed: %s",
                                       save_dir, exc)
                    if self._busy(ckpt_dir) or _holds_files(ckpt_dir):
                        save_id += _STAGED
                    if local is None:  # before the exchange, so before another rank writes into it
                        made = self._make_write_dir(ckpt_dir, save_id)
                        if made is not None and save_dir in made[1]:
                            try:  # the save directory is new: claimed as soon as it exists
                                self._claim(save_dir)
                            except AsyncCheckpointError as exc:  # another job made it meanwhile
                                refused = exc
                except Exception as exc:  # a Storage of the user's: every rank raises it, below
                    if local is None:  # this save refused, not "a previous checkpoint failed"
                        refused = AsyncCheckpointError(
                            f"preparing checkpoint {ckpt_dir!r} failed, nothing was written (the "
                            f"last committed one is intact): {type(exc).__name__}: {describe(exc)}")
                        refused.__cause__ = exc
                    else:  # an earlier save's failure goes first; this one is only logged
                        logger.warning("async checkpoint: preparing %s failed: %s", ckpt_dir, exc)
            message = f"{_REFUSED}{refused}" if refused is not None else \
                None if local is None else f"{type(local).__name__}: {local}"
            save_id, failed = self._exchange(save_id, message, key=ckpt_dir)
            try:
                if local is not None:  # taken above: raised first, or it was lost behind a
                    raise _reraise(local, more)  # refusal (a review, session 30)
                if refused is not None:
                    raise refused
                if failed.get(0, "").startswith(_REFUSED):  # rank 0's refusal, in its words
                    raise AsyncCheckpointError(f"rank 0: {failed[0][len(_REFUSED):]}")
                elsewhere = {r: m for r, m in failed.items() if m.startswith(_ELSEWHERE)}
                if elsewhere:  # a rank-specific tag, or a relative save_dir from another directory
                    raise AsyncCheckpointError(
                        f"the ranks are not saving the same checkpoint (rank {self.rank}: "
                        f"{ckpt_dir!r}): rank(s) {by_rank(elsewhere)}; every rank must pass the "
                        "same save_dir and tag (nothing was written)")
                if failed:
                    if only_durability(failed):
                        raise DurabilityError("a previous checkpoint's commit did not complete on "
                                              "rank(s) " + by_rank(failed))
                    raise CommitError("a previous checkpoint failed and was not committed (the last "
                                      "committed one is intact) on rank(s) " + by_rank(failed))
            except BaseException:
                if made is not None:  # refused: nothing of it is left
                    if save_dir in made[1]:  # its lock too, if claimed here
                        self._unclaim(save_dir)
                    _remove_if_empty(made)
                raise
            save_id, write_dir = _write_dir(ckpt_dir, save_id)
            staged = write_dir != ckpt_dir
            self._current = CheckpointHandle(ckpt_dir, str(tag), save_id, pointer, write_dir,
                                             swap_at_commit, tuple(late_files),
                                             rotation=rotation)
            self._current.beside = self._claim_beside(save_dir)
            if self.rank == 0:  # and the marker's entry (made under another name, renamed), and
                # the save directory's, which Trainer makes for each checkpoint-N: the pointer in it
                self._current.new_dirs += [*(made[1] if made else ()), os.path.join(write_dir, META_DIR),
                                           save_dir]
            if not swap_at_commit and self.rank == 0:  # in use until swap_in / abandon_swap
                with self._lock:
                    self._unswapped.add(self._current)
        finally:
            with self._dirs_lock:
                self._beginning = None
        return self._current

    def _make_write_dir(self, ckpt_dir: str, save_id: str) -> tuple[str, list[str]] | None:
        """Rank 0, in ``begin`` before the exchange: the directory this save writes into, with
        this engine's marker, so that a crash leaves it partial (listed so, refused by loads,
        removed by retention), not a stranger's; and made before the exchange, because once
        it returns the other ranks create files in it (rank 0 renaming the directory into
        place under them made their file creation fail with ENOENT). Returns it and the
        directories made for it that were not there (it, the save directory on a first save),
        deepest first, for :func:`_remove_if_empty`; None if it could not be made (logged: the
        writes into it fail too, and report it to all ranks)."""
        save_id, write_dir = _write_dir(ckpt_dir, save_id)
        staged = write_dir != ckpt_dir
        created = _missing_dirs(write_dir)
        try:
            if staged:  # a crash before its marker leaves a staging dir: swept anyway
                self.storage.makedirs(os.path.join(write_dir, META_DIR))
            else:
                make_checkpoint_dir(self.storage, write_dir, save_id)
        except OSError as exc:
            logger.warning("async checkpoint: cannot create %s: %s", write_dir, exc)
            return None
        return write_dir, created

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
        return self._add_file(path, [state], None, eager_keys, eager_tensors, replicas)[0]

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
        return self._add_file(path, [state for _, state in parts], [name for name, _ in parts], (),
                              eager_tensors)

    def _add_file(self, path: str, states: list[Any], names: list[str] | None,
                  eager_keys: Iterable[str], eager_tensors: Iterable[torch.Tensor] = (),
                  replicas: Replicas | None = None) -> list[int]:
        handle = self._current
        if handle is None:
            raise AsyncCheckpointError(f"save({path!r}) outside begin()/end()")
        path = os.path.abspath(path)
        rel = os.path.relpath(path, handle.ckpt_dir)
        if rel in (os.curdir, os.pardir) or rel.startswith(os.pardir + os.sep):
            # the manifest lists files by their path in the checkpoint: one outside it would
            # make a manifest that every reader refuses as damaged, once `latest` names it
            raise ValueError(f"save({path!r}): not a file inside the checkpoint directory "
                             f"{handle.ckpt_dir!r} (tag {handle.tag!r})")
        if rel in handle.paths:  # async: two writers on one temporary name, and no commit
            raise ValueError(f"save({path!r}): this file was already saved in checkpoint "
                             f"{handle.tag!r}: save each file of a checkpoint once")
        handle.paths.add(rel)
        if handle.write_dir != handle.ckpt_dir:  # staged: the same name in the staging directory
            path = os.path.join(handle.write_dir, rel)
        plans, shared = [], False
        try:  # up to its directory: a failure leaves the save as it was (a retry may come)
            eager_storages = storage_addresses(eager_tensors)
            for state in states:
                lazy = tensor_ids(state, except_storages=eager_storages)
                if isinstance(state, dict):
                    for k in eager_keys:
                        if k in state:
                            lazy -= tensor_ids(state[k])
                plans.append(plan_file(state, lazy, what=path))
            share = None
            if replicas is not None and replicas.size > 1:
                shared = True  # the replicas met: a retry on this rank alone would wait for them
                share = self._share_of(path, plans[0], replicas, handle.save_id)
                if (share is None and replicas.rank != 0) or (share is not None and share.index < 0):
                    for item in plans[0].items:  # the other replicas write it
                        item.cancel()
                    return [0]
            new_dirs = _missing_dirs(os.path.dirname(path))
            self.storage.makedirs(os.path.dirname(path))
        except BaseException:
            # until session 30 a failed makedirs left the file's items listed and never issued
            # (handle.wait_staged() never returned), and its path "already saved"
            if not shared:
                handle.paths.discard(rel)
            for plan in plans:
                for item in plan.items:
                    item.cancel()
            raise
        handle.new_dirs += new_dirs
        staged = []  # this rank's items of each plan: all, or its share's
        for plan in plans:
            mine = plan.items if share is None else \
                [plan.items[j] for j in share.items(len(plan.items))]
            if share is not None:
                for item in set(plan.items).difference(mine):
                    item.cancel()  # another rank's: never staged here
            handle.items.extend(mine)
            handle.nbytes += sum(i.nbytes for i in mine)
            staged.append(mine)
        checksum, zip_crc32 = self.config.checksum, self.config.zip_crc32
        if not self.config.is_async:
            largest = max((i.nbytes for mine in staged for i in mine), default=0)
            stage = functools.partial(self._stager.stage, ready=self._stager.ready_event(),
                                      expected_bytes=largest)  # with CUDA: after queued kernels
            try:
                record = write_file(self.storage, path, plans, checksum, part_names=names,
                                    zip_crc32=zip_crc32, share=share, stage=stage)
            except BaseException as exc:  # for rank 0's error, once the caller abandons the save
                handle.failure = f"{type(exc).__name__}: {exc}"
                raise
            done: Future = Future()
            done.set_result(record)
            handle.files.append(done)
        else:
            self._eager_room(handle, sum(i.nbytes for mine in staged for i in mine if i.eager))
            try:
                for mine in staged:
                    self._stager.stage_eager(i for i in mine if i.eager)
            except BaseException:  # the file is not written: none of its items may be queued
                for mine in staged:  # (a queued one would hold its pool buffer for good)
                    for i in mine:
                        i.cancel()
                raise
            with self._seal_lock:  # the file and its copies together, or neither
                for mine in staged:
                    handle.unsubmitted.extend(i for i in mine if not i.eager)
                handle.unwritten.append((path, plans, names, share))
        return [sum(i.nbytes for i in mine) for mine in staged]

    def _eager_room(self, handle: CheckpointHandle, nbytes: int) -> None:
        """Count ``nbytes`` of eager copies for ``handle``, first waiting (backpressure, as the
        pool's) while the earlier saves' eager copies not yet written would take the total
        over ``host_buffer_gb``. Only those are waited for: they are written without this
        thread, where this save's own are written once it is sealed, so one save's eager
        copies may exceed the bound alone. Without it, saves of eager state (``client_state``,
        module buffers) against a slow disk piled up host copies without limit."""
        if not nbytes:
            return
        start = None
        with self._eager_cond:
            while True:
                with self._lock:
                    earlier = sum(n for h, n in self._eager_held.items() if h in self._inflight)
                if not earlier or earlier + self._eager_held.get(handle, 0) + nbytes <= self.pool.capacity_bytes:
                    break
                start = start or time.perf_counter()
                self._eager_cond.wait(0.5)  # notified as saves are written; polled in case
            self._eager_held[handle] = self._eager_held.get(handle, 0) + nbytes
        if start is not None:
            handle.eager_wait_s += time.perf_counter() - start

    def _eager_written(self, handle: CheckpointHandle) -> None:
        with self._eager_cond:
            if self._eager_held.pop(handle, None) is not None:
                self._eager_cond.notify_all()

    def _share_of(self, path: str, plan: FilePlan, replicas: Replicas, save_id: str) -> Share | None:
        """This rank's share of a file its replicas all save (index -1: the others' shares
        cover it all), or None where they do not split it, and the first replica writes it
        whole: with zip CRCs, or when the replicas planned different archives (found by one
        collective over them)."""
        if self.config.zip_crc32:
            return None
        name = xxhash.xxh3_64_digest(os.path.basename(path).encode())
        every = replicas.gather(name + layout_digest(plan))
        if any(d[:8] != name for d in every):
            raise AsyncCheckpointError(
                f"save({path!r}, replicas=...): the replicas are saving different files (replica "
                f"{replicas.rank} this one, replicas {[r for r, d in enumerate(every) if d[:8] != name]} "
                "another): every replica must save the same file at the same point")
        if any(d != every[0] for d in every):
            if replicas.rank == 0 and not self._warned_replicas_differ:
                self._warned_replicas_differ = True
                logger.warning("async checkpoint: %s differs between its data-parallel "
                               "replicas (buffers such as BatchNorm's statistics, or "
                               "rank-specific client state): the first replica writes it "
                               "alone, as DeepSpeed's own engine does (logged once)", path)
            return None
        # balanced as the file and the pool hold records: each on whole pages
        cuts = split_items([aligned_size(i.nbytes) for i in plan.items], replicas.size)
        if not cuts:
            return None
        return Share(index=replicas.rank if replicas.rank <= len(cuts) else -1, cuts=cuts,
                     tmp=temporary_path(path, save_id))

    def end(self, *, commit: bool = True) -> CheckpointHandle:
        """Seal the open checkpoint. In sync mode, return once this rank's files are persisted
        and, on rank 0, the checkpoint is committed; raise this save's failure here (the
        adapters then share the outcome across ranks, so that every rank knows it).

        ``commit=False`` abandons it (the framework's save raised midway): its files still
        drain from the pool, but it is never recorded or committed.
        """
        handle = self._current
        if handle is None:
            raise AsyncCheckpointError("end() without begin()")
        if self._closed:  # closed under it by another thread (it had passed begin's check)
            self._current = None
            raise AsyncCheckpointError(f"checkpoint {handle.tag!r} was not committed: the checkpointer "
                                       "was closed while it was being saved")
        handle.abandoned = not commit
        handle.times["end"] = time.perf_counter()
        self.history.append(handle)
        if self.config.is_async:
            try:
                with self._lock:
                    self._inflight.append(handle)
                self._current = None  # only now: retention sees its directory as in use throughout
                self._start_background(handle)
            except BaseException:  # cut short (Ctrl-C, a SIGTERM handler's exit): never committed,
                handle.abandoned = True  # and the committer still settles what was handed over
                self._current = None
                raise
            finally:
                with self._lock:
                    queued = handle in self._inflight
                if queued:  # in flight: wait() and close() wait until the committer settles it
                    self._commits.put(handle)
        else:
            with self._lock:
                self._inflight.append(handle)
            self._current = None
            self._commit_one(handle)
            if handle.error is not None:  # this save's failure, not "a previous checkpoint's"
                with self._lock:  # (unless another thread's wait() took it meanwhile)
                    if handle.error in self._errors:
                        self._errors.remove(handle.error)
                raise _this_save_failed(handle, handle.error)
            self.raise_background_error()
        return handle

    # ------------------------------------------------------------------ files beside
    def write_beside(self, path: str, write: Callable[[BinaryIO], Any]) -> Future:
        """Write ``path``, a file of no checkpoint of this engine that sits in a save directory
        (Hugging Face Trainer's ``model.safetensors`` in ``checkpoint-N``, see
        :mod:`.hf_trainer`), on a writer thread: ``write(f)`` writes it whole into ``f``, a
        temporary file opened as this engine opens its own (``Storage.open_write``: direct I/O
        where it can), which is then made durable (with ``fsync``) and renamed to ``path``, so
        ``path`` is whole or absent. ``write`` must own what it writes: no fence covers it.

        Until it is durable, its directory counts as being saved into (:func:`saving_dirs`),
        and a save into that directory (``begin(<that directory>/<tag>)``) is not persisted on
        this rank before it is: its failure is then that save's (raised at the next ``begin``
        or ``wait``, on every rank at a ``begin``); otherwise it is raised there itself.
        :meth:`close` (and so the exit flush) waits for it."""
        self._check_open()
        path = os.path.abspath(path)
        entry = _Beside(path, self._writers.submit(self._write_beside, path, write))
        with self._lock:
            self._beside.append(entry)
        return entry.future

    def _write_beside(self, path: str, write: Callable[[BinaryIO], Any]) -> None:
        tmp = temporary_path(path, uuid.uuid4().hex[:12])
        try:
            with self.storage.open_write(tmp) as f:
                write(f)
                self.storage.sync_file(f)
            self.storage.replace(tmp, path, durable=self.config.fsync)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise PersistError(f"{path}: writing it in the background failed: "
                               f"{type(exc).__name__}: {describe(exc)}") from exc

    def _beside_in(self, directory: str | None = None) -> list[_Beside]:
        """The files beside not yet taken, in ``directory`` (a real path; None: all)."""
        with self._lock:
            entries = list(self._beside)
        return [e for e in entries
                if directory is None or os.path.realpath(e.directory) == directory]

    def _claim_beside(self, save_dir: str) -> list[Future]:
        """``begin``: the files beside in its save directory, whose outcome is now the save's."""
        entries = self._beside_in(os.path.realpath(save_dir))
        with self._lock:
            for entry in entries:
                entry.by_save = True
        return [e.future for e in entries]

    def unreported_failures(self, where: Callable[[str, bool], bool], *, exports_only: bool = False
                            ) -> list[tuple[str, BaseException]]:
        """``(path, error)`` of the failures recorded and not yet reported (raised at a
        ``begin``, ``wait`` or ``close``) of the last save into each checkpoint directory that
        ``where(ckpt_dir, False)`` accepts, with the files written beside it, and of the files
        written beside into directories that ``where(directory, True)`` accepts (waiting for
        those); ``exports_only``: of the files beside alone. A save ended with
        ``commit=False`` counts as failed. They stay recorded: reported here, they are raised
        again at the next ``begin``, ``wait`` or ``close`` (see :mod:`.hf_trainer`)."""
        failures: list[tuple[str, BaseException]] = []
        for entry in self._beside_in():  # not taken yet: not reported
            if where(entry.directory, True) and entry.future.exception() is not None:
                failures.append((entry.path, entry.future.exception()))
        with self._lock:
            unreported = list(self._errors)
        last: dict[str, CheckpointHandle] = {}  # a checkpoint directory -> its last save
        for handle in list(self.history):
            if where(handle.ckpt_dir, False):
                last[handle.ckpt_dir] = handle
        for handle in last.values():
            if handle.error is not None and not any(e is handle.error for e in unreported):
                continue  # raised already
            failures += [(handle.ckpt_dir, f.exception()) for f in handle.beside if f.exception() is not None]
            if exports_only:
                continue
            if handle.error is not None:
                failures.append((handle.ckpt_dir, handle.error))
            elif handle.abandoned:
                failures.append((handle.ckpt_dir, PersistError("its save was abandoned (end(commit=False))")))
        return failures

    def wait_beside(self, directory: str | None = None) -> None:
        """Wait until the files being written beside (:meth:`write_beside`) into ``directory``
        (None: all) are written or have failed (a failure is raised as always: by the save
        beside it, or at the next ``begin`` or ``wait``)."""
        self._check_not_forked()
        for entry in self._beside_in(None if directory is None else os.path.realpath(directory)):
            entry.future.exception()  # waits

    def fence(self) -> None:
        """Call before parameters or optimizer state are modified (the optimizer step, or any
        in-place edit outside it: see :func:`fence_all`)."""
        self._check_not_forked()
        t0 = time.perf_counter()
        current = self._current
        if current is not None:  # fenced inside a save: its copies must come first
            self._start_background(current)
        self._stager.fence()
        if self.history:
            self.history[-1].fence_wait_s += time.perf_counter() - t0

    def reserve(self, nbytes: int) -> threading.Thread | None:
        """Prepare the host pool for saves of about ``nbytes`` on this rank: allocate it and
        fault it in now, in a background thread, instead of during the first save (whose
        stall would include it). Optional; the DeepSpeed plugin calls it after the first
        optimizer step. See :meth:`HostBufferPool.reserve`."""
        self._check_open()
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"reserve(nbytes={nbytes!r}): an int >= 0")
        return self.pool.reserve(nbytes)

    def _start_background(self, handle: CheckpointHandle) -> None:
        # A save's files go to the writers and its lazy copies to the copier together, when it
        # is sealed: the pool can size one block for all of them (nothing can change the
        # tensors before the next fence anyway), and no background thread competes with the
        # training thread for the GIL or a core while it is still inside the save (on 2 busy
        # cores, a writer opening its file and writing headers meanwhile made saves slower).
        # Under the seal lock: a fence on another thread and ``end`` (or ``save``) on the
        # training thread must not both take a file (two writers on one file), nor one drop
        # what the other lists meanwhile (a writer waiting for copies never queued: a save
        # that never commits, and a ``wait`` that never returns).
        with self._seal_lock:
            unwritten, handle.unwritten = handle.unwritten, []
            unsubmitted, handle.unsubmitted = handle.unsubmitted, []
            try:
                for path, plans, names, share in unwritten:
                    handle.files.append(self._writers.submit(
                        write_file, self.storage, path, plans, self.config.checksum, part_names=names,
                        zip_crc32=self.config.zip_crc32, share=share))
                if unsubmitted:
                    self._warn_if_pool_too_small(unsubmitted)
                    self._stager.submit(unsubmitted, job=handle)
            except BaseException as exc:
                # Cut short (a Ctrl-C while a writer thread starts): copies that may never be
                # queued fail, so that the writers already queued fail on them instead of
                # waiting for them for good (and close() with them).
                for item in unsubmitted:
                    if not item._issued:
                        item.error = item.error or exc
                        item.cancel()
                raise

    def _warn_if_pool_too_small(self, items: list[TensorItem]) -> None:
        """Say once when a save's lazy copies need more host staging than ``host_buffer_gb``:
        they then stream through the pool, so the last ones wait for writes to the disk, and
        training waits for them at the fence before the next optimizer step. Not an error (the
        save is correct, and the bound is kept), but the stall is the write's, which the pool
        is there to hide. Seen on an H100: a 1.075 GB ZeRO-1 save with a 1 GiB pool stalled
        ~200 ms per checkpoint instead of a few."""
        if self._warned_pool_too_small:
            return
        need = sum(aligned_size(i.nbytes) for i in items)
        if need > self.pool.capacity_bytes:
            self._warned_pool_too_small = True
            logger.warning(
                "async checkpoint: rank %d stages %.3g GiB per save but "
                "async_checkpoint.host_buffer_gb is %g: the copies stream through the pool as "
                "writes free it, and training waits for them before its next optimizer step; "
                "set host_buffer_gb to at least %.3g (host memory per rank, pinned with CUDA, "
                "allocated as used) to keep the writes out of training's way (logged once)",
                self.rank, need / 2**30, self.config.host_buffer_gb, -(-need * 100 // 2**30) / 100)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every file written beside (:meth:`write_beside`) is durable, every
        sealed checkpoint is committed and the retention its commit started (``keep_last``) is
        done; raise a background error if any."""
        self._check_not_forked()
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) \
                    or timeout < 0:
                raise ValueError(f"wait(timeout={timeout!r}): a number of seconds >= 0, or None")
            if math.isinf(timeout):
                timeout = None
        deadline = None if timeout is None else time.monotonic() + timeout
        for entry in self._beside_in():  # outcome taken below, as a background error
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                entry.future.exception(left)
            except FutureTimeout:
                raise AsyncCheckpointError(f"writing {entry.path} did not finish within {timeout} s") \
                    from None
        while True:
            with self._lock:
                handle = self._inflight[0] if self._inflight else None
            if handle is None:
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not handle.wait_committed(left):
                raise CommitError(f"checkpoint {handle.tag!r} not committed within {timeout} s")
        self._stager.forget_issued()  # those saves are over: their items need no fence
        while True:
            with self._lock:
                retiring = self._retiring[0] if self._retiring else None
            if retiring is None:
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                retiring.exception(left)  # waits; retire_older logs its OSErrors
            except FutureTimeout:
                raise AsyncCheckpointError(f"removing older checkpoints (keep_last) did not "
                                           f"finish within {timeout} s") from None
            with self._lock:
                if self._retiring and self._retiring[0] is retiring:
                    self._retiring.popleft()
            if retiring.exception() is not None:  # anything else is a bug: raised once, here
                exc, more = self._take_background_errors()
                if exc is None:
                    raise retiring.exception()
                # a failed save goes first: close() raises once, and it was lost behind this
                # until session 30; the retention bug is logged with its traceback
                logger.error("async checkpoint: removing older checkpoints failed",
                             exc_info=retiring.exception())
                raise _reraise(exc, more)
        self.raise_background_error()

    def raise_background_error(self) -> None:
        """Raise (once) the first error a background stage recorded, if any, with how many
        more there were (consumed too)."""
        exc, more = self._take_background_errors()
        if exc is not None:
            raise _reraise(exc, more)

    def wait_all_ranks(self, timeout: float | None = None, *, action: str = "wait_all_ranks()",
                       recover: str | None = None, error: Exception | None = None) -> None:
        """Collective :meth:`wait` (every rank): call it before a step that must start on all
        ranks or on none, e.g. a framework's ``load_checkpoint``, whose collectives would hang
        if a background error stopped only the rank that has it.

        Each rank waits until its own sealed checkpoints are committed, then all ranks share the
        outcome in one call of the exchange (the one :meth:`begin` makes). If a save failed, or
        the wait timed out, on any rank, every rank raises, naming ``action`` as refused: the
        failing rank its own error, the others a :class:`CommitError` naming the failing
        rank(s) and their messages. A failed save is never committed, so the last committed
        checkpoint (the one ``latest`` names) is intact. Every background error recorded so far
        is consumed, so calling again proceeds. Without a process group (a single process) the
        exchange is a no-op: this is :meth:`wait`, raising with the same message.

        ``recover``: a save directory about to be loaded from; rank 0 first finishes there what
        a crash cut short (:meth:`recover`), so every rank then finds the checkpoint in place.
        ``error``: this rank failed already (the caller's step before this call): it is shared
        without waiting, and raised here as it is, after the exchange.
        """
        local: Exception | None = error
        try:
            if error is None:
                self.wait(timeout)  # raises (and consumes) the background errors
                if recover is not None and self.rank == 0:
                    self.recover(recover, sweep=False)
        except Exception as exc:  # any kind: a rank that skipped the exchange would hang the rest
            local = exc
        # raised by wait's own steps (a timeout), the background errors are still there
        first, more = self._take_background_errors()
        detail = None
        if local is not None:
            count = 0 if first is None else 1 + more
            detail = f"{local}" + (f" (and {count} more failed save(s))" if count else "")
        _, failed = self._exchange(action, None if local is None else f"{type(local).__name__}: {detail}")
        retry = f". The errors reported here are cleared: calling {action} again retries."
        if error is not None:
            raise error
        if local is not None:
            cls = type(local) if isinstance(local, AsyncCheckpointError) else CommitError
            raise cls(f"{action} refused on every rank: {detail}{retry}") from local
        if failed:
            raise (DurabilityError if only_durability(failed) else CommitError)(
                f"{action} refused on every rank, because of rank(s) " + by_rank(failed) + retry)

    def _take_background_errors(self) -> tuple[BaseException | None, int]:
        """The first error the background stages recorded (None: none) and how many more; all
        of them are consumed, reported once together, so that a failure is not raised again
        at a later save, after its cause was fixed."""
        with self._lock:
            for entry in [e for e in self._beside if e.future.done()]:
                self._beside.remove(entry)
                if not entry.by_save and entry.future.exception() is not None:
                    self._errors.append(entry.future.exception())
            errors, self._errors = self._errors, []
        return (errors[0], len(errors) - 1) if errors else (None, 0)

    def retire_older(self, handle: CheckpointHandle, *, keep_last: int | None = None,
                     keep: Callable[[str], bool] | None = None) -> list[str]:
        """Retention (rank 0, once ``handle`` is committed and the pointer names it): remove
        this engine's committed checkpoints in the same save directory beyond the
        ``keep_last`` (default: the config's) most recently committed, except those whose
        name ``keep`` accepts, never ``handle``'s nor that of a save begun and not yet
        committed; also its checkpoints there that can never be loaded (partial, or committed
        and never finalized) last changed before ``handle`` committed. Records and returns the
        names removed; does nothing when ``keep_last`` is 0. The commit stage calls it when it
        moved the pointer (DeepSpeed's ``latest``); an adapter that moves its own pointer
        (Megatron's tracker) calls it after.

        A failure to remove an old checkpoint does not undo the commit: it is logged, and the
        next commit tries again.
        """
        keep_last = self.config.keep_last if keep_last is None else keep_last
        if not keep_last:
            return []

        def protected() -> set[str]:  # called with self._dirs_lock held
            # _current first: end() queues the save in _inflight, then clears _current (outside
            # this lock), so reading them the other way round could miss a save in between
            current = self._current
            busy = {h.ckpt_dir for h in self._pending()}
            with self._lock:
                reporting = set(self._reporting)  # its commit callbacks may still read it
            return busy | reporting | set(self._pointed.values()) | \
                {d for d in (self._beginning, current and current.ckpt_dir, handle.ckpt_dir) if d}

        try:
            handle.retired = retire_checkpoints(
                self.storage, os.path.dirname(handle.ckpt_dir), keep_last=keep_last,
                protected=protected, lock=self._dirs_lock, keep=keep,
                committed_now=os.path.basename(handle.ckpt_dir))
            if handle.retired:
                logger.info("async checkpoint: %s committed; removed older checkpoint(s) %s",
                            handle.ckpt_dir, ", ".join(handle.retired))
        except OSError as exc:
            logger.warning("async checkpoint: %s is committed, but removing older checkpoints "
                           "(keep_last=%d) failed: %s", handle.ckpt_dir, keep_last, exc)
        return handle.retired

    def pointer_moved(self, handle: CheckpointHandle) -> None:
        """Rank 0: the pointer of ``handle``'s save directory now names it. Retention never
        removes that checkpoint, whatever the commit times say: it orders checkpoints by the
        manifest's ``committed_at``, and after rank 0's clock stepped back (an NTP step, a
        restart on a node whose clock is behind) a pass that ran behind the commits removed the
        checkpoint ``latest`` had just moved to. The commit stage calls it for the pointer it
        moves; an adapter that moves its own (Megatron's tracker) calls it after."""
        with self._dirs_lock:
            self._pointed[os.path.dirname(handle.ckpt_dir)] = handle.ckpt_dir

    def retire_older_later(self, handle: CheckpointHandle, *, keep_last: int | None = None,
                           keep: Callable[[str], bool] | None = None) -> Future:
        """:meth:`retire_older` on this checkpointer's retention thread, one call at a time:
        removing a checkpoint can take as long as saving it (about 0.2 s per GiB on this VM's
        ext4, mounted with online discard), and neither the next commit nor a sync save should
        wait for that. :meth:`wait` and :meth:`close` wait for it. Once closed, it runs here."""
        self._last_retention = (handle, keep_last, keep)  # run again when callbacks let go
        return self._later(self.retire_older, handle, keep_last=keep_last, keep=keep)

    def _later(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """``fn(*args, **kwargs)`` on the retention thread, after what was queued there before
        (every deletion runs there, one at a time); here once closed."""
        with self._lock:  # close() sets _closed before it takes the lock to stop the thread
            if not self._closed:
                if self._retirer is None:
                    self._retirer = ThreadPoolExecutor(1, thread_name_prefix="async-ckpt-retirer")
                self._prune_retiring()  # nobody called wait() meanwhile
                future = self._retirer.submit(fn, *args, **kwargs)
                self._retiring.append(future)
                return future
        done: Future = Future()  # closed: here, outside the lock (fn may take it)
        done.set_result(fn(*args, **kwargs))
        return done

    def _prune_retiring(self) -> None:
        """Under ``_lock``: drop the retention futures that are done, except the first that
        failed (for :meth:`wait` to raise once); a loop that never waits keeps no others."""
        kept: collections.deque[Future] = collections.deque()
        failed = False
        for future in self._retiring:
            if future.done():
                if future.exception() is None:
                    continue
                if failed:  # the first is raised by wait(); this one is only logged
                    logger.warning("async checkpoint: retention failed again: %r", future.exception())
                    continue
                failed = True
            kept.append(future)
        self._retiring = kept

    def swap_in(self, handle: CheckpointHandle) -> None:
        """Rank 0, for a save begun with ``swap_at_commit=False``, once it is committed and
        the caller's own files are in ``handle.write_dir``: replace ``handle.ckpt_dir`` with
        it (nothing to do when the save was not staged)."""
        try:
            if handle.write_dir == handle.ckpt_dir:
                return
            replace_checkpoint(self.storage, handle.write_dir, handle.ckpt_dir, save_id=handle.save_id)
            self._later(self._remove_trash, os.path.dirname(handle.ckpt_dir))
        finally:
            with self._lock:
                self._unswapped.discard(handle)

    def abandon_swap(self, handle: CheckpointHandle) -> None:
        """Rank 0, for a save begun with ``swap_at_commit=False`` that the caller will not
        :meth:`swap_in` (its own files failed): the checkpoint it would have replaced stays,
        and the next save sweeps its staging directory."""
        with self._lock:
            self._unswapped.discard(handle)

    def _pending(self) -> list[CheckpointHandle]:
        """Saves whose directories are in use: in flight, or committed and awaiting
        :meth:`swap_in`."""
        with self._lock:
            return [*self._inflight, *self._unswapped]

    def recover(self, save_dir: str, *, sweep: bool = True) -> list[str]:
        """Rank 0, before saving into or loading from ``save_dir`` (``begin`` calls it): finish
        a replacement of a checkpoint that a crash cut short, and, with ``sweep`` (saves only:
        a load may read another job's directory while that job saves), queue the removal of
        staging directories that never committed (see :func:`~.commit.finish_replacements`).
        Returns the names of the checkpoints it put back in place."""
        save_dir = os.path.abspath(save_dir)
        busy = {h.write_dir for h in self._pending()}
        rolled, trash = finish_replacements(self.storage, save_dir, busy, sweep=sweep)
        if rolled:
            logger.warning("async checkpoint: finished replacing %s in %s (the process saving it "
                           "stopped between its two renames)", ", ".join(rolled), save_dir)
        if trash:
            self._later(self._remove_trash, save_dir)
        return rolled

    def _remove_trash(self, save_dir: str) -> None:
        try:
            remove_trash(self.storage, save_dir)
        except OSError as exc:
            logger.warning("async checkpoint: removing replaced or abandoned checkpoints in %s "
                           "failed (tried again after the next commit): %s", save_dir, exc)

    # ------------------------------------------------------------------ load path
    def verify_all_ranks(self, ckpt_dir: str | None, *, action: str = "load",
                         include: Callable[[str], bool] | None = None) -> None:
        """Collective: check a checkpoint of this engine before any rank loads from it, each
        rank hashing a disjoint share of its files (rank ``r``: files ``r, r + world_size, ...``
        of the manifest), and raise on every rank if any file is bad or the checkpoint was
        never committed: the rank that found it with its :class:`IntegrityError` naming the
        file, the others naming that rank. Every file is read once across the ranks, where
        checking each file on every rank that loads it reads a file all ranks load (DeepSpeed's
        model states) once per rank. :meth:`load` then skips the files of this checkpoint. A
        directory without this engine's records (another engine's checkpoint) passes as it is.
        ``include``: only the files (by path within the checkpoint) it accepts, those the load
        will read; :meth:`load` still checks any other file it is asked for. ``None``: this
        rank has nothing to load (no ``latest`` yet): it still takes part, so that ranks which
        read ``latest`` on either side of its first write all raise, none waiting for the rest.
        """
        if ckpt_dir is None:
            _, failed = self._exchange(action, None, key="")
            if failed:
                raise IntegrityError(f"{action} refused on every rank, because of rank(s) "
                                     f"{by_rank(failed)}")
            return
        ckpt_dir = os.path.abspath(ckpt_dir)
        self._verified.pop(ckpt_dir, None)  # an earlier pass counts no more if this one fails
        error: Exception | None = None
        manifest = None
        try:
            if os.path.isdir(os.path.join(ckpt_dir, META_DIR)):
                manifest = verify_checkpoint(ckpt_dir, rank=self.rank, world_size=self.world_size,
                                             include=include)
        except Exception as exc:  # any kind: a rank that skipped the exchange would hang the rest
            error = exc
        detail = None if error is None else f"{type(error).__name__}: {error}"
        # key: each rank checks a share of the files, which covers them all only if every
        # rank checks the same checkpoint (ranks that read `latest` on either side of a commit
        # would each check part of a different one, and load the rest unchecked)
        _, failed = self._exchange(action, detail, key=ckpt_dir)
        if error is not None:
            raise IntegrityError(f"{action} refused on every rank: {detail}") from error
        if failed:
            raise IntegrityError(f"{action} refused on every rank, because of rank(s) "
                                 f"{by_rank(failed)}")
        if manifest is not None:
            listed = frozenset([*manifest["files"], *manifest.get("late_files", ())])
            self._verified[ckpt_dir] = (manifest["save_id"], include, listed)

    def load(self, path: str, map_location: Any = None) -> Any:
        """``torch.load`` after checking the file against its checkpoint's committed manifest
        (unless :meth:`verify_all_ranks` checked that checkpoint, as it still is)."""
        if self._inflight:
            self.wait()
        verified = self._verified_check(path)
        if verified is None:
            if self.config.verify_on_load:
                verify_file(path)
            return torch.load(path, map_location=map_location, weights_only=False)
        self._check_still(verified, path)  # before: not verified against another commit
        state = torch.load(path, map_location=map_location, weights_only=False)
        self._check_still(verified, path)  # after: not read from the one that replaced it
        return state

    @contextlib.contextmanager
    def collective_load(self, action: str = "load"):
        """Collective (every rank): a framework's load, whose files :meth:`load` reads. If a
        rank finds inside it that the checkpoint was saved again since :meth:`verify_all_ranks`
        (:meth:`load` raises that at once outside it), it goes on, since the other ranks would
        wait for it in the framework's collectives, and at the end every rank raises
        ``IntegrityError``, naming ``action`` and the ranks that saw it. An exception inside
        the block propagates as it is."""
        self._replaced_seen = []
        try:
            yield
        except BaseException:
            self._replaced_seen = None
            raise
        seen, self._replaced_seen = self._replaced_seen, None
        _, failed = self._exchange(action, seen[0] if seen else None)
        if failed:
            raise IntegrityError(f"{action} refused on every rank: on rank(s) {by_rank(failed)}")

    def _verified_check(self, path: str) -> tuple[str, str] | None:
        """``(checkpoint directory, save id)`` of the check by :meth:`verify_all_ranks` that
        covers ``path``, if any: not one of a file its manifest does not list (a stray file, or
        one carried over from a checkpoint this one replaced), which that check never read."""
        ckpt_dir = find_checkpoint_dir(os.path.abspath(path))
        if ckpt_dir is None or ckpt_dir not in self._verified:
            return None
        save_id, include, listed = self._verified[ckpt_dir]
        rel = os.path.relpath(os.path.abspath(path), ckpt_dir)
        if rel not in listed or (include is not None and not include(rel)):
            return None  # left out of that check: not read by the load it was made for
        return ckpt_dir, save_id

    def _check_still(self, verified: tuple[str, str], path: str) -> None:
        """The checkpoint a load verified is still the one there: a save of the same tag (the
        trainer, while an evaluation job loads) may have replaced it since, and the files this
        load read before came from the old one. Inside :meth:`collective_load`, noted for the
        end of it instead of raised."""
        ckpt_dir, save_id = verified
        try:
            now = read_manifest(ckpt_dir).get("save_id")
        except (IntegrityError, OSError) as exc:
            now = f"unreadable ({exc})"
        if now == save_id:
            return
        message = (f"checkpoint {ckpt_dir!r} was saved again while it was being loaded (save "
                   f"{save_id} verified, now {now}), before {os.path.relpath(path, ckpt_dir)} "
                   "was read: load it again")
        if self._replaced_seen is None:
            raise IntegrityError(message)
        self._replaced_seen.append(message)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Flush: wait for every checkpoint to commit, then stop the background threads. In a
        forked child (whose copy of this checkpointer has no threads): only marks it closed."""
        if self._forked:
            self._closed = True
            return
        if self._closed:  # (by a commit callback, say: its thread could not wait for itself)
            self._drain_reports()
            return
        try:
            if self._current is not None:  # a save that never finished must not be committed
                self.end(commit=False)
            self.wait()
        finally:
            self._closed = True
            self._commits.put(None)
            self._committer.join(timeout=_COMMITTER_JOIN_S)
            self._writers.shutdown(wait=True)
            with self._lock:
                retirer = self._retirer
            if retirer is not None:
                retirer.shutdown(wait=True)
            self._stager.close()
            if self._committer.is_alive():  # close interrupted (Ctrl-C), a commit still running:
                logger.warning("async checkpoint: closed while a commit still runs; the save "
                               "directory stays locked until it ends with the process")
            else:  # released under a running commit, another job could sweep its directory
                for key in self._claimed.values():
                    if key is not None:
                        release_save_dir(key)
                self._claimed.clear()
            cancel_flush_at_exit(self._at_exit)
            _open_checkpointers.discard(self)
            self._drain_reports()

    @property
    def is_open(self) -> bool:
        """True between begin() and end()."""
        return self._current is not None

    @property
    def staged_bytes(self) -> int:
        """Bytes this rank copied to host so far (what non-writer ranks must keep at 0)."""
        return self._stager.staged_bytes

    @property
    def pooled_bytes(self) -> int:
        """Host pool bytes those copies took so far (each record rounded up to whole pages)."""
        return self._stager.pooled_bytes

    def _claim(self, save_dir: str) -> None:
        """Rank 0: claim ``save_dir`` for this process on its first save there (see
        :func:`~.commit.claim_save_dir`)."""
        save_dir = os.path.abspath(save_dir)
        if save_dir not in self._claimed:
            self._claimed[save_dir] = claim_save_dir(save_dir)
        self._release_idle_claims(keep=save_dir)

    def _release_idle_claims(self, keep: str) -> None:
        """Rank 0: give back the claims of the save directories other than ``keep`` that no
        save and no background task of this checkpointer uses any more. A job that saves into
        a new directory each time (Hugging Face Trainer's ``checkpoint-N``) kept one lock file
        open per save until :meth:`close`, and failed with "Too many open files" after some
        hundreds of saves (found by a review, session 22). In use: saves in flight, saves
        begun with ``swap_at_commit=False`` until :meth:`swap_in` (the Megatron adapter's
        markers), and, for any directory, commit callbacks and reports still queued or running
        and retention or deletions still to run. (The Megatron adapter writes its tracker and
        queues its retention after :meth:`swap_in`; it saves into one directory throughout.)"""
        busy = {os.path.dirname(h.ckpt_dir) for h in self._pending()}
        with self._lock:
            if self._reports or any(not f.done() for f in self._retiring):
                return  # a callback may read a checkpoint, retention delete one: the next begin
        for save_dir in [d for d in self._claimed if d != keep and d not in busy]:
            key = self._claimed.pop(save_dir)
            if key is not None:
                release_save_dir(key)

    def _unclaim(self, save_dir: str) -> None:
        """Undo :meth:`_claim` of a save directory this begin made and then gave up."""
        key = self._claimed.pop(os.path.abspath(save_dir), None)
        if key is not None:
            release_save_dir(key, remove=True)

    def join_training_thread(self) -> None:
        """At interpreter exit: if the saves come from a thread other than this one (training
        in a non-daemon thread, the main thread returned), wait until it ends, as Python itself
        does right after (it runs the exit flush before it joins such threads, and closing
        under a save abandons it, or refuses the thread's next one). A ``concurrent.futures``
        worker that saved earlier and now idles stops only after this hook, so for one only a
        save still being made is waited for (from the start of ``begin``, whose collective may
        wait for the slowest rank, to ``end``)."""
        owner = self._owner
        if owner is None or owner is threading.current_thread() or owner.daemon:
            return
        from concurrent.futures import thread as futures_thread

        if owner not in getattr(futures_thread, "_threads_queues", {}):
            owner.join()
            return
        # and only while the worker runs a task: one whose save raised between begin and end
        # left the save open and went idle, and the exit hung for ever (a review, session 30)
        while (self._current is not None or self._beginning is not None) and owner.is_alive() \
                and _runs_a_task(owner):
            owner.join(0.1)

    def _at_exit(self) -> None:
        self.join_training_thread()
        try:
            self.close()
        except BaseException as exc:  # nothing left to raise to at interpreter exit
            print(f"deepspeed_async_ckpt: rank {self.rank}: final checkpoint not committed: {exc}",
                  file=sys.stderr)

    def _check_open(self) -> None:
        self._check_not_forked()
        if self._closed:
            raise AsyncCheckpointError("the checkpointer is closed")

    def _check_not_forked(self) -> None:
        if self._forked:
            raise AsyncCheckpointError(f"this checkpointer belongs to process {self._pid}; this is a "
                                       "child forked from it, where its background threads do not "
                                       "run: save from the parent, or make a checkpointer here")

    def _busy(self, ckpt_dir: str) -> bool:
        return any(h.ckpt_dir == ckpt_dir for h in self._pending())

    def _report_failure(self, handle: CheckpointHandle, message: str) -> None:
        try:
            write_rank_failure(self.storage, handle.write_dir, rank=self.rank,
                               save_id=handle.save_id, message=message)
        except OSError:
            pass  # rank 0 then times out after commit_timeout_s

    # ------------------------------------------------------------------ background commit
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
        self._commit_callbacks.append(fn)

    def report(self, fn: Callable[..., Any], *args: Any, about: str | None = None) -> None:
        """Run ``fn(*args)`` on the commit callbacks' thread, after those queued before (once
        closed: here, after those). Its exception is logged. ``about``: the checkpoint
        directory it reads, which retention leaves until it has run. Adapters use it for their
        own reports."""
        def call() -> None:
            self._reporter_thread = threading.current_thread()
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - a report, never the save's failure
                logger.warning("async checkpoint: a commit callback failed: %s: %s",
                               type(exc).__name__, exc)
            finally:
                try:
                    if about is not None:
                        with self._lock:
                            self._reporting[about] -= 1
                            released = not self._reporting[about]
                            if released:
                                del self._reporting[about]
                            last = self._last_retention
                        # the retention that left it for this callback: again, now that it may go
                        if released and last is not None and about != last[0].ckpt_dir and \
                                os.path.dirname(last[0].ckpt_dir) == os.path.dirname(about):
                            self.retire_older_later(last[0], keep_last=last[1], keep=last[2])
                finally:
                    with self._lock:  # only now: that retention is queued (_release_idle_claims)
                        self._reports -= 1
        with self._lock:
            self._reports += 1
            if about is not None:
                self._reporting[about] += 1
            if not self._closed:
                if self._reporter is None:
                    self._reporter = ThreadPoolExecutor(1, thread_name_prefix="async-ckpt-reporter")
                self._reporter.submit(call)
                return
        self._drain_reports()  # in order: after what was queued before the close
        call()

    def _drain_reports(self) -> None:
        """Once closed: run the commit callbacks queued so far to the end and stop their
        thread; from that thread itself (close() in a callback), stop it without waiting."""
        with self._lock:
            reporter = self._reporter
        if reporter is not None:
            reporter.shutdown(wait=threading.current_thread() is not self._reporter_thread)

    def _announce(self, handle: CheckpointHandle, manifest: dict) -> None:
        """Rank 0, once a checkpoint is committed: log it (INFO) and queue the commit callbacks.
        A failure here is logged, never the save's: the pointer has moved already."""
        try:
            info = CommitInfo(tag=handle.tag, ckpt_dir=handle.ckpt_dir, files=len(manifest["files"]),
                              bytes=sum(e["bytes"] for e in manifest["files"].values()),
                              world_size=self.world_size,
                              seconds=handle.times["committed"] - handle.times["begin"])
            handle.commit_info = info
            logger.info("async checkpoint: %s", info)
            for fn in list(self._commit_callbacks):
                self.report(fn, info, about=handle.ckpt_dir)
        except Exception as exc:  # noqa: BLE001 - a report, not part of the commit
            logger.warning("async checkpoint: reporting the commit of %s failed (it is committed): "
                           "%s", handle.tag, exc)

    def _commit_loop(self) -> None:
        while True:
            handle = self._commits.get()
            if handle is None:
                return
            self._commit_one(handle)

    def _commit_one(self, handle: CheckpointHandle) -> None:
        recorded = False  # this rank's record is written: rank 0 takes it from there
        try:
            records: list[FileRecord] = []
            first_error: BaseException | None = None
            for fut in handle.files:  # wait for all, so no writer still runs after a failure
                try:
                    records.append(fut.result())
                except BaseException as exc:
                    first_error = first_error or exc
            for fut in handle.beside:  # Trainer's model.safetensors: durable before the commit
                try:
                    fut.result()
                except BaseException as exc:
                    first_error = first_error or exc
            self._eager_written(handle)  # its files are written (or failed): copies released
            if first_error is not None:
                raise first_error
            if handle.abandoned:  # the framework's save raised here: rank 0 must not wait for
                if self.rank != 0:  # this rank's record until commit_timeout_s
                    self._report_failure(handle, handle.failure or "the save raised on this rank "
                                                                   "before it was sealed")
                return
            # The entries of the directories made for it: files are synced in their own
            # directory as they are renamed into place, but a new directory's entry lies in its
            # parent (a first save's save directory, Trainer's checkpoint-N at every save).
            for parent in dict.fromkeys(os.path.dirname(d) for d in handle.new_dirs):
                try:
                    self.storage.sync_dir(parent)
                except PermissionError as exc:  # a directory this process may not read (not open)
                    logger.warning("async checkpoint: cannot sync directory %s (%s): the entries "
                                   "made in it are as durable as the filesystem makes them", parent, exc)
            handle.times["persisted"] = time.perf_counter()
            handle._persisted.set()
            cfg = self.config
            swap = handle.write_dir != handle.ckpt_dir and handle.swap_at_commit
            write_rank_record(self.storage, handle.write_dir, rank=self.rank, save_id=handle.save_id,
                              checksum=cfg.checksum, files=records)
            recorded = True
            manifest = None
            if self.rank == 0:
                manifest = commit(self.storage, handle.write_dir, tag=handle.tag, save_id=handle.save_id,
                                  world_size=self.world_size, checksum=cfg.checksum,
                                  timeout_s=cfg.commit_timeout_s, pointer=handle.pointer,
                                  replaces=handle.ckpt_dir if swap else None, late_files=handle.late_files,
                                  rotation=handle.rotation)
            handle.times["committed"] = time.perf_counter()
            if manifest is not None and handle.pointer is not None:
                self.pointer_moved(handle)
            if manifest is not None:
                self._announce(handle, manifest)
            if self.rank == 0 and swap:  # the checkpoint it replaced: deleted in the background
                self._later(self._remove_trash, os.path.dirname(handle.ckpt_dir))
            if self.rank == 0 and handle.pointer is not None and self.config.keep_last:
                self.retire_older_later(handle)
        except BaseException as exc:
            handle.error = exc
            if isinstance(exc, DurabilityError) and exc.pointer_moved and handle.pointer is not None:
                self.pointer_moved(handle)  # it names this one now: retention must keep it
            with self._lock:
                self._errors.append(exc)
            if not recorded:  # this rank's own part failed (its files, or its record): tell rank 0
                self._report_failure(handle, f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                if handle in self._inflight:
                    self._inflight.remove(handle)
                if handle.error is not None or handle.abandoned:
                    self._unswapped.discard(handle)  # never swapped in: its staging is abandoned
            self._eager_written(handle)
            handle._persisted.set()
            handle._committed.set()
