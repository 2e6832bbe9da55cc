"""Megatron-core adapter: translates one megatron-core checkpoint save/load into the engine's
``begin`` / ``save`` / ``end`` / ``fence`` calls. It holds no staging or writing logic.

Call order, on every rank::

    ckpt = MegatronCheckpointer(AsyncCheckpointConfig(...), writers="replica")
    for iteration in ...:
        ...forward/backward...
        ckpt.fence()                  # right before optimizer.step(): copies of the last save done
        optimizer.step()
        if iteration == first:
            ckpt.reserve(state_dict)      # optional: the host pool faulted in before the 1st save
        if iteration % save_interval == 0:
            ckpt.save(state_dict, save_dir, iteration, model=model)  # returns once planned
    ckpt.close()                      # flush: the last checkpoint committed, tracker moved

``state_dict`` is what megatron-core's ``dist_checkpointing.save`` takes: ``ShardedTensor``s
from ``model.sharded_state_dict()`` and ``optimizer.sharded_state_dict(...)``, ``ShardedObject``s,
and plain values (iteration, args, scheduler state), which go to ``common.pt``.

A save, on the training thread: megatron's preprocessing (factories, the common part,
sharding validation), writer election (:mod:`.election`), torch DCP planning
(:mod:`.torch_dist`), then one engine ``save`` per file this rank writes. Tensor shards are
copied to host lazily before the next ``fence``; ``common.pt`` is copied before ``save``
returns. Once every rank persisted, rank 0 writes ``.metadata`` and ``metadata.json``, then moves
``latest_checkpointed_iteration.txt`` atomically; a crash before that leaves the tracker on the
previous checkpoint.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import pickle
import queue
import re
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from deepspeed_async_ckpt.core import (AsyncCheckpointer, CheckpointHandle, CommitInfo,
                                       by_rank, cancel_flush_at_exit,
                                       exchange_across_ranks, flush_at_exit)
from deepspeed_async_ckpt.commit import (META_DIR, Pointer, after_the_manifest, read_manifest,
                                         record_late_files, verify_checkpoint, write_text_atomic)
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.errors import CommitError, DurabilityError, IntegrityError
from deepspeed_async_ckpt.storage import Storage, aligned_size

from . import torch_dist
from .election import check_mode, elect_writers, is_writer
from .layout import ParallelLayout, replica_group

TRACKER_FILE = "latest_checkpointed_iteration.txt"


_ITERATION_DIR = re.compile(r"iter_(\d+)")


def checkpoint_dir(save_dir: str, iteration: int) -> str:
    """Megatron-LM's directory name for an iteration: ``<save_dir>/iter_0000050``."""
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def tracker_path(save_dir: str) -> str:
    return os.path.join(save_dir, TRACKER_FILE)


def read_tracker(save_dir: str) -> int | None:
    """The iteration ``latest_checkpointed_iteration.txt`` names, or None if there is none."""
    try:
        with open(tracker_path(save_dir), encoding="utf-8") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    try:
        return int(text)
    except ValueError:
        raise IntegrityError(f"{tracker_path(save_dir)} holds {text!r}, not an iteration") from None


@dataclass
class SaveRecord:
    """One save as seen by this rank: the files it wrote and how long training was blocked."""

    iteration: int
    ckpt_dir: str
    files: list[dict] = field(default_factory=list)
    """``{"path", "part", "key", "offset", "bytes"}`` per item written: its file, its archive in
    that file (None for ``common.pt``, a whole file), and the tensor bytes it staged."""
    blocked_s: float = 0.0
    """Seconds ``save`` held the training thread (planning, eager copies, sync writes)."""
    handle: CheckpointHandle | None = field(default=None, repr=False)


