"""What is patched on DeepSpeed so the ``"async_checkpoint"`` config key takes effect, checked
against DeepSpeed 0.19.8's sources:

- ``create_checkpoint_engine`` is imported by name into ``deepspeed.runtime.engine``; that name
  is replaced, so :class:`~.engine.AsyncCheckpointEngine` is built when the key is present and
  enabled, and DeepSpeed's own engine otherwise (behaviour unchanged).
- ``DeepSpeedEngine._take_model_step`` (which the pipeline engine also uses) gets a fence
  before the optimizer step: the only point where training waits for outstanding copies.
- ``DeepSpeedEngine._configure_checkpointing`` (the end of ``deepspeed.initialize``'s setup,
  the optimizer built) drops the tiers' credentials from the engine's raw and parsed config
  (which it logs and saves), whichever checkpoint engine it built (:func:`forget_credentials`),
  and, with this engine, starts faulting the host pool in, in the background, sized from an
  estimate of this rank's share of the state; after the first step (when the optimizer state
  exists) the estimate is made again and the pool grown if it fell short.
- ``save_checkpoint`` is wrapped to refuse a ``save_dir`` that a tier is, contains or lies
  inside (before anything is written), to seal the checkpoint when DeepSpeed's save returns and to
  freeze ``client_state`` eagerly (in sync mode it also holds a failed write, and rank 0's
  failed copy of ``zero_to_fp32.py``, until DeepSpeed's closing barrier, then shares the
  outcome so that every rank raises or returns committed); ``load_checkpoint`` first waits
  for pending saves on every rank and, if a save failed on any rank, refuses on every rank
  (rather than leaving the other ranks hanging in DeepSpeed's load collectives), then, with
  the memory tier on, loads the keeper's checkpoint from a tmpfs copy where it is the newest
  (:mod:`...memory.restore`), and checks the files the load reads (:mod:`.loading`).
- DeepSpeed's in-place weight edits outside the optimizer step fence first
  (:mod:`.weight_editors`); ``save_16bit_model``, which calls the engine outside
  ``save_checkpoint``, has its file written before it returns.

:func:`install` and :func:`uninstall` are called by
:mod:`deepspeed_async_ckpt.integrations.activation`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any, Callable

from ...config import CONFIG_KEY, AsyncCheckpointConfig
from ...errors import ConfigError
from ...tiers.config import refuse_overlap, without_credentials
from .engine import AsyncCheckpointEngine
from .loading import (agreed_latest_tag, checkpoint_to_load, files_read_by_load, finish_memory_load,
                      is_optimizer_file, no_file, restore_from_memory, restore_from_tiers,
                      takes_module_from_latest, zero3_module_source)
from .weight_editors import unpatch_weight_editors

logger = logging.getLogger(__name__)


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


_ORIGINALS: dict[str, Any] = {}


def install(on_engine_built: Callable[[], None] = lambda: None,
            on_disabled: Callable[[], None] = lambda: None) -> bool:
    """Patch DeepSpeed so the config key takes effect; ``on_engine_built()`` runs each time the
    patched factory builds an :class:`~.engine.AsyncCheckpointEngine`, ``on_disabled()`` each
    time it builds DeepSpeed's own engine for a config holding the key with ``enabled: false``
    (whose tiers' credentials must still stay out of what is saved). Idempotent; returns True
    if it patched DeepSpeed."""
    import deepspeed.runtime.engine as ds_engine

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
        param_dict = getattr(config_params, "_param_dict", None)
        cfg = parse_config(param_dict)
        if cfg is None:
            engine = _ORIGINALS["create"](config_params, *args, **kwargs)
            if isinstance(param_dict, dict) and param_dict.get(CONFIG_KEY) is not None:
                on_disabled()
            return engine
        given = create_sig.bind_partial(config_params, *args, **kwargs).arguments
        engine = AsyncCheckpointEngine(config_params, cfg, zero_stage=given.get("zero_stage"),
                                       has_moe_layers=given.get("has_moe_layers", False))
        on_engine_built()
        return engine

    @functools.wraps(_ORIGINALS["step"])
    def _take_model_step(self, *args, **kwargs):
        engine = getattr(self, "checkpoint_engine", None)
        if not isinstance(engine, AsyncCheckpointEngine):
            return _ORIGINALS["step"](self, *args, **kwargs)
        engine.before_optimizer_step(self)
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
        # before DeepSpeed makes the directory: on every rank alike, nothing written
        refuse_overlap(engine.checkpointer.config.tiers, bound.arguments["save_dir"])
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
            if arguments.get("load_dir") is not None:  # a restore would write there
                refuse_overlap(engine.checkpointer.config.tiers, arguments["load_dir"])
            # `latest` must reflect every save issued so far; collective, so that a failed save
            # stops the load on every rank, not only on the one whose background write failed.
            engine.checkpointer.wait_all_ranks(action="load_checkpoint",
                                               recover=arguments.get("load_dir"))
            universal = getattr(self, "load_universal_checkpoint", lambda: False)()
            latest = "latest_universal" if universal else "latest"
            # the keeper's checkpoint, where newer than the directory's and the tiers' newest
            memory = None if universal else restore_from_memory(engine.checkpointer, arguments, latest)
            if memory is not None:  # loaded from its tmpfs copy: the save directory stays as it is
                load_dir = arguments["load_dir"]
                bound = load_sig.bind(self, *args, **kwargs)
                from_latest = bound.arguments.get("tag") is None
                bound.arguments.update(load_dir=memory.load_dir, tag=memory.name)
                args, kwargs = bound.args[1:], bound.kwargs
                arguments = bound.arguments
            else:
                restore_from_tiers(engine.checkpointer, arguments, latest, node_local=engine.node_local)
            if memory is None and arguments.get("tag") is None and arguments.get("load_dir") is not None:
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
            elif memory is None:
                from_latest = False
            module_source = zero3_module_source(self, arguments) if not from_latest else None
            if module_source is not None and engine.checkpointer.rank == 0:
                logger.warning("async checkpoint: load_checkpoint(tag=%r, load_optimizer_states="
                               "False) under ZeRO-3: DeepSpeed takes the module's weights from the "
                               "optimizer files of %s (the checkpoint `latest` names), the other "
                               "states from %s", arguments["tag"], module_source,
                               checkpoint_to_load(arguments))
            # Every file the load reads checked once, across the ranks (from memory: checked as
            # it was laid out); with verify_on_load off, none, but the checkpoint still must be
            # committed (on every rank together: one rank failing alone inside DeepSpeed's load
            # leaves the others in its collectives)
            verify = engine.checkpointer.config.verify_on_load
            ckpt_dir = checkpoint_to_load(arguments, latest)  # the tag is given now, or no load_dir
            engine.checkpointer.verify_all_ranks(
                ckpt_dir, action="load_checkpoint",
                include=files_read_by_load(self, arguments) if verify and memory is None else no_file)
            if not from_latest and takes_module_from_latest(self, arguments):
                # and the optimizer files the module comes from; on every rank alike (None:
                # none to check there, or not readable), so that none is left in the exchange
                engine.checkpointer.verify_all_ranks(
                    module_source, action="load_checkpoint",
                    include=is_optimizer_file if verify else no_file)
            # a checkpoint saved again under it mid-load: every rank raises at the end, together
            try:
                with engine.checkpointer.collective_load("load_checkpoint"):
                    result = _ORIGINALS["load"](self, *args, **kwargs)
            except BaseException:
                if memory is not None:
                    memory.close()
                raise
            return result if memory is None else finish_memory_load(engine.checkpointer, memory, result, load_dir)
        return _ORIGINALS["load"](self, *args, **kwargs)

    recovery = getattr(engine_cls, "_copy_recovery_script", None)
    if recovery is not None:
        _ORIGINALS["recovery"] = recovery

        @functools.wraps(recovery)
        def _copy_recovery_script(self, *args, **kwargs):
            # rank 0 alone copies zero_to_fp32.py into the checkpoint: a failure there (the
            # disk that just failed our writes) must not leave the others in the barrier
            engine = getattr(self, "checkpoint_engine", None)
            if isinstance(engine, AsyncCheckpointEngine) and engine.checkpointer.memory_only:
                return None  # a save to the memory keeper only: nothing of it on disk
            try:
                return recovery(self, *args, **kwargs)
            except Exception as exc:
                if not (isinstance(engine, AsyncCheckpointEngine) and engine.hold(exc)):
                    raise

        engine_cls._copy_recovery_script = _copy_recovery_script
    if hasattr(engine_cls, "_configure_checkpointing"):
        configure = _ORIGINALS["configure"] = engine_cls._configure_checkpointing

        @functools.wraps(configure)
        def _configure_checkpointing(self, *args, **kwargs):
            result = configure(self, *args, **kwargs)
            forget_credentials(self)
            engine = getattr(self, "checkpoint_engine", None)
            if isinstance(engine, AsyncCheckpointEngine):
                engine.after_initialize(self)
            return result

        engine_cls._configure_checkpointing = _configure_checkpointing
    ds_engine.create_checkpoint_engine = create_checkpoint_engine
    engine_cls._take_model_step = _take_model_step
    engine_cls.save_checkpoint = save_checkpoint
    engine_cls.load_checkpoint = load_checkpoint
    return True


def uninstall() -> None:
    """Undo :func:`install` and :func:`~.weight_editors.patch_weight_editors` (tests)."""
    import deepspeed.runtime.engine as ds_engine

    unpatch_weight_editors()
    if not _ORIGINALS:
        return
    engine_cls = ds_engine.DeepSpeedEngine
    ds_engine.create_checkpoint_engine = _ORIGINALS["create"]
    engine_cls._take_model_step = _ORIGINALS["step"]
    engine_cls.save_checkpoint = _ORIGINALS["save"]
    engine_cls.load_checkpoint = _ORIGINALS["load"]
    if "recovery" in _ORIGINALS:
        engine_cls._copy_recovery_script = _ORIGINALS["recovery"]
    if "configure" in _ORIGINALS:
        engine_cls._configure_checkpointing = _ORIGINALS["configure"]
    _ORIGINALS.clear()


def is_installed() -> bool:
    return bool(_ORIGINALS)


def forget_credentials(ds_engine: Any) -> None:
    """The tiers' endpoint user information out of ``ds_engine``'s raw config (``config``, which
    it saves into every model and optimizer state file as ``ds_config`` and logs with
    ``dump_state``) and its parsed config's ``_param_dict`` (logged at INFO once the engine is
    built): each replaced by a copy without it, the caller's dict left as it is. Whichever
    checkpoint engine saves: an ``async_checkpoint`` block with ``enabled: false`` leaves
    DeepSpeed's own, which saves the config as it finds it."""
    ds_engine.config = without_credentials(ds_engine.config)
    parsed = getattr(ds_engine, "_config", None)
    if isinstance(getattr(parsed, "_param_dict", None), dict):
        parsed._param_dict = without_credentials(parsed._param_dict)


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
