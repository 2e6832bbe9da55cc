"""``AsyncCheckpointEngine``: DeepSpeed's ``CheckpointEngine`` contract over
:class:`~deepspeed_async_ckpt.core.AsyncCheckpointer`. It holds no I/O logic.

- The engine is *decoupled* with no commit info, so DeepSpeed never writes ``latest`` itself;
  the core's commit stage does, once every rank persisted.
- ``is_data_parallel_writer`` says yes for every data-parallel replica (without ZeRO-3, MoE or
  node-local storage), so each is handed the model-states file and writes a share of it
  (:class:`~deepspeed_async_ckpt.core.Replicas`); with ``split_replicated_files`` off,
  only the first replica writes it, as DeepSpeed's own engine does.
- :meth:`~AsyncCheckpointEngine.begin_save` / :meth:`~AsyncCheckpointEngine.end_save` and the
  optimizer-step hooks are called by the patched ``DeepSpeedEngine`` methods (:mod:`.patches`).
- With DeepSpeed's ``monitor_config`` enabled (TensorBoard, W&B, CSV, Comet), rank 0 writes
  each committed save's figures through the engine's own ``monitor.write_events`` at the
  global step it was saved at (:mod:`...core.figures`); nothing is attached otherwise.
- DeepSpeed saves its whole config (``ds_config``) into the model and optimizer states, and
  logs it: both get it without the tiers' credentials (:func:`~...tiers.config.without_credentials`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import threading
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed.utils import logger as ds_logger

from ...core import AsyncCheckpointer, CommitInfo, by_rank, exchange_across_ranks, outcome, what_stays
from ...core.figures import CommitFigures
from ...commit import Pointer, check_name
from ...config import AsyncCheckpointConfig
from ...errors import CommitError, DurabilityError
from ...memory.restore import laid_out
from ...storage import DIRECT_ALIGN, aligned_size, temporary_path
from ...tiers.config import without_credentials
from .loading import POINTER_NAMES
from .replicas import data_parallel_replicas, needs_node_local, ranks_on_this_node, with_rank0_shared_params
from .weight_editors import patch_weight_editors

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
        if isinstance(getattr(config_params, "_param_dict", None), dict):
            # what DeepSpeed logs once the engine is built (its parsed fields are read already)
            config_params._param_dict = without_credentials(config_params._param_dict)
        initialized = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if initialized else 1
        self.node_local = bool(getattr(config_params, "use_node_local_storage", False))
        """DeepSpeed's `checkpoint.use_node_local_storage`: each node saves to and loads from its own directory."""
        if self.node_local and world_size > 1 and not async_config.node_local \
                and needs_node_local(True, world_size, ranks_on_this_node(world_size)):
            # each node's directory is its own: commit on every node (see the config's key)
            async_config = dataclasses.replace(async_config, node_local=True)
        self.checkpointer = AsyncCheckpointer(
            async_config, rank=dist.get_rank() if initialized else 0, world_size=world_size,
            on_commit=_log_commit)
        patch_weight_editors()
        # Every data-parallel replica saves the model-states file and writes a share of it
        # (ZeRO-3 has one model-states file per rank; MoE's expert files follow other rules;
        # node-local storage gives each node its own copy; the memory tier's keeper holds
        # what its node's ranks load, whole). Unknown stage: not split.
        self.split = (async_config.split_replicated_files and not async_config.zip_crc32
                      and not async_config.memory.enabled
                      and zero_stage is not None and int(zero_stage) < 3 and not has_moe_layers
                      and not self.node_local)
        self._ds_engine: Any = None  # the DeepSpeedEngine saving now (begin_save .. end_save)
        self._replicated: str | None = None  # that save's model-states file, held by every replica
        self._eager_keys: tuple[str, ...] = _DEEPSPEED_EAGER_KEYS
        self._buffers: list[torch.Tensor] = []  # the model's: a forward may update them
        self._reserved = False  # the host pool was sized again after the first optimizer step
        self._held: Exception | None = None  # sync mode: this save's first write error
        self._figures: CommitFigures | None = None  # rank 0, DeepSpeed's monitor enabled
        self.reservation: threading.Thread | None = None
        """The thread faulting the host pool in (from :meth:`after_initialize`, or after the
        first optimizer step where that estimate fell short), if any."""

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
        if ds is not None and not self.node_local and not ds.zero_optimization_partition_weights() \
                and not getattr(ds, "has_moe_layers", False):
            self._replicated = os.path.abspath(ds._get_ckpt_name(info.save_dir, info.tag))

    def save(self, state_dict: Any, path: str) -> None:
        if isinstance(state_dict, dict) and "ds_config" in state_dict:  # the config as saved
            state_dict = {**state_dict, "ds_config": without_credentials(state_dict["ds_config"])}
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
        ``fsync``), renamed. It opens no checkpoint: nothing would end one."""
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

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        # a save to the memory keeper only makes nothing on disk: not its checkpoint directory
        if self.checkpointer.memory_only and _inside(path, self.checkpointer.dirs_in_use()):
            return
        os.makedirs(path, exist_ok=exist_ok)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return self.split or dp_rank == 0

    def load(self, path: str, map_location: Any = None) -> Any:
        if laid_out(path):  # a tmpfs copy of the keeper's, verified as it was laid out
            return torch.load(path, map_location=map_location, weights_only=False, mmap=True)
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
        if self._figures is None and self.checkpointer.rank == 0:
            monitor = getattr(ds_engine, "monitor", None)
            if getattr(monitor, "enabled", False):  # its writers exist on global rank 0 only
                self._figures = CommitFigures(monitor.write_events, self._global_step).attach(self.checkpointer)
        self._eager_keys = _DEEPSPEED_EAGER_KEYS + tuple(client_state or ())
        # Buffers change outside the optimizer step, in the forward that follows the save
        # (BatchNorm's running statistics), so the copier may not get to them first.
        module = getattr(ds_engine, "module", None)
        self._buffers = list(module.buffers()) if isinstance(module, torch.nn.Module) else []

    def _global_step(self, handle: Any) -> int | None:
        """The step a save begun inside ``save_checkpoint`` is reported at (a begin callback)."""
        return getattr(self._ds_engine, "global_steps", None)

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
        if it is not: a rank whose write failed its own error, the others naming it. Raised
        inside DeepSpeed's save instead, the failing rank would leave the others in its closing
        barrier for good."""
        error: BaseException | None = held
        try:
            self.checkpointer.end(commit=held is None)  # a failed file: abandoned
        except BaseException as exc:  # Ctrl-C too: the other ranks are in the exchange
            error = error or exc
        _, failed = outcome("save_checkpoint", None, error, exchange=exchange_across_ranks)
        if error is not None:
            raise error
        if failed is not None:  # end() put this save last in the history, raising or not
            handle = self.checkpointer.history[-1]
            if failed.only_durability:
                raise DurabilityError(f"checkpoint {handle.tag}'s commit did not complete, because of "
                                      f"rank(s) {by_rank(failed.failures)}") from failed
            raise CommitError(f"checkpoint {handle.tag} was not committed "
                              f"({what_stays(os.path.dirname(handle.ckpt_dir))}), because of rank(s) "
                              f"{by_rank(failed.failures)}") from failed

    def before_optimizer_step(self, ds_engine: Any = None) -> None:
        """The fence before DeepSpeed's optimizer step, which leaves frozen parameters alone:
        their copies go on in the background (a 1 GB frozen tensor's copy on the host would
        otherwise hold the step for its whole memcpy)."""
        module = getattr(ds_engine, "module", None)
        self.checkpointer.fence(functools.partial(frozen_parameters, module)
                                if isinstance(module, torch.nn.Module) else None)

    def after_initialize(self, ds_engine: Any) -> None:
        """DeepSpeed built the engine (its optimizer exists, the optimizer's state not yet):
        start faulting the host pool in now, sized from an estimate of the first save, so
        that a save soon after the first step finds it ready instead of waiting for it."""
        self._reserve(ds_engine)

    def after_optimizer_step(self, ds_engine: Any) -> None:
        if self._reserved:
            return
        self._reserved = True
        self._reserve(ds_engine)  # the state exists now: grows the pool only if it fell short

    def _reserve(self, ds_engine: Any) -> None:
        try:
            share = 1.0 / data_parallel_replicas().size if self.split else 1.0
            nbytes = checkpoint_bytes_estimate(ds_engine, model_share=share)
        except Exception as exc:  # an optimizer we cannot walk: the first save allocates
            logger.warning("async checkpoint: not sizing the host pool ahead of the first save: "
                           "%s: %s", type(exc).__name__, exc)
            return
        self.reservation = self.checkpointer.reserve(nbytes) or self.reservation


