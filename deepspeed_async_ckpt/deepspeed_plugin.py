"""DeepSpeed adapter: a ``CheckpointEngine`` over :class:`AsyncCheckpointer`, and the patches
that select it from the ``"async_checkpoint"`` config key.

It holds no I/O logic. What it translates (see ``shared/notes/deepspeed.md``, checked against
DeepSpeed 0.19.8):

- ``create_checkpoint_engine`` is imported by name into ``deepspeed.runtime.engine``; we replace
  that name, so our engine is built when the key is present and enabled, and DeepSpeed's own
  engine otherwise (behaviour unchanged).
- The engine is *decoupled* with no commit info, so DeepSpeed never writes ``latest`` itself;
  our commit stage does, once every rank persisted.
- ``DeepSpeedEngine._take_model_step`` (which the pipeline engine also uses) gets a fence
  before the optimizer step: the only point where training waits for outstanding copies.
- ``save_checkpoint`` is wrapped to seal the checkpoint when DeepSpeed's save returns and to
  freeze ``client_state`` eagerly; ``load_checkpoint`` first waits for pending saves on every
  rank and, if a save failed on any rank, refuses on every rank (rather than leaving the other
  ranks hanging in DeepSpeed's load collectives).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any

import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from .checkpointer import AsyncCheckpointer
from .commit import Pointer
from .config import CONFIG_KEY, AsyncCheckpointConfig

ENGINE_NAME = "AsyncCheckpointEngine"

#: Top-level keys of DeepSpeed's model-states file whose tensors the training loop may change
#: outside the optimizer step; they are copied before ``save_checkpoint`` returns.
_DEEPSPEED_EAGER_KEYS = ("lr_scheduler", "data_sampler", "random_ltd", "ds_config")


class AsyncCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint-engine contract, delegating every stage to the core."""

    def __init__(self, config_params: Any, async_config: AsyncCheckpointConfig) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME
        initialized = dist.is_available() and dist.is_initialized()
        self.checkpointer = AsyncCheckpointer(
            async_config,
            rank=dist.get_rank() if initialized else 0,
            world_size=dist.get_world_size() if initialized else 1)
        self._eager_keys: tuple[str, ...] = _DEEPSPEED_EAGER_KEYS

    # DeepSpeed's contract -------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        pointer = Pointer(os.path.join(info.save_dir, "latest"), info.tag) if info.save_latest else None
        self.checkpointer.begin(os.path.join(info.save_dir, info.tag), tag=info.tag, pointer=pointer)

    def save(self, state_dict: Any, path: str) -> None:
        self.checkpointer.save(state_dict, path, eager_keys=self._eager_keys)

    def load(self, path: str, map_location: Any = None) -> Any:
        return self.checkpointer.load(path, map_location=map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True  # our commit stage runs in the background once every rank persisted

    def is_decoupled(self) -> bool:
        return True

    def get_commit_info(self) -> None:
        return None  # so DeepSpeed never writes `latest` before the data is durable

    def preserves_storage_sharing(self) -> bool:
        return False  # the snapshot makes its own compact copies

    def cleanup(self) -> None:
        self.checkpointer.close()

    # Our hooks, called by the patched DeepSpeedEngine methods ---------------------------
    def begin_save(self, client_state: dict | None) -> None:
        self._eager_keys = _DEEPSPEED_EAGER_KEYS + tuple(client_state or ())

    def end_save(self, ok: bool) -> None:
        if self.checkpointer.is_open:
            self.checkpointer.end(commit=ok)

    def before_optimizer_step(self) -> None:
        self.checkpointer.fence()


def parse_config(param_dict: dict | None) -> AsyncCheckpointConfig | None:
    """The validated config, or None when the key is absent or disabled."""
    raw = (param_dict or {}).get(CONFIG_KEY)
    if raw is None:
        return None
    cfg = AsyncCheckpointConfig.from_dict(raw)
    return cfg if cfg.enabled else None


# Patching -------------------------------------------------------------------------------
_ORIGINALS: dict[str, Any] = {}


def install() -> bool:
    """Patch DeepSpeed so the config key takes effect. Idempotent; returns True if it patched."""
    import deepspeed.runtime.engine as ds_engine

    if _ORIGINALS:
        return False
    engine_cls = ds_engine.DeepSpeedEngine
    _ORIGINALS.update(create=ds_engine.create_checkpoint_engine,
                      step=engine_cls._take_model_step,
                      save=engine_cls.save_checkpoint,
                      load=engine_cls.load_checkpoint)

    @functools.wraps(_ORIGINALS["create"])
    def create_checkpoint_engine(config_params=None, *args, **kwargs):
        cfg = parse_config(getattr(config_params, "_param_dict", None))
        if cfg is None:
            return _ORIGINALS["create"](config_params, *args, **kwargs)
        return AsyncCheckpointEngine(config_params, cfg)

    @functools.wraps(_ORIGINALS["step"])
    def _take_model_step(self, *args, **kwargs):
        engine = getattr(self, "checkpoint_engine", None)
        if isinstance(engine, AsyncCheckpointEngine):
            engine.before_optimizer_step()
        return _ORIGINALS["step"](self, *args, **kwargs)

    save_sig = inspect.signature(_ORIGINALS["save"])

    @functools.wraps(_ORIGINALS["save"])
    def save_checkpoint(self, *args, **kwargs):
        engine = getattr(self, "checkpoint_engine", None)
        if not isinstance(engine, AsyncCheckpointEngine):
            return _ORIGINALS["save"](self, *args, **kwargs)
        bound = save_sig.bind(self, *args, **kwargs)
        engine.begin_save(bound.arguments.get("client_state"))
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
            # `latest` must reflect every save issued so far; collective, so that a failed save
            # stops the load on every rank, not only on the one whose background write failed.
            engine.checkpointer.wait_all_ranks(action="load_checkpoint")
        return _ORIGINALS["load"](self, *args, **kwargs)

    ds_engine.create_checkpoint_engine = create_checkpoint_engine
    engine_cls._take_model_step = _take_model_step
    engine_cls.save_checkpoint = save_checkpoint
    engine_cls.load_checkpoint = load_checkpoint
    return True


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    import deepspeed.runtime.engine as ds_engine

    if not _ORIGINALS:
        return
    engine_cls = ds_engine.DeepSpeedEngine
    ds_engine.create_checkpoint_engine = _ORIGINALS["create"]
    engine_cls._take_model_step = _ORIGINALS["step"]
    engine_cls.save_checkpoint = _ORIGINALS["save"]
    engine_cls.load_checkpoint = _ORIGINALS["load"]
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
