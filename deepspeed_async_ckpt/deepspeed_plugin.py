"""DeepSpeed adapter: a ``CheckpointEngine`` over :class:`AsyncCheckpointer`, and the patches
that select it from the ``"async_checkpoint"`` config key.

It holds no I/O logic. What it translates (checked against DeepSpeed 0.19.8's sources):

- ``create_checkpoint_engine`` is imported by name into ``deepspeed.runtime.engine``; we replace
  that name, so our engine is built when the key is present and enabled, and DeepSpeed's own
  engine otherwise (behaviour unchanged).
- The engine is *decoupled* with no commit info, so DeepSpeed never writes ``latest`` itself;
  our commit stage does, once every rank persisted.
- ``DeepSpeedEngine._take_model_step`` (which the pipeline engine also uses) gets a fence
  before the optimizer step: the only point where training waits for outstanding copies.
  After the first step (when the optimizer state exists) the host pool is sized from this
  rank's share of the state and faulted in, in the background, ahead of the first save.
- ``is_data_parallel_writer`` says yes for every data-parallel replica (without ZeRO-3, MoE or
  node-local storage), so each is handed the model-states file and writes a share of it
  (:class:`~.core.Replicas`); with ``split_replicated_files`` off, only the first
  replica writes it, as DeepSpeed's own engine does.
- ``save_checkpoint`` is wrapped to seal the checkpoint when DeepSpeed's save returns and to
  freeze ``client_state`` eagerly (in sync mode it also holds a failed write, and rank 0's
  failed copy of ``zero_to_fp32.py``, until DeepSpeed's closing barrier, then shares the
  outcome so that every rank raises or returns committed); ``load_checkpoint`` first waits for pending saves on every
  rank and, if a save failed on any rank, refuses on every rank (rather than leaving the other
  ranks hanging in DeepSpeed's load collectives).
- DeepSpeed's in-place weight edits outside the optimizer step (the hybrid engine's LoRA
  fusion, ``zero.GatheredParameters`` with a ``modifier_rank``) fence first
  (:func:`patch_weight_editors`); ``save_16bit_model``, which calls the engine outside
  ``save_checkpoint``, has its file written before it returns.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import os
import socket
import sys
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed.utils import logger as ds_logger

from . import hf_trainer
from .core import (AsyncCheckpointer, CommitInfo, Replicas, by_rank, exchange_across_ranks,
                           only_durability)
from .commit import Pointer, check_name
from .config import CONFIG_KEY, AsyncCheckpointConfig
from .errors import CommitError, ConfigError, DurabilityError, describe
from .storage import aligned_size, temporary_path

ENGINE_NAME = "AsyncCheckpointEngine"
logger = logging.getLogger(__name__)

#: Top-level keys of DeepSpeed's model-states file whose tensors the training loop may change
#: outside the optimizer step; they are copied before ``save_checkpoint`` returns.
_DEEPSPEED_EAGER_KEYS = ("lr_scheduler", "data_sampler", "random_ltd", "ds_config")


def _log_commit(info: CommitInfo) -> None:
    """Rank 0, on the commit callbacks' thread: the commit in DeepSpeed's own log (its logger, its
    level), where its engine says a checkpoint "is about to be saved" and users look for
    when one is safe: ``[AsyncCheckpointEngine] checkpoint global_step100 committed: ...``."""
    ds_logger.info(f"[{ENGINE_NAME}] {info}")


class AsyncCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint-engine contract, delegating every stage to the core."""

    def __init__(self, config_params: Any, async_config: AsyncCheckpointConfig, *,
                 zero_stage: Any = None, has_moe_layers: bool = False) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME
        initialized = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if initialized else 1
        self._node_local = bool(getattr(config_params, "use_node_local_storage", False))
        if self._node_local and world_size > 1:
            check_node_local(True, world_size, _ranks_on_this_node(world_size))
        self.checkpointer = AsyncCheckpointer(
            async_config, rank=dist.get_rank() if initialized else 0, world_size=world_size,
            on_commit=_log_commit)
        patch_weight_editors()
        hf_trainer.check_installed()
        # Every data-parallel replica saves the model-states file and writes a share of it
        # (ZeRO-3 has one model-states file per rank; MoE's expert files follow other rules;
        # node-local storage gives each node its own copy). Unknown stage: not split.
        self.split = (async_config.split_replicated_files and not async_config.zip_crc32
                      and zero_stage is not None and int(zero_stage) < 3 and not has_moe_layers
                      and not self._node_local)
        self._ds_engine: Any = None  # the DeepSpeedEngine saving now (begin_save .. end_save)
        self._replicated: str | None = None  # that save's model-states file, held by every replica
        self._eager_keys: tuple[str, ...] = _DEEPSPEED_EAGER_KEYS
        self._buffers: list[torch.Tensor] = []  # the model's: a forward may update them
        self._reserved = False  # the host pool was sized after the first optimizer step
        self._held: Exception | None = None  # sync mode: this save's first write error
        self.reservation: threading.Thread | None = None
        """The thread faulting the host pool in after the first optimizer step, if any."""

    # DeepSpeed's contract -------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        # the tag names the checkpoint's directory in save_dir, and `latest` holds it: "a/b"
        # or "../x" would put it elsewhere, "" make save_dir itself the checkpoint
        check_name(str(info.tag), f"save_checkpoint(tag={info.tag!r})")
        if str(info.tag) in POINTER_NAMES:  # the save would replace the pointer with a directory
            raise ValueError(f"save_checkpoint(tag={info.tag!r}): the name of DeepSpeed's pointer file "
                             f"in save_dir ({', '.join(POINTER_NAMES)}) cannot name a checkpoint")
        if self._ds_engine is None:  # not inside save_checkpoint: save_16bit_model (see save)
            return
        pointer = Pointer(os.path.join(info.save_dir, "latest"), info.tag) if info.save_latest else None
        # save_latest=False keeps a checkpoint aside (a "best" model): out of keep_last's rotation
        self.checkpointer.begin(os.path.join(info.save_dir, info.tag), tag=info.tag, pointer=pointer,
                                rotation=info.save_latest)
        self._replicated = None
        ds = self._ds_engine
        if ds is not None and not self._node_local and not ds.zero_optimization_partition_weights() \
                and not getattr(ds, "has_moe_layers", False):
            self._replicated = os.path.abspath(ds._get_ckpt_name(info.save_dir, info.tag))

    def save(self, state_dict: Any, path: str) -> None:
        if self._ds_engine is None:
            self._save_now(state_dict, path)
            return
        replicas = None
        if self._replicated is not None and os.path.abspath(path) == self._replicated:
            replicas = data_parallel_replicas()
            if not self.split:
                if replicas.rank != 0:  # DeepSpeed's rule: the first replica writes it
                    return
                replicas = None
            else:
                state_dict = with_rank0_shared_params(state_dict, self._ds_engine, replicas)
        try:
            self.checkpointer.save(state_dict, path, eager_keys=self._eager_keys,
                                   eager_tensors=self._buffers, replicas=replicas)
        except Exception as exc:
            if not self.hold(exc):
                raise

    def hold(self, exc: Exception) -> bool:
        """Sync mode, inside ``save_checkpoint``: keep ``exc`` (a write of this save failed,
        or a step of DeepSpeed's own that runs on some ranks only) for :meth:`end_save`,
        which shares it, and return True. Raised at once, it would leave the other ranks in
        DeepSpeed's closing barrier for good. Async mode: False (raise it)."""
        if self.checkpointer.config.is_async or self._ds_engine is None:
            return False
        self._held = self._held or exc
        return True

    def _save_now(self, state_dict: Any, path: str) -> None:
        """A file DeepSpeed writes through this engine outside ``save_checkpoint``:
        ``save_16bit_model`` (DeepSpeed's 16-bit weights export), whose caller reads, converts or
        uploads the file as soon as the call returns, and which is no checkpoint (one file in
        a directory of the caller's, no tag, no ``latest``). Written before this returns, as
        DeepSpeed's own engine does, whole or not at all: a temporary file, fsynced (with
        ``fsync``), renamed. Before, it opened a checkpoint that nothing ended: the file was
        never written and the next ``save_checkpoint`` raised."""
        storage = self.checkpointer.storage
        tmp = temporary_path(path, os.getpid())
        try:
            with open(tmp, "wb") as f:
                torch.save(state_dict, f)
                if self.checkpointer.config.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            storage.replace(tmp, path, durable=self.checkpointer.config.fsync)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return self.split or dp_rank == 0

    def load(self, path: str, map_location: Any = None) -> Any:
        return self.checkpointer.load(path, map_location=map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        # our commit stage runs in the background once every rank persisted (outside
        # save_checkpoint, _save_now's file is durable already)
        return True

    def is_decoupled(self) -> bool:
        return True

    def get_commit_info(self) -> None:
        return None  # so DeepSpeed never writes `latest` before the data is durable

    def preserves_storage_sharing(self) -> bool:
        return False  # the snapshot makes its own compact copies

    def cleanup(self) -> None:
        self.checkpointer.close()

    # Our hooks, called by the patched DeepSpeedEngine methods ---------------------------
    def begin_save(self, ds_engine: Any, client_state: dict | None) -> None:
        self._ds_engine = ds_engine
        self._eager_keys = _DEEPSPEED_EAGER_KEYS + tuple(client_state or ())
        # Buffers change outside the optimizer step, in the forward that follows the save
        # (BatchNorm's running statistics), so the copier may not get to them first.
        module = getattr(ds_engine, "module", None)
        self._buffers = list(module.buffers()) if isinstance(module, torch.nn.Module) else []

    def end_save(self, ok: bool) -> None:
        held, self._held = self._held, None
        self._ds_engine = self._replicated = None
        self._buffers = []
        if not self.checkpointer.is_open:
            return
        if ok and not self.checkpointer.config.is_async:
            self._end_sync(held)
            return
        if held is not None:  # DeepSpeed raised after it (its own error goes up)
            logger.error("async checkpoint: a file of this save failed first: %s", held)
        self.checkpointer.end(commit=ok)

    def _end_sync(self, held: Exception | None) -> None:
        """Sync mode, DeepSpeed's ``save_checkpoint`` done on this rank and so on every rank
        (its last step is a barrier): end the checkpoint (rank 0 commits it), then share the
        outcome in one exchange. Every rank returns once the checkpoint is committed, or raises
        if it is not: a rank whose write failed its own error, the others naming it. Before,
        the failing rank raised inside DeepSpeed's save and the others waited in its barrier
        for good, and ranks other than 0 returned before rank 0 had committed."""
        error: BaseException | None = held
        try:
            self.checkpointer.end(commit=held is None)  # a failed file: abandoned
        except BaseException as exc:  # Ctrl-C too: the other ranks are in the exchange
            error = error or exc
        _, failed = exchange_across_ranks("", None if error is None else
                                          f"{type(error).__name__}: {describe(error)}")
        if error is not None:
            raise error
        if failed:  # end() put this save last in the history, raising or not
            tag = self.checkpointer.history[-1].tag
            if only_durability(failed):
                raise DurabilityError(f"checkpoint {tag}'s commit did not complete, because of "
                                      f"rank(s) {by_rank(failed)}")
            raise CommitError(f"checkpoint {tag} was not committed (the last committed one is "
                              f"intact), because of rank(s) {by_rank(failed)}")

    def before_optimizer_step(self) -> None:
        self.checkpointer.fence()

    def after_optimizer_step(self, ds_engine: Any) -> None:
        if self._reserved:
            return
        self._reserved = True
        try:
            share = 1.0 / data_parallel_replicas().size if self.split else 1.0
            nbytes = checkpoint_bytes_estimate(ds_engine, model_share=share)
        except Exception as exc:  # an optimizer we cannot walk: the first save allocates
            logger.warning("async checkpoint: not sizing the host pool ahead of the first save: "
                           "%s: %s", type(exc).__name__, exc)
            return
        self.reservation = self.checkpointer.reserve(nbytes)


def data_parallel_replicas() -> Replicas:
    """This rank among the data-parallel replicas of its model-states file: DeepSpeed's
    (sequence-)data-parallel group, whose ranks ``is_data_parallel_writer`` is asked about."""
    from deepspeed.utils import groups

    return Replicas(rank=groups._get_sequence_data_parallel_rank(),
                    size=groups._get_sequence_data_parallel_world_size(),
                    group=groups._get_sequence_data_parallel_group())


def with_rank0_shared_params(state_dict: Any, ds_engine: Any, replicas: Replicas) -> Any:
    """The model-states ``state_dict`` of a replica of global rank 0 with ``shared_params`` as
    rank 0 has it. DeepSpeed lists tied parameters (``_get_shared_params``) on global rank 0
    only, so with any tied weight (tied embeddings) the replicas' files differed and the first
    replica wrote the file alone (found by a Trainer run of GPT-2). Computed here as DeepSpeed
    computes it, without ZeRO-3 (no shares there); if it still differs from rank 0's, the
    replicas' digests say so and the first replica writes the file alone, as before."""
    if not isinstance(state_dict, dict) or state_dict.get("shared_params") != {} \
            or dist.get_rank() == 0 or dist.get_global_rank(replicas.group or dist.group.WORLD, 0) != 0:
        return state_dict
    shared: dict[str, str] = {}
    first_name: dict[int, str] = {}

    def walk(module: torch.nn.Module, prefix: str) -> None:  # DeepSpeed's order, dict included
        for name, param in module.named_parameters(recurse=False):
            if param is None:
                continue
            if param.data_ptr() in first_name:
                shared[prefix + name] = first_name[param.data_ptr()]
            else:
                first_name[param.data_ptr()] = prefix + name
        for name, child in module.named_children():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(ds_engine.module, "")
    return dict(state_dict, shared_params=shared) if shared else state_dict


def checkpoint_bytes_estimate(ds_engine: Any, model_share: float = 1.0) -> int:
    """Host pool bytes this rank's DeepSpeed checkpoint needs, from the live state: module
    parameters and buffers where this rank writes the model-states file (``model_share`` of
    them where the replicas split it, plus its largest tensor, since shares end between
    tensors), and the tensors of the optimizer chain (``engine.optimizer`` and the wrapped
    ``.optimizer``s: their states and parameter groups, which hold ZeRO's fp32 partitions)
    where it writes the optimizer state (ZeRO files, or the model-states file without ZeRO;
    also shared then). Each tensor view counts once, rounded up to whole pages as the pool
    holds it. An estimate: it sizes the host pool ahead of the first save, nothing else."""
    seen: set[tuple] = set()
    sizes: dict[str, list[int]] = {"model": [], "zero": []}

    def add(t: Any, part: str) -> None:
        # (a sparse or nested tensor's parts are copied at save time, outside the pool)
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.layout == torch.strided \
                and not t.is_nested:
            key = (t.data_ptr(), t.numel(), t.dtype)
            if key not in seen:
                seen.add(key)
                sizes[part].append(aligned_size(t.numel() * t.element_size()))

    writes_model = getattr(ds_engine, "save_non_zero_checkpoint", True)
    zero = getattr(ds_engine, "zero_optimization", lambda: False)()
    module = getattr(ds_engine, "module", None)
    if writes_model and isinstance(module, torch.nn.Module):
        for t in itertools.chain(module.parameters(), module.buffers()):
            add(t, "model")
    if getattr(ds_engine, "save_zero_checkpoint", False) if zero else writes_model:
        opt, visited = getattr(ds_engine, "optimizer", None), set()
        while opt is not None and id(opt) not in visited:
            visited.add(id(opt))
            if isinstance(opt, torch.optim.Optimizer):
                part = "zero" if zero else "model"  # without ZeRO: in the model-states file
                for state in opt.state.values():
                    for value in state.values():
                        add(value, part)
                for group in opt.param_groups:
                    for p in group["params"]:
                        add(p, part)
            opt = getattr(opt, "optimizer", None)
    model = sum(sizes["model"])
    if model_share < 1.0:
        model = min(model, int(model * model_share) + max(sizes["model"], default=0))
    return model + sum(sizes["zero"])


def check_node_local(node_local: bool, world_size: int, local_world_size: int) -> None:
    """``ConfigError`` for DeepSpeed's node-local storage across nodes: rank 0 commits from
    every rank's record in the checkpoint directory, which it cannot see on another node's
    disk (the commit would wait ``commit_timeout_s`` and fail every save). On one node, a
    node-local directory is everyone's."""
    if node_local and world_size > local_world_size:
        raise ConfigError(
            f"checkpoint.use_node_local_storage is not supported with async_checkpoint across "
            f"nodes ({world_size} ranks, {local_world_size} per node): rank 0 commits from every "
            "rank's record in the checkpoint directory, which must be one filesystem all ranks "
            "see; turn one of the two off")


#: Ranks per node, as launchers say it: torchrun, DeepSpeed's own launcher, Open MPI, Slurm.
_LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                         "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def _ranks_on_this_node(world_size: int) -> int:
    """Collective: how many ranks share this rank's node. Host names (all-gathered: every
    launcher, or none) and the innermost launcher's variable (the first set, in the order of
    :data:`_LOCAL_SIZE_VARIABLES`: torchrun under srun sets its own for its children) count;
    the smaller wins, so ranks on two nodes are seen as such if either says so (containers
    may share a host name)."""
    hosts: list[Any] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    local = hosts.count(hosts[dist.get_rank()])
    for name in _LOCAL_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return min(local, int(value))
    return local


def use_checkpoint_engine(ds_engine: Any, checkpoint_engine: Any) -> None:
    """Swap the checkpoint engine of a live ``DeepSpeedEngine`` (benchmarks and tests compare
    engines in one process): sets ``save_non_zero_checkpoint`` from the new engine's
    ``is_data_parallel_writer`` as ``deepspeed.initialize`` does, so that, e.g., DeepSpeed's
    own engine is not handed the model states on every replica after this one."""
    from deepspeed.utils import groups

    ds_engine.checkpoint_engine = checkpoint_engine
    if not ds_engine.zero_optimization_partition_weights():
        rank = ds_engine.local_rank if ds_engine.use_node_local_storage() \
            else groups._get_sequence_data_parallel_rank()
        ds_engine.save_non_zero_checkpoint = bool(checkpoint_engine.is_data_parallel_writer(rank))


POINTER_NAMES = ("latest", "latest_universal")
"""DeepSpeed's pointer files in a save directory: ``latest``, and ``ds_to_universal``'s."""


def checkpoint_to_load(arguments: dict, latest: str = "latest") -> str | None:
    """The directory ``load_checkpoint(load_dir, tag=None, ...)`` will read: ``load_dir/tag``,
    with the tag from ``load_dir/<latest>`` when none is given (as DeepSpeed reads it); None
    when there is no tag (DeepSpeed then loads nothing)."""
    load_dir, tag = arguments.get("load_dir"), arguments.get("tag")
    if load_dir is None:
        return None
    if tag is None:
        try:
            with open(os.path.join(load_dir, latest), encoding="utf-8") as f:
                tag = f.read().strip()
        except FileNotFoundError:
            return None
    return os.path.join(load_dir, str(tag))


def is_optimizer_file(rel: str) -> bool:
    """Whether a file of a DeepSpeed checkpoint (its path in it) holds optimizer state under
    ZeRO (``*optim_states.pt``: the fp32 partitions and the optimizer's moments)."""
    return os.path.basename(rel).endswith("optim_states.pt")


def agreed_latest_tag(checkpointer: Any, load_dir: str, latest: str = "latest") -> str | None:
    """Collective: the tag ``load_dir/<latest>`` names as rank 0 read it (None: there is no such
    file), the same on every rank. A rank that cannot read its own copy (not UTF-8, a
    directory) makes every rank raise, as does an empty one: DeepSpeed raises there too, where
    "no checkpoint" would let a script start over from scratch."""
    path = os.path.join(load_dir, latest)
    error = None
    try:
        with open(path, encoding="utf-8") as f:
            mine = "+" + f.read().strip()  # "+": the file is there, "" : it is not
    except FileNotFoundError:
        mine = ""
    except (OSError, ValueError) as exc:
        mine, error = "", f"cannot read {path}: {exc}"
    value, failed = checkpointer._exchange(mine, error)
    if failed:
        raise CommitError(f"load_checkpoint refused on every rank: {failed[min(failed)]} (rank(s) "
                          f"{by_rank(failed)})")
    if value == "+":
        raise CommitError(f"load_checkpoint refused on every rank: {path} is empty (on rank 0): it "
                          "names no checkpoint")
    return value[1:] or None


def takes_module_from_latest(ds_engine: Any, arguments: dict) -> bool:
    """Whether this load rebuilds the module from the checkpoint ``latest`` names, whichever
    the tag (see :func:`zero3_module_source`): the same answer on every rank."""
    partitioned = getattr(ds_engine, "zero_optimization_partition_weights", None)
    return not (arguments.get("tag") is None or arguments.get("load_optimizer_states", True)
                or getattr(ds_engine, "has_moe_layers", False) or not callable(partitioned)
                or not partitioned())


def zero3_module_source(ds_engine: Any, arguments: dict) -> str | None:
    """The checkpoint DeepSpeed will take the module's weights from when that is not the one
    asked for, else None: under ZeRO-3 (without MoE), ``load_checkpoint(load_dir, tag=X,
    load_optimizer_states=False)`` rebuilds the module with
    ``get_fp32_state_dict_from_zero_checkpoint(load_dir)``, which reads the optimizer files of
    the checkpoint ``latest`` names, not X's (DeepSpeed's own engine does the same). Every
    rank gets the same answer (one ``latest`` file); an unreadable ``latest`` gives None
    (DeepSpeed's own read of it reports that)."""
    if not takes_module_from_latest(ds_engine, arguments):
        return None
    try:
        asked, latest = checkpoint_to_load(arguments), checkpoint_to_load(dict(arguments, tag=None))
    except (OSError, ValueError) as exc:  # not UTF-8, a directory, unreadable
        logger.debug("async checkpoint: cannot read %s's latest: %s", arguments.get("load_dir"), exc)
        return None
    if asked is None or latest is None or os.path.abspath(asked) == os.path.abspath(latest):
        return None
    return latest


def files_read_by_load(ds_engine: Any, arguments: dict) -> Callable[[str], bool] | None:
    """Which files of a checkpoint ``load_checkpoint`` will read, as DeepSpeed decides it
    (``DeepSpeedEngine.load_checkpoint``): under ZeRO, the optimizer files
    (``*optim_states.pt``) only when optimizer states are loaded (or for a universal
    checkpoint; under ZeRO-3, also for MoE and for a load without optimizer states, which
    rebuilds the module from the fp32 partitions in the optimizer files). A fine-tuning load
    with ``load_optimizer_states=False`` under ZeRO-1/2 then hashes the model states (2 bytes
    per parameter in bf16) and not the optimizer's 12. None: every file (without ZeRO the
    model-states file holds the optimizer state too)."""
    def asks(name: str) -> bool:
        method = getattr(ds_engine, name, None)
        return bool(method()) if callable(method) else True  # unknown: as if it read them

    zero = getattr(ds_engine, "zero_optimization", None)
    if not callable(zero) or not zero() or asks("zero_nvme_offload_optimizer"):
        return None
    optimizer = arguments.get("load_optimizer_states", True) and not arguments.get("load_module_only", False)
    universal = getattr(ds_engine, "load_universal_checkpoint", lambda: False)()
    # Under ZeRO-3, a load without optimizer states takes the module from the fp32 partitions
    # of every rank's optimizer file (DeepSpeed's _load_checkpoint calls zero_to_fp32's
    # get_fp32_state_dict_from_zero_checkpoint, with plain torch.load), and MoE loads read them
    zero3_reads = asks("zero_optimization_partition_weights") and (
        getattr(ds_engine, "has_moe_layers", False) or not arguments.get("load_optimizer_states", True))
    if optimizer or universal or zero3_reads:
        return None
    return lambda rel: not is_optimizer_file(rel)


def parse_config(param_dict: dict | None) -> AsyncCheckpointConfig | None:
    """The validated config, or None when the key is absent or disabled."""
    raw = (param_dict or {}).get(CONFIG_KEY)
    if raw is None:
        return None
    cfg = AsyncCheckpointConfig.from_dict(raw)
    if not cfg.enabled:
        return None
    # DeepSpeed's own ways to choose a checkpoint engine: one of them would be ignored
    chosen = {"checkpoint.writer": (param_dict.get("checkpoint") or {}).get("writer") is not None,
              "datastates_ckpt": param_dict.get("datastates_ckpt", False) is not False}
    others = [key for key, on in chosen.items() if on]
    if others:
        raise ConfigError(f"{CONFIG_KEY} and {' and '.join(others)} both choose DeepSpeed's checkpoint "
                          f"engine: keep one of them ({CONFIG_KEY}.enabled: false keeps DeepSpeed's)")
    return cfg


# Patching -------------------------------------------------------------------------------
_ORIGINALS: dict[str, Any] = {}


def install() -> bool:
    """Patch DeepSpeed so the config key takes effect, and adapt transformers' Trainer (see
    :mod:`.hf_trainer`; now, or when it is imported). Idempotent; returns True if it patched
    DeepSpeed."""
    import deepspeed.runtime.engine as ds_engine

    hf_trainer.install()
    if _ORIGINALS:
        return False
    engine_cls = ds_engine.DeepSpeedEngine
    _ORIGINALS.update(create=ds_engine.create_checkpoint_engine,
                      step=engine_cls._take_model_step,
                      save=engine_cls.save_checkpoint,
                      load=engine_cls.load_checkpoint)

    create_sig = inspect.signature(_ORIGINALS["create"])

    @functools.wraps(_ORIGINALS["create"])
    def create_checkpoint_engine(config_params=None, *args, **kwargs):
        cfg = parse_config(getattr(config_params, "_param_dict", None))
        if cfg is None:
            return _ORIGINALS["create"](config_params, *args, **kwargs)
        given = create_sig.bind_partial(config_params, *args, **kwargs).arguments
        return AsyncCheckpointEngine(config_params, cfg, zero_stage=given.get("zero_stage"),
                                     has_moe_layers=given.get("has_moe_layers", False))

    @functools.wraps(_ORIGINALS["step"])
    def _take_model_step(self, *args, **kwargs):
        engine = getattr(self, "checkpoint_engine", None)
        if not isinstance(engine, AsyncCheckpointEngine):
            return _ORIGINALS["step"](self, *args, **kwargs)
        engine.before_optimizer_step()
        result = _ORIGINALS["step"](self, *args, **kwargs)
        engine.after_optimizer_step(self)
        return result

    save_sig = inspect.signature(_ORIGINALS["save"])
    load_sig = inspect.signature(_ORIGINALS["load"])

    @functools.wraps(_ORIGINALS["save"])
    def save_checkpoint(self, *args, **kwargs):
        engine = getattr(self, "checkpoint_engine", None)
        if not isinstance(engine, AsyncCheckpointEngine):
            return _ORIGINALS["save"](self, *args, **kwargs)
        bound = save_sig.bind(self, *args, **kwargs)
        engine.begin_save(self, bound.arguments.get("client_state"))
        ok = False
        try:
            result = _ORIGINALS["save"](self, *args, **kwargs)
            ok = True
            return result
        finally:
            engine.end_save(ok)

    @functools.wraps(_ORIGINALS["load"])
    def load_checkpoint(self, *args, **kwargs):
        engine = getattr(self, "checkpoint_engine", None)
        if isinstance(engine, AsyncCheckpointEngine):
            arguments = load_sig.bind(self, *args, **kwargs).arguments
            # `latest` must reflect every save issued so far; collective, so that a failed save
            # stops the load on every rank, not only on the one whose background write failed.
            engine.checkpointer.wait_all_ranks(action="load_checkpoint",
                                               recover=arguments.get("load_dir"))
            universal = getattr(self, "load_universal_checkpoint", lambda: False)()
            latest = "latest_universal" if universal else "latest"
            if arguments.get("tag") is None and arguments.get("load_dir") is not None:
                # One read of `latest` for every rank, rank 0's, passed to DeepSpeed as the tag:
                # each rank reading it (and DeepSpeed again) could disagree when another job
                # writes its first `latest` meanwhile, and the ranks then part ways in
                # DeepSpeed's collectives.
                tag = agreed_latest_tag(engine.checkpointer, arguments["load_dir"], latest)
                if tag is None:  # as DeepSpeed says and does, on every rank
                    path = os.path.join(arguments["load_dir"], latest)
                    if universal:
                        raise ValueError(f"Invalid for universal checkpoint: {path} does not exist")
                    logger.warning(f"Unable to find latest file at {path}, if trying to load latest "
                                   "checkpoint please ensure this file exists or pass an explicit "
                                   "checkpoint tag when loading a checkpoint.")
                    return None, None
                bound = load_sig.bind(self, *args, **kwargs)
                bound.arguments["tag"] = tag
                args, kwargs = bound.args[1:], bound.kwargs
                arguments = bound.arguments
                from_latest = True
            else:
                from_latest = False
            module_source = zero3_module_source(self, arguments) if not from_latest else None
            if module_source is not None and engine.checkpointer.rank == 0:
                logger.warning("async checkpoint: load_checkpoint(tag=%r, load_optimizer_states="
                               "False) under ZeRO-3: DeepSpeed takes the module's weights from the "
                               "optimizer files of %s (the checkpoint `latest` names), the other "
                               "states from %s", arguments["tag"], module_source,
                               checkpoint_to_load(arguments))
            # Every file the load reads checked once, across the ranks; with verify_on_load off,
            # none, but the checkpoint still must be committed (on every rank together: one
            # rank failing alone inside DeepSpeed's load leaves the others in its collectives)
            verify = engine.checkpointer.config.verify_on_load
            ckpt_dir = checkpoint_to_load(arguments, latest)  # the tag is given now, or no load_dir
            engine.checkpointer.verify_all_ranks(
                ckpt_dir, action="load_checkpoint",
                include=files_read_by_load(self, arguments) if verify else _no_file)
            if not from_latest and takes_module_from_latest(self, arguments):
                # and the optimizer files the module comes from; on every rank alike (None:
                # none to check there, or not readable), so that none is left in the exchange
                engine.checkpointer.verify_all_ranks(
                    module_source, action="load_checkpoint",
                    include=is_optimizer_file if verify else _no_file)
            # a checkpoint saved again under it mid-load: every rank raises at the end, together
            with engine.checkpointer.collective_load("load_checkpoint"):
                return _ORIGINALS["load"](self, *args, **kwargs)
        return _ORIGINALS["load"](self, *args, **kwargs)

    recovery = getattr(engine_cls, "_copy_recovery_script", None)
    if recovery is not None:
        _ORIGINALS["recovery"] = recovery

        @functools.wraps(recovery)
        def _copy_recovery_script(self, *args, **kwargs):
            # rank 0 alone copies zero_to_fp32.py into the checkpoint: a failure there (the
            # disk that just failed our writes) must not leave the others in the barrier
            try:
                return recovery(self, *args, **kwargs)
            except Exception as exc:
                engine = getattr(self, "checkpoint_engine", None)
                if not (isinstance(engine, AsyncCheckpointEngine) and engine.hold(exc)):
                    raise

        engine_cls._copy_recovery_script = _copy_recovery_script
    ds_engine.create_checkpoint_engine = create_checkpoint_engine
    engine_cls._take_model_step = _take_model_step
    engine_cls.save_checkpoint = save_checkpoint
    engine_cls.load_checkpoint = load_checkpoint
    return True


def _no_file(rel: str) -> bool:
    """``include`` for a check of the manifest alone (``verify_on_load`` off)."""
    return False


#: DeepSpeed's methods that change weights in place outside the optimizer step, patched to
#: fence first (see :func:`patch_weight_editors`): (owner, attribute) -> the original.
_EDITORS: dict[tuple[Any, str], Any] = {}


def patch_weight_editors() -> None:
    """Make DeepSpeed's own in-place weight edits outside the optimizer step fence first
    (:func:`~.core.fence_all`), so a save's lazy copies are done before them:

    - ``DeepSpeedHybridEngine._fuse_lora_layer``: ``generate()`` (RLHF rollouts) adds the
      LoRA product into the frozen base weights (``weight.data += scaling * A @ B``), then
      subtracts it, between a save and the next step; frozen weights are not rebuilt from
      the optimizer's fp32 copy on load, so the wrong value survived a resume;
    - ``zero.GatheredParameters.__enter__`` with a ``modifier_rank``: the documented way to
      change ZeRO-3 parameters outside the step.

    Idempotent; called when an engine is built (DeepSpeed is fully imported by then)."""
    if _EDITORS:
        return
    from .core import fence_all

    targets = []
    try:
        from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine
        targets.append((DeepSpeedHybridEngine, "_fuse_lora_layer", lambda *a, **k: True))
    except ImportError:  # a DeepSpeed without it
        pass
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    targets.append((GatheredParameters, "__enter__",
                    lambda self, *a, **k: getattr(self, "enabled", True)
                    and getattr(self, "src_rank", None) is not None))
    for owner, name, edits in targets:
        original = getattr(owner, name, None)
        if original is None:
            continue

        def fenced(*args, _original=original, _edits=edits, **kwargs):
            if _edits(*args, **kwargs):
                fence_all()
            return _original(*args, **kwargs)

        _EDITORS[(owner, name)] = original
        setattr(owner, name, functools.wraps(original)(fenced))


def unpatch_weight_editors() -> None:
    """Undo :func:`patch_weight_editors` (tests)."""
    for (owner, name), original in _EDITORS.items():
        setattr(owner, name, original)
    _EDITORS.clear()


def uninstall() -> None:
    """Undo :func:`install` and :func:`patch_weight_editors` (tests)."""
    import deepspeed.runtime.engine as ds_engine

    unpatch_weight_editors()
    hf_trainer.uninstall()
    if not _ORIGINALS:
        return
    engine_cls = ds_engine.DeepSpeedEngine
    ds_engine.create_checkpoint_engine = _ORIGINALS["create"]
    engine_cls._take_model_step = _ORIGINALS["step"]
    engine_cls.save_checkpoint = _ORIGINALS["save"]
    engine_cls.load_checkpoint = _ORIGINALS["load"]
    if "recovery" in _ORIGINALS:
        engine_cls._copy_recovery_script = _ORIGINALS["recovery"]
    _ORIGINALS.clear()


def is_installed() -> bool:
    return bool(_ORIGINALS)


def _install_if_deferred() -> None:
    # DeepSpeed's engine module finished importing while this module was importing it.
    autoload = sys.modules.get("deepspeed_async_ckpt_autoload")
    if autoload is not None and autoload.install_when_ready:
        autoload.install_when_ready = False
        install()


_install_if_deferred()
