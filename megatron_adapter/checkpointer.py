"""Megatron-core adapter: translates one megatron-core checkpoint save/load into the engine's
``begin`` / ``save`` / ``end`` / ``fence`` calls. It holds no staging, writing or commit logic.

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

A save, on the training thread of every rank: megatron's preprocessing (factories, the common
part, sharding validation), writer election (:mod:`.election`), torch DCP planning
(:mod:`.torch_dist`), then the engine's ``begin`` with the tracker as the pointer and, on rank
0, the marker files as a finalize step (:class:`.torch_dist.Markers`), one engine ``save`` per
file this rank writes, and ``end``. Tensor shards are copied to host lazily before the next
``fence``; ``common.pt`` is copied before ``save`` returns. Once every rank persisted, rank 0's
committer thread (the engine's) writes the manifest, then ``.metadata`` and
``metadata.json``, swaps a re-saved iteration in, and moves
``latest_checkpointed_iteration.txt`` atomically; a crash or a failure before that leaves the
tracker on the previous checkpoint. Retention (the config's ``keep_last``, Megatron-LM's
``--save-retain-interval``) is the engine's, as a policy (:func:`retention_policy`).
"""

from __future__ import annotations

import numbers
import os
import pickle
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from deepspeed_async_ckpt.commit import KeepAny, KeepEvery, KeepLast, Pointer, RetentionPolicy
from deepspeed_async_ckpt.commit.nodes import node_leader
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import (AsyncCheckpointer, CheckpointHandle, CommitInfo, by_rank,
                                       exchange_across_ranks, outcome)
from deepspeed_async_ckpt.errors import AgreementError, CommitError, IntegrityError
from deepspeed_async_ckpt.storage import Storage, aligned_size
from deepspeed_async_ckpt.tiers.config import refuse_overlap

from . import torch_dist
from .election import check_mode, elect_writers, is_writer
from .layout import ParallelLayout, replica_group
from .verify import SKIPPABLE, verify_checkpoint_dir  # noqa: F401 - part of this module's API

TRACKER_FILE = "latest_checkpointed_iteration.txt"

_ITERATION_DIR = re.compile(r"iter_(\d+)")


def checkpoint_dir(save_dir: str, iteration: int) -> str:
    """Megatron-LM's directory name for an iteration: ``<save_dir>/iter_0000050``."""
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def iteration_of(name: str) -> int | None:
    """The iteration a checkpoint directory's name holds (``iter_0000050``: 50), or None."""
    match = _ITERATION_DIR.fullmatch(name)
    return None if match is None else int(match[1])


def named_by_tracker(text: str) -> str:
    """The checkpoint directory's name a tracker's text names: ``iter_0000050`` for ``50``;
    any other text as it is (Megatron-LM's ``release``)."""
    return f"iter_{int(text):07d}" if text.isdigit() else text


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


def retention_policy(keep_last: int, retain_interval: int | None) -> RetentionPolicy | None:
    """Megatron-LM's ``--save-retain-interval N``: keep every N-th iteration and the newest
    (the config's ``keep_last`` newest, if more); None without it (the engine then applies
    ``keep_last`` alone, as for DeepSpeed)."""
    if retain_interval is None:
        return None
    return KeepAny(KeepLast(max(keep_last, 1)), KeepEvery(retain_interval))