class MegatronCheckpointer:
    """The engine, driven by megatron-core sharded state dicts. Construct on every rank after
    ``initialize_model_parallel``.

    ``writers`` is the election mode (``"replica"`` or ``"balanced"``, see :mod:`.election`);
    ``config`` is the same :class:`AsyncCheckpointConfig` the DeepSpeed adapter takes.
    ``retain_interval`` is Megatron-LM's ``--save-retain-interval``: once the tracker names a
    new checkpoint, the others are removed except every ``retain_interval``-th iteration (and
    the config's ``keep_last`` newest, if set). ``on_saved(iteration, info)``: called on rank 0
    once a checkpoint's tracker names it (Megatron-LM's "successfully saved" moment;
    ``info.seconds`` counts up to then), in order, on a thread of its own (a slow one delays no
    save; :meth:`close` waits for it); its failure is logged, never the save's.
    """

    def __init__(self, config: AsyncCheckpointConfig, *, writers: str = "replica",
                 storage: Storage | None = None, retain_interval: int | None = None,
                 on_saved: Callable[[int, CommitInfo], None] | None = None) -> None:
        if retain_interval is not None and (isinstance(retain_interval, bool)
                                            or not isinstance(retain_interval, int) or retain_interval < 1):
            raise ValueError(f"--save-retain-interval must be a positive integer, got {retain_interval!r}")
        self.config = config
        self.retain_interval = retain_interval
        self.on_saved = on_saved
        self.writers = check_mode(writers)
        self.layout = ParallelLayout.from_parallel_state()
        self.rank, self.world_size = self.layout.rank, self.layout.world_size
        self.engine = AsyncCheckpointer(config, rank=self.rank, world_size=self.world_size,
                                        storage=storage)
        self._finalize_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[tuple[str, Future]] = []
        self._finalizer = threading.Thread(target=self._finalize_loop, name="megatron-ckpt-finalizer",
                                           daemon=True)
        self._finalizer.start()
        self._closed = False
        flush_at_exit(self._at_exit)  # after the engine's: runs first, flushes both

    # ------------------------------------------------------------------ save path
    def save(self, state_dict: dict, save_dir: str, iteration: int, *,
             content_metadata: dict | None = None, validate_access_integrity: bool = True,
             preprocess_common: Callable[[dict], dict] | None = None,
             model: torch.nn.Module | Sequence[torch.nn.Module] | None = None) -> SaveRecord:
        """Save (collective). Async mode: returns once the files are planned and the eager part
        is copied. Sync mode: returns once the checkpoint is committed and the tracker moved.
        A failure of a previous save is raised here, on every rank, before anything starts.

        ``model`` (a module or the list of model chunks): its buffers are copied before this
        returns, not before the next fence, since the loop changes them before it (MoE's
        expert bias in ``finalize_model_grads``, BatchNorm's statistics in a forward)."""
        from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

        if isinstance(iteration, bool) or not isinstance(iteration, numbers.Integral) or iteration < 0:
            # it names the directory (iter_NNNNNNN) and goes into the tracker, which Megatron-LM
            # reads back with int(): True or tensor(6) left a tracker no run could resume from
            raise ValueError(f"save(iteration={iteration!r}): the iteration must be an integer >= 0")
        iteration = int(iteration)
        if content_metadata is not None and not isinstance(content_metadata, dict):
            raise ValueError(f"save(content_metadata={content_metadata!r}): a dict (megatron-core's "
                             "sharded state dict metadata) or None")
        t0 = time.perf_counter()
        self._agree_no_error(self._take_background_error())
        if content_metadata is not None:
            # As dist_checkpointing.save stores it (process groups dropped), for load to read.
            state_dict["content_metadata"] = _clean_metadata_for_serialization(content_metadata)
        sharded_part, common, _ = self._preprocess_and_elect(state_dict, validate_access_integrity,
                                                             preprocess_common)
        error: BaseException | None = None
        try:  # raises on every rank if some rank's local planning failed; what follows is local
            plan = torch_dist.plan_save(sharded_part, rank=self.rank, world_size=self.world_size,
                                        max_files=self.config.writer_threads)
        except BaseException as exc:
            error = exc
        self._agree_no_error(error)  # before begin's collective, which a failed rank never joins

        chunks = [] if model is None else list(model) if isinstance(model, Sequence) else [model]
        # nn.Module's own method: megatron-core's DistributedDataParallel hides it behind a
        # list attribute named ``buffers`` (its gradient buffers)
        buffers = [b for chunk in chunks for b in torch.nn.Module.buffers(chunk)]
        ckpt_dir = os.path.abspath(checkpoint_dir(save_dir, iteration))
        record = SaveRecord(iteration=iteration, ckpt_dir=ckpt_dir)
        # A directory that holds a checkpoint (the tracker's iteration saved again) is
        # replaced once this save is finalized: staged beside it, swapped in by _finalize.
        handle = self.engine.begin(ckpt_dir, tag=str(iteration), swap_at_commit=False,
                                   late_files=torch_dist.MARKER_FILES,
                                   own_pointer=tracker_path(os.path.abspath(save_dir)))
        error: BaseException | None = None
        try:
            if self.rank == 0:
                staged = self.engine.save(common, os.path.join(ckpt_dir, torch_dist.COMMON_FILE),
                                          eager_keys=tuple(common))
                record.files.append({"path": torch_dist.COMMON_FILE, "part": None, "key": "common",
                                     "offset": None, "bytes": staged})
            for relpath, jobs in plan.files().items():
                staged = self.engine.save_packed(os.path.join(ckpt_dir, relpath),
                                                 [(job.part, job.data) for job in jobs],
                                                 eager_tensors=buffers)
                record.files += [{"path": relpath, "part": job.part, "key": job.key,
                                  "offset": job.offset, "bytes": n} for job, n in zip(jobs, staged)]
        except BaseException as exc:
            error = exc
        try:
            record.handle = self.engine.end(commit=error is None)  # sync mode: persists here
        except BaseException as exc:
            error = error or exc
        if self.rank == 0 and error is None:
            # Only the index travels to the finalizer: the jobs hold the tensors, which must be
            # freed as soon as they are staged.
            index, tracker = plan.index, tracker_path(os.path.abspath(save_dir))
            self._submit_finalize(ckpt_dir, lambda: self._finalize(handle, index, tracker, str(iteration)))
            if not self.config.is_async:
                self._wait_finalized(ckpt_dir)
                error = self._take_finalize_error()
        del plan
        # Collective: a save that failed anywhere fails everywhere; in sync mode this is also
        # the barrier after which every rank knows the tracker names this checkpoint.
        self._agree_no_error(error)
        record.blocked_s = time.perf_counter() - t0
        return record

    def reserve(self, state_dict: dict) -> int:
        """Collective (every rank, like ``save``): size this rank's host pool for a save of
        ``state_dict`` and fault it in, in a background thread; returns the bytes reserved.

        Call once, after the first optimizer step, with the state dict a save would take (it
        is consumed, as ``save`` consumes it). The size is what ``save`` would stage through
        the pool here: the shards this rank is elected to write (after the same election) and
        the tensors inside its ``ShardedObject``s (RNG states), each rounded up to whole pages;
        0 on a rank that writes none. Without it, the first save faults its staging memory in
        while copying, and the next fence waits for that.
        """
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
        from torch.utils._pytree import tree_leaves

        _, _, values = self._preprocess_and_elect(state_dict, False)
        staged = [v.data for v in values if isinstance(v, ShardedTensor) and is_writer(v)]
        for obj in values:  # objects (RNG states, say) may hold tensors: staged lazily, too
            if isinstance(obj, ShardedObject) and is_writer(obj):
                staged += [x for x in tree_leaves(obj.data) if isinstance(x, torch.Tensor)]
        nbytes = sum(aligned_size(t.numel() * t.element_size()) for t in staged if t is not None)
        self.engine.reserve(nbytes)
        return nbytes

    def _preprocess_and_elect(self, state_dict: dict, validate_access_integrity: bool,
                              preprocess_common: Callable[[dict], dict] | None = None,
                              ) -> tuple[dict, dict, list]:
        """What ``save`` and ``reserve`` both start from (collective): megatron-core's save
        preprocessing, then the writer election over its ShardedTensors. Returns the sharded
        part, the common part, and the sharded part's values (tensors and objects).
        ``preprocess_common``: what the ranks' common parts are compared after, when the
        access integrity is validated (Megatron-LM drops per-rank values from ``args``)."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
        from megatron.core.dist_checkpointing.state_dict_utils import filter_out_empty_flatten_tensor
        from megatron.core.dist_checkpointing.utils import (_clean_metadata_for_serialization,
                                                            extract_nonpersistent, extract_sharded_base)
        from megatron.core.dist_checkpointing.validation import (determine_global_metadata,
                                                                 validate_sharding_integrity)

        # megatron-core's save_preprocess, step by step: its local steps (factories, the
        # caller's preprocess_common) can fail on some ranks only, while the others went on
        # into the validation's collectives and waited there for good. Their outcome is agreed
        # on first (one small all-reduce).
        error: BaseException | None = None
        try:
            apply_factories(state_dict)
            _, state_dict = extract_nonpersistent(state_dict)
            sharded_part, common = extract_sharded_base(state_dict)
            sharded_part = filter_out_empty_flatten_tensor(sharded_part)
            if validate_access_integrity:
                checked = common
                if "content_metadata" in checked:
                    checked["content_metadata"] = _clean_metadata_for_serialization(checked["content_metadata"])
                if preprocess_common is not None:
                    checked = preprocess_common(common)
                if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                    # the validation's first collective broadcasts it from rank 0, which pickles
                    # it first: a lock or a lambda there raised on rank 0 alone, outside the
                    # broadcast the others waited in for good (a review, session 30)
                    pickle.dumps(checked)
        except BaseException as exc:
            error = exc
        self._agree_no_error(error)
        if validate_access_integrity:
            # The validation's checks of the sharding raise on rank 0 alone (an invalid access
            # pattern: two main replicas of a shard, or none), after its collectives: raised
            # here on every rank, or the others would wait for rank 0 in plan_save's.
            try:
                validate_sharding_integrity(determine_global_metadata(sharded_part)[1],
                                            common_state_dict=checked)
            except Exception as exc:
                error = exc
            self._agree_no_error(error)
        values = list(nested_values(sharded_part))
        elect_writers([v for v in values if isinstance(v, ShardedTensor)], self.writers, replica_group())
        return sharded_part, common, values

    def fence(self) -> None:
        """Call right before ``optimizer.step()``: waits only for copies still outstanding."""
        self.engine.fence()

    def wait(self, timeout: float | None = None, *, recover: str | None = None) -> None:
        """Collective: block until every save so far is committed and the tracker moved; raise
        on every rank if any rank's background work failed. ``recover``: a save directory about
        to be loaded from, where rank 0 first finishes what a crash cut short (the engine's
        ``recover``: a re-saved iteration between its two renames)."""
        error = None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._wait_finalized(None, deadline)  # each waits for its commit; retention is queued after it
            self.engine.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if recover is not None and self.rank == 0:
                self.engine.recover(recover, sweep=False)
        except BaseException as exc:
            error = exc
        self._agree_no_error(error or self._take_finalize_error())

    # ------------------------------------------------------------------ load path
    def load(self, sharded_state_dict: dict, ckpt_dir: str, **load_kwargs: Any) -> dict:
        """``megatron.core.dist_checkpointing.load`` (collective), after pending saves landed
        and, for a checkpoint this engine wrote, after every file was checked against its
        manifest (each rank checks a disjoint share). Checkpoints megatron-core wrote itself
        load as they are."""
        from megatron.core import dist_checkpointing

        self.wait(recover=os.path.dirname(os.path.abspath(ckpt_dir)))
        if self.config.verify_on_load:
            verify_checkpoint_dir(ckpt_dir, rank=self.rank, world_size=self.world_size,
                                  request=sharded_state_dict)
        return dist_checkpointing.load(sharded_state_dict, ckpt_dir, **load_kwargs)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Collective (every rank), as megatron-core's ``AsyncCallsQueue.close`` is: flush
        (every checkpoint committed, the tracker moved) and stop the background threads; raises
        on every rank if any rank's flush failed. Only rank 0 finalizes checkpoints (the marker
        files, then the tracker), so until session 28 the other ranks returned from here before
        the tracker named the last one: a load right after it failed on them."""
        self._close(collective=True)

    def _close(self, *, collective: bool) -> None:
        if self._closed:
            return
        error: BaseException | None = None
        try:
            # the finalizations first (each waits for its commit), so that their on_saved reports
            # are queued while the engine still runs them in order on its callback thread
            self._wait_finalized(None)
            self.engine.close()
            self._wait_finalized(None)  # any that came of the engine's own flush
            error = self._take_finalize_error()
        except BaseException as exc:
            error = exc
        finally:
            self._closed = True
            self._finalize_queue.put(None)
            self._finalizer.join(timeout=60)
            cancel_flush_at_exit(self._at_exit)
        if collective:  # rank 0 has finalized: the tracker names the last checkpoint
            self._agree_no_error(error)
        elif error is not None:
            raise error

    @property
    def staged_bytes(self) -> int:
        """Bytes this rank copied to host so far."""
        return self.engine.staged_bytes

    def _at_exit(self) -> None:
        self.engine.join_training_thread()
        try:
            self._close(collective=False)  # the other ranks may be gone, or elsewhere
        except BaseException as exc:
            print(f"megatron_adapter: rank {self.rank}: final checkpoint not committed: {exc}",
                  file=sys.stderr)

    # ------------------------------------------------------------------ rank 0 finalize
    def _finalize(self, handle: CheckpointHandle, index: torch_dist.GlobalIndex, tracker: str,
                  text: str) -> None:
        handle.wait_committed()
        if handle.error is not None or handle.abandoned:
            return  # the engine reports its own failure; the tracker stays put
        try:
            torch_dist.write_markers(self.engine.storage, handle.write_dir, index)
            record_late_files(self.engine.storage, handle.write_dir)  # the markers verify too
        except BaseException:  # the iteration it re-saves, if any, stays; its staging is swept
            self.engine.abandon_swap(handle)
            raise
        try:
            self.engine.swap_in(handle)  # a re-saved iteration: the old one stayed whole until now
            write_text_atomic(self.engine.storage, tracker, text)
        except OSError as exc:  # in place already, or not: said as the core commit says it
            staged = handle.write_dir != handle.ckpt_dir
            error = after_the_manifest(exc, handle.write_dir, handle.ckpt_dir if staged else None,
                                       handle.tag, handle.save_id, Pointer(tracker, text),
                                       finished_later=False)
            if isinstance(error, DurabilityError) and error.pointer_moved:
                self.engine.pointer_moved(handle)  # the tracker names it: retention keeps it
            raise error from exc
        self.engine.pointer_moved(handle)
        handle.times["finalized"] = time.perf_counter()
        self._retire_older(handle)  # only once the tracker names the new one
        self._announce(handle, int(text))

    def _announce(self, handle: CheckpointHandle, iteration: int) -> None:
        """``on_saved`` on the engine's callback thread (see ``AsyncCheckpointer.report``): a
        slow one holds up neither the next finalization nor :meth:`wait`."""
        if handle.commit_info is None or self.on_saved is None:
            return
        info = dataclasses.replace(handle.commit_info,
                                   seconds=handle.times["finalized"] - handle.times["begin"])
        self.engine.report(self.on_saved, iteration, info, about=handle.ckpt_dir)

    def _retire_older(self, handle: CheckpointHandle) -> None:
        """Retention: the config's ``keep_last``, and Megatron-LM's ``--save-retain-interval``
        (keep every ``retain_interval``-th iteration and the newest checkpoint, remove the rest),
        on the engine's retention thread (a sync save does not wait for the removal)."""
        interval = self.retain_interval
        if interval is None:
            if self.config.keep_last:
                self.engine.retire_older_later(handle)
            return

        def on_interval(name: str) -> bool:
            match = _ITERATION_DIR.fullmatch(name)
            return match is not None and int(match[1]) % interval == 0

        self.engine.retire_older_later(handle, keep_last=max(self.config.keep_last, 1), keep=on_interval)

    def _submit_finalize(self, ckpt_dir: str, fn: Callable[[], None]) -> None:
        fut: Future = Future()
        self._pending.append((ckpt_dir, fut))
        self._finalize_queue.put((fut, fn))

    def _finalize_loop(self) -> None:
        while True:
            job = self._finalize_queue.get()
            if job is None:
                return
            fut, fn = job
            try:
                fn()
                fut.set_result(None)
            except BaseException as exc:
                fut.set_exception(exc)

    def _wait_finalized(self, ckpt_dir: str | None, deadline: float | None = None) -> None:
        """Wait for the finalization of ``ckpt_dir`` (None: of every save), at most until
        ``deadline`` (a ``time.monotonic()``), then raise ``CommitError``."""
        for d, fut in list(self._pending):
            if ckpt_dir is None or d == ckpt_dir:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    fut.exception(left)  # waits; the error itself is taken by _take_finalize_error
                except FutureTimeoutError:
                    raise CommitError(f"checkpoint {d!r} not committed and finalized in time "
                                      "(wait's timeout)") from None

    def _take_finalize_error(self) -> BaseException | None:
        """The first failed finalization among those done, naming how many more failed; all
        done ones are consumed, so no failure comes back at a later call."""
        done = [item for item in self._pending if item[1].done()]
        for item in done:
            self._pending.remove(item)
        failed = [(ckpt_dir, fut.exception()) for ckpt_dir, fut in done if fut.exception() is not None]
        if not failed:
            return None
        (ckpt_dir, exc), more = failed[0], len(failed) - 1
        if isinstance(exc, DurabilityError):  # in place: "the tracker still names ..." is false
            err: BaseException = DurabilityError(
                f"checkpoint {ckpt_dir!r}'s finalization did not complete: {exc}"
                + (f" (and {more} more failed save(s))" if more else ""), pointer_moved=exc.pointer_moved)
            err.__cause__ = exc
            return err
        err = CommitError(f"checkpoint {ckpt_dir!r} persisted but its torch_dist metadata or "
                          f"tracker could not be written (the tracker still names the previous "
                          f"checkpoint): {exc}" + (f" (and {more} more failed save(s))" if more else ""))
        err.__cause__ = exc
        return err

    def _take_background_error(self) -> BaseException | None:
        try:
            self.engine.raise_background_error()
        except BaseException as exc:
            return exc
        return self._take_finalize_error()

    def _agree_no_error(self, error: BaseException | None) -> None:
        """Collective: raise on every rank if any rank has an error (its own, or a summary)."""
        _, failed = exchange_across_ranks("", None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if failed:
            raise CommitError("checkpoint failed on rank(s) " + by_rank(failed))


#: What :func:`verify_checkpoint_dir` can be told a load skips, by its top-level names.
SKIPPABLE = {"optimizer": torch_dist.is_optimizer_name, "rng_state": lambda name: name == "rng_state"}


def _reads_of_load(ckpt_dir: str, wanted: Callable[[str], bool]) -> Callable[[str], list[tuple[int, int]] | None]:
    """For ``verify_checkpoint``: of a .distcp file, the items the load can read; of any other
    file (``common.pt``), all of it."""
    by_file = torch_dist.reads_of_load(ckpt_dir, wanted)
    return lambda rel: by_file.get(rel, []) if rel.endswith(".distcp") else None


def verify_checkpoint_dir(ckpt_dir: str, *, rank: int = 0, world_size: int = 1,
                          request: dict | None = None, skip: Iterable[str] = ()) -> None:
    """Collective when ``world_size > 1``. For a checkpoint this engine wrote: it must be
    committed and finalized, and every file must match the manifest; rank ``r`` hashes files
    ``r, r + world_size, ...``. With the sharded state dict a load will ``request``, only the
    items some rank's load can read are hashed (the ranks' requests differ: pipeline stages) (see :func:`~.torch_dist.reads_of_load`: without the
    optimizer state, none of its bytes); or, where the caller knows only what the load leaves
    out (Megatron-LM's ``--no-load-optim``, ``--finetune``), all but the items of ``skip``
    (names of :data:`SKIPPABLE`). A checkpoint megatron-core wrote itself (``metadata.json``,
    no engine records) is accepted as it is; a directory that is neither raises."""
    skip = tuple(skip)
    unknown = [name for name in skip if name not in SKIPPABLE]
    if unknown:  # the same on every rank: raised before the collective
        raise ValueError(f"verify_checkpoint_dir: cannot skip {', '.join(map(repr, unknown))} "
                         f"(knows {', '.join(map(repr, SKIPPABLE))})")
    error = None
    wanted: Callable[[str], bool] | None = None
    if request is not None:
        # Ranks request different parts (pipeline stages, say) but split the files between
        # them: each checks, in the files it was given, what any rank reads.
        names: list[str] | None = None
        try:
            names = sorted(torch_dist.requested_names(request))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        every = [names]
        if world_size > 1:
            every = [None] * world_size
            dist.all_gather_object(every, names)
        wanted = set().union(*(n for n in every if n is not None)).__contains__
    elif skip:
        wanted = lambda name: not any(SKIPPABLE[s](name) for s in skip)  # noqa: E731
    if error is None:
        try:
            _verify_here(ckpt_dir, rank, world_size, wanted)
        except IntegrityError as exc:
            error = str(exc)
        except Exception as exc:  # any kind: a rank that skipped the all-gather would hang the rest
            error = f"{type(exc).__name__}: {exc}"
    # Each rank checked a share of the files: together all of them only if every rank checked
    # the same checkpoint (ranks reading the tracker on either side of a commit do not).
    where = os.path.abspath(ckpt_dir)
    every = [(error, where)]
    if world_size > 1:
        every = [None] * world_size
        dist.all_gather_object(every, (error, where))
    errors = [e for e, _ in every if e]
    elsewhere = [r for r, (_, d) in enumerate(every) if d != every[0][1]]
    if elsewhere:
        errors.insert(0, f"the ranks are not checking the same checkpoint: rank(s) "
                         f"{', '.join(f'{r} in {every[r][1]!r}' for r in elsewhere)}, rank 0 in "
                         f"{every[0][1]!r}")
    if errors:
        raise IntegrityError("; ".join(dict.fromkeys(errors)))


def _verify_here(ckpt_dir: str, rank: int, world_size: int, wanted: Callable[[str], bool] | None) -> None:
    """This rank's part of :func:`verify_checkpoint_dir`."""
    if not os.path.isdir(os.path.join(ckpt_dir, META_DIR)):
        if not os.path.exists(os.path.join(ckpt_dir, torch_dist.CONFIG_FILE)):
            raise IntegrityError(f"{ckpt_dir!r} is not a complete checkpoint: neither this "
                                 f"engine's manifest nor megatron's {torch_dist.CONFIG_FILE}")
        return
    manifest = read_manifest(ckpt_dir)
    missing = [n for n in torch_dist.MARKER_FILES if not os.path.exists(os.path.join(ckpt_dir, n))]
    if missing:
        raise IntegrityError(f"checkpoint {ckpt_dir!r} was persisted but never finalized "
                             f"({', '.join(missing)} missing): load the one the tracker names")
    reads = None
    if wanted is not None:
        try:  # from .metadata, which the check below has not yet verified
            reads = _reads_of_load(ckpt_dir, wanted)
        except Exception as exc:  # damaged (unpickling it fails in any way), or unreadable
            why = "" if isinstance(exc, OSError) else ": file truncated or corrupted"
            raise IntegrityError(f"{os.path.join(ckpt_dir, torch_dist.DCP_METADATA_FILE)} cannot "
                                 f"be read ({type(exc).__name__}: {exc}){why}") from exc
    verify_checkpoint(ckpt_dir, rank=rank, world_size=world_size, manifest=manifest, reads=reads)