def frozen_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters of ``module`` that no optimizer step writes: those that do not require
    a gradient and share no storage with one that does (a flattened buffer holding both)."""
    frozen, trained = [], set()
    for p in module.parameters():
        if p.requires_grad:
            trained.add(p.untyped_storage().data_ptr())
        elif p.numel():
            frozen.append(p)
    return [p for p in frozen if p.untyped_storage().data_ptr() not in trained]


def checkpoint_bytes_estimate(ds_engine: Any, model_share: float = 1.0) -> int:
    """Host pool bytes this rank's DeepSpeed checkpoint needs, from the live state: module
    parameters and buffers where this rank writes the model-states file (``model_share`` of
    them where the replicas split it, plus its largest tensor, since shares end between
    tensors), and the tensors of the optimizer chain (``engine.optimizer`` and the wrapped
    ``.optimizer``s: their states and parameter groups, which hold ZeRO's fp32 partitions)
    where it writes the optimizer state (ZeRO files, or the model-states file without ZeRO;
    also shared then). Each tensor view counts once, rounded up to whole pages as the pool
    holds it. State an optimizer creates at its first step counts from its parameters (see
    :func:`_state_to_come`), so the estimate holds before the first step too. An estimate:
    it sizes the host pool ahead of the first save, nothing else."""
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
                        if not opt.state.get(p):
                            sizes[part] += _state_to_come(opt, group, p)
            opt = getattr(opt, "optimizer", None)
    model = sum(sizes["model"])
    if model_share < 1.0:
        model = min(model, int(model * model_share) + max(sizes["model"], default=0))
    return model + sum(sizes["zero"])


def _state_to_come(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> list[int]:
    """Pool bytes of the state ``opt`` will keep for parameter ``p`` from its first step on,
    tensor by tensor: Adam's family (``betas`` in the group: torch's Adam and AdamW,
    DeepSpeed's fused and CPU Adam, Lamb) two moments shaped as ``p`` (a third with
    ``amsgrad``), and torch's own Adam a ``step`` tensor (one page in the pool); SGD with
    momentum or RMSprop one buffer. Other optimizers: none (the first optimizer step's
    estimate then corrects it)."""
    one = aligned_size(p.numel() * p.element_size())
    if "betas" in group:
        moments = 3 if group.get("amsgrad") else 2
        step = [DIRECT_ALIGN] if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) else []
        return [one] * moments + step
    if group.get("momentum") or "alpha" in group:
        return [one]
    return []


def _inside(path: str, dirs: set[str]) -> bool:
    """Whether ``path`` is one of ``dirs`` or lies in one."""
    path = os.path.abspath(path)
    return any(path == d or path.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)