def _agree(error: BaseException | None) -> None:
    """Collective: raise on every rank if any rank has an error (its own, or a summary), as a
    megatron-core save fails on every rank or on none."""
    _, failed = outcome("checkpoint", None, error, exchange=exchange_across_ranks)
    if error is not None:
        raise error
    if failed is not None:
        raise CommitError("checkpoint failed on rank(s) " + by_rank(failed.failures)) from failed


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
    ``info.seconds`` counts up to then), in order, on the engine's callback thread (a slow one
    delays no save; :meth:`close` waits for it); its failure is logged, never the save's.
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
        # With node-local storage (config.node_local) every node's leader writes common.pt into
        # its node's directory too, so that each node's copy loads (rank 0's commit sends the
        # marker files to every node); else rank 0 alone, as megatron-core does.
        self._writes_common = self.rank == 0 or (
            config.node_local and self.rank == node_leader(self.rank, self.world_size))
        self.checkpointer = AsyncCheckpointer(
            config, rank=self.rank, world_size=self.world_size, storage=storage,
            on_commit=None if on_saved is None else (lambda info: on_saved(int(info.tag), info)),
            retention=retention_policy(config.keep_last, retain_interval), step_of=iteration_of)
        if self.checkpointer.tiers is not None:  # before any save: its begin catches the tiers up
            self.checkpointer.tiers.name_of = named_by_tracker

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
            # reads back with int(): True or tensor(6) would leave a tracker no run resumes from
            raise ValueError(f"save(iteration={iteration!r}): the iteration must be an integer >= 0")
        iteration = int(iteration)
        if content_metadata is not None and not isinstance(content_metadata, dict):
            raise ValueError(f"save(content_metadata={content_metadata!r}): a dict (megatron-core's "
                             "sharded state dict metadata) or None")
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:  # before megatron's collectives below, which a rank raising it would never join
            self.checkpointer.raise_background_error()
        except BaseException as exc:
            error = exc
        _agree(error)
        if content_metadata is not None:
            # As dist_checkpointing.save stores it (process groups dropped), for load to read.
            state_dict["content_metadata"] = _clean_metadata_for_serialization(content_metadata)
        sharded_part, common, _ = self._preprocess_and_elect(state_dict, validate_access_integrity,
                                                             preprocess_common)
        try:  # raises on every rank if some rank's local planning failed; what follows is local
            plan = torch_dist.plan_save(sharded_part, rank=self.rank, world_size=self.world_size,
                                        max_files=self.config.writer_threads)
        except BaseException as exc:
            error = exc
        _agree(error)  # before begin's collective, which a failed rank never joins

        chunks = [] if model is None else list(model) if isinstance(model, Sequence) else [model]
        # nn.Module's own method: megatron-core's DistributedDataParallel hides it behind a
        # list attribute named ``buffers`` (its gradient buffers)
        buffers = [b for chunk in chunks for b in torch.nn.Module.buffers(chunk)]
        save_dir = os.path.abspath(save_dir)
        ckpt_dir = checkpoint_dir(save_dir, iteration)
        record = SaveRecord(iteration=iteration, ckpt_dir=ckpt_dir)
        # Rank 0's commit writes the markers (only the index travels with the save: the jobs
        # hold the tensors, freed once staged), then swaps a re-saved iteration in, then moves
        # the tracker, whose text is the iteration.
        self.checkpointer.begin(ckpt_dir, tag=str(iteration),
                                pointer=Pointer(tracker_path(save_dir), str(iteration)),
                                finalize=[torch_dist.Markers(plan.index)] if self.rank == 0 else ())
        try:
            if self._writes_common:
                staged = self.checkpointer.save(common, os.path.join(ckpt_dir, torch_dist.COMMON_FILE),
                                                eager_keys=tuple(common))
                record.files.append({"path": torch_dist.COMMON_FILE, "part": None, "key": "common",
                                     "offset": None, "bytes": staged})
            for relpath, jobs in plan.files().items():
                staged = self.checkpointer.save_packed(os.path.join(ckpt_dir, relpath),
                                                       [(job.part, job.data) for job in jobs],
                                                       eager_tensors=buffers)
                record.files += [{"path": relpath, "part": job.part, "key": job.key,
                                  "offset": job.offset, "bytes": n} for job, n in zip(jobs, staged)]
        except BaseException as exc:
            error = exc
        try:  # sync mode: persisted, committed, finalized and the tracker moved here
            record.handle = self.checkpointer.end(commit=error is None)
        except BaseException as exc:
            error = error or exc
        del plan
        # Collective: a save that failed anywhere fails everywhere; in sync mode this is also
        # the barrier after which every rank knows the tracker names this checkpoint.
        _agree(error)
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
        self.checkpointer.reserve(nbytes)
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
                    # it first: a lock or a lambda there would raise on rank 0 alone, outside
                    # the broadcast the others wait in
                    pickle.dumps(checked)
        except BaseException as exc:
            error = exc
        _agree(error)
        if validate_access_integrity:
            # The validation's checks of the sharding raise on rank 0 alone (an invalid access
            # pattern: two main replicas of a shard, or none), after its collectives: raised
            # here on every rank, or the others would wait for rank 0 in plan_save's.
            try:
                validate_sharding_integrity(determine_global_metadata(sharded_part)[1],
                                            common_state_dict=checked)
            except Exception as exc:
                error = exc
            _agree(error)
        values = list(nested_values(sharded_part))
        try:  # fails on every rank of a data-parallel group alike: the other groups learn it here
            elect_writers([v for v in values if isinstance(v, ShardedTensor)], self.writers, replica_group())
        except AgreementError as exc:  # the rank that failed raises its own; its group, the agreement
            error = exc.own if exc.own is not None else exc
        except BaseException as exc:
            error = exc
        if self.writers != "replica":  # (which elects nothing, and cannot fail)
            _agree(error)
        return sharded_part, common, values

    def fence(self) -> None:
        """Call right before ``optimizer.step()``: waits only for copies still outstanding."""
        self.checkpointer.fence()

    def wait(self, timeout: float | None = None, *, recover: str | None = None) -> None:
        """Collective: block until every save so far is committed and the tracker moved; raise
        on every rank if any rank's background work failed. ``recover``: a save directory about
        to be loaded from, where rank 0 first finishes what a crash cut short (the engine's
        ``recover``: a re-saved iteration between its two renames)."""
        error = None
        try:
            self.checkpointer.wait(timeout)  # retention queued by the commits included
            if recover is not None and self.rank == 0:
                self.checkpointer.recover(recover, sweep=False)
        except BaseException as exc:
            error = exc
        _agree(error)

    # ------------------------------------------------------------------ load path
    def restore(self, save_dir: str, iteration: int | None = None) -> None:
        """Collective, before a load from ``save_dir``: with durable tiers configured, bring the
        checkpoint to load (``iteration``; else the tracker's where a user edited it, or the
        newest committed on any tier, or where that cannot be made whole the newest that can:
        see :mod:`deepspeed_async_ckpt.tiers.restore`) into it from them, every file missing or
        damaged there fetched and verified, the tracker last. With ``node_local``, each node's
        leader restores every file into its node's directory: a rank also reads tensors another
        rank wrote once (replicated across TP), on any node.
        A tier that is, contains or lies inside ``save_dir`` raises ConfigError first."""
        refuse_overlap(self.config.tiers, save_dir)
        tiers = self.checkpointer.tiers
        if tiers is not None:
            tiers.restore_all_ranks(
                self.checkpointer, save_dir, pointer_name=TRACKER_FILE, every_file=True,
                tag=None if iteration is None else os.path.basename(checkpoint_dir(save_dir, iteration)))

    def restore_from_memory(self, save_dir: str, iteration: int | None = None) -> Any:
        """Collective, before a load from ``save_dir``: with the memory tier on, the keeper's
        checkpoint laid out on tmpfs where it is newer than what ``save_dir`` and the tiers
        hold (or is the ``iteration`` asked for) and every node can make it whole, with a
        tracker naming it: a :class:`~deepspeed_async_ckpt.memory.restore.MemoryRestore`
        whose ``load_dir`` the load then reads (every file, on every node: a rank also reads
        tensors another rank wrote); None: load as without it."""
        memory = getattr(self.config, "memory", None)
        if memory is None or not memory.enabled:
            return None
        from deepspeed_async_ckpt.memory.restore import restore_from_memory
        from deepspeed_async_ckpt.tiers.choose import newest_committed

        tiers = self.checkpointer.tiers
        remotes = tiers.remotes if tiers is not None else []
        return restore_from_memory(
            save_dir, memory, rank=self.rank, world_size=self.world_size, pointer_name=TRACKER_FILE,
            tag=None if iteration is None else os.path.basename(checkpoint_dir(save_dir, iteration)),
            on_disk=lambda: newest_committed(save_dir, remotes, pointer_name=TRACKER_FILE,
                                             name_of=named_by_tracker),
            required=lambda manifest, node: sorted([*manifest["files"], *manifest.get("late_files", ())]),
            pointer_text=lambda name: str(iteration_of(name)), exchange=self.checkpointer.exchange)

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
        on every rank if any rank's flush failed. Rank 0 alone finalizes checkpoints (the
        marker files, then the tracker): the other ranks return from here only once the
        tracker names the last one, so a load right after it finds it on every rank. At
        interpreter exit the engine flushes itself (not collectively)."""
        error = None
        try:
            self.checkpointer.close()
        except BaseException as exc:
            error = exc
        _agree(error)

    @property
    def engine(self) -> AsyncCheckpointer:
        """Deprecated name of :attr:`checkpointer`, the :class:`AsyncCheckpointer` this adapter
        drives (the name DeepSpeed's ``AsyncCheckpointEngine`` gives it too)."""
        warnings.warn("MegatronCheckpointer.engine is deprecated: use .checkpointer",
                      DeprecationWarning, stacklevel=2)
        return self.checkpointer

    @property
    def staged_bytes(self) -> int:
        """Bytes this rank copied to host so far."""
        return self.checkpointer.staged_bytes
