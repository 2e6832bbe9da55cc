"""Megatron-LM integration: its own ``pretrain_gpt.py`` (or any script calling ``pretrain``)
checkpointing through the engine. Needs a Megatron-LM checkout on ``PYTHONPATH``
(``megatron.training`` is not pip-installable); written against ``core_v0.16.x``.

Run Megatron-LM's script unchanged, through this module::

    torchrun --nproc_per_node 8 -m megatron_adapter.megatron_lm Megatron-LM/pretrain_gpt.py \\
        <Megatron-LM flags> --ckpt-format torch_dist --save ckpt --save-interval 500 --load ckpt \\
        --async-ckpt [--async-ckpt-config cfg.json] [--async-ckpt-writers balanced]

or, from a launcher of your own, call :func:`install` before ``pretrain`` and pass
``extra_args_provider=megatron_lm.extra_args_provider(your_provider)``.

What :func:`install` hooks (module attributes of ``megatron.training``):

- ``pretrain``: its ``extra_args_provider`` is chained with :func:`~.arguments.add_arguments`,
  so the three ``--async-ckpt*`` flags parse (Megatron-LM's ``pretrain_gpt.py`` hard-codes its
  own provider).
- ``save_checkpoint`` (in ``checkpointing`` and ``training``): with ``--async-ckpt`` or
  ``--async-ckpt-config``, a persistent ``torch_dist`` save builds the state dict with
  Megatron-LM's own ``generate_state_dict`` and hands it to :class:`MegatronCheckpointer`; the
  tracker is then written by the engine, once every rank persisted. The optimizer's ``step`` gets
  the engine's fence. The dataloader state (``--dataloader-save``) is saved as Megatron-LM
  saves it. Other saves run unchanged: non-persistent ones, other formats, no flag, and saves
  given their own process groups, ranks or RNG key prefix, or of a ModelOpt-converted model
  (whose extra state Megatron-LM writes itself).
- ``load_checkpoint``: waits for pending saves and checks the checkpoint against its manifest
  first; the load itself is Megatron-LM's (the format is megatron's ``torch_dist``).
- ``maybe_finalize_async_save(blocking=True)``: also flushes the engine.

Each committed save's figures go to Megatron-LM's TensorBoard (``--tensorboard-dir``) and W&B
writers at its iteration, as ``async-ckpt/...`` beside its ``save-checkpoint-time`` (see
:mod:`.monitor`).

Not with Megatron-LM's ``--async-save`` (saves would bypass its queue): the engine refuses it.
Routed saves keep ``--save-retain-interval`` (the engine removes the checkpoints it would, once
the tracker moved) and Megatron-LM's log lines (rank 0: "saving checkpoint at iteration",
"scheduled an async checkpoint save", and "successfully saved checkpoint from iteration N to
DIR" once the tracker names it), and skip its other save-time side effects (fault-tolerance
and one-logger callbacks, W&B artifact logging, ``--log-progress`` entries).
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import runpy
import sys
from typing import Any, Callable

from deepspeed_async_ckpt.core import by_rank, exchange_across_ranks, outcome
from deepspeed_async_ckpt.commit import META_DIR
from deepspeed_async_ckpt.errors import ConfigError, IntegrityError

from .arguments import add_arguments, config_from_args
from .monitor import attach_figures
from .checkpointer import (MegatronCheckpointer, checkpoint_dir, read_tracker, tracker_path,
                           verify_checkpoint_dir)

_ORIGINALS: dict[str, Any] = {}
_STATE: dict[str, Any] = {"engine": None, "saves": 0}


def extra_args_provider(inner: Callable | None = None) -> Callable:
    """An ``extra_args_provider`` adding the adapter's flags after ``inner``'s."""

    def provider(parser):
        if inner is not None:
            parser = inner(parser) or parser
        return add_arguments(parser)

    return provider


def engine_enabled(args: Any) -> bool:
    return bool(getattr(args, "async_ckpt", False) or getattr(args, "async_ckpt_config", None))


def _engine(args: Any) -> MegatronCheckpointer | None:
    if not engine_enabled(args):
        return None
    if _STATE["engine"] is None:
        cfg = config_from_args(args)
        if not cfg.enabled:  # Megatron-LM's own saves, --async-save's included
            return None
        if getattr(args, "async_save", False):
            raise ConfigError("--async-ckpt/--async-ckpt-config and Megatron-LM's --async-save both "
                              "save in the background: use one (routed saves would bypass "
                              "--async-save's queue)")
        _STATE["engine"] = MegatronCheckpointer(
            cfg, writers=args.async_ckpt_writers,
            retain_interval=getattr(args, "save_retain_interval", None),
            on_saved=_print_saved)
        _attach_figures(_STATE["engine"], args)
    return _STATE["engine"]


def _attach_figures(engine: MegatronCheckpointer, args: Any) -> None:
    """Rank 0: each commit's figures into Megatron-LM's TensorBoard and W&B writers (where
    this rank holds them) or ``--tensorboard-dir`` (see :mod:`.monitor`)."""
    import megatron.training as mt

    writer = {name: getattr(mt, f"get_{name}_writer", lambda: None)() for name in ("tensorboard", "wandb")}
    attach_figures(engine, tensorboard=writer["tensorboard"], wandb=writer["wandb"],
                   tensorboard_dir=getattr(args, "tensorboard_dir", None),
                   wandb_project=getattr(args, "wandb_project", None))


def _now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")


def _print_saved(iteration: int, info: Any) -> None:
    """Rank 0, once the tracker names the checkpoint: Megatron-LM's own line for a finished save
    (what its logs, and the job monitors that read them, look for; the save directory made
    absolute), then the engine's figures."""
    from megatron.core import mpu

    save_dir = os.path.dirname(info.ckpt_dir)
    t, p = mpu.get_tensor_model_parallel_rank() + 1, mpu.get_pipeline_model_parallel_rank() + 1
    print(f"  [{_now()}] successfully saved checkpoint from iteration {iteration:7d} to {save_dir} "
          f"[ t {t}/{mpu.get_tensor_model_parallel_world_size()}, "
          f"p {p}/{mpu.get_pipeline_model_parallel_world_size()} ]", flush=True)
    print(f"  async checkpoint: {info}", flush=True)


def _call(fn: Callable, *args: Any, **maybe_kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature accepts (versions differ)."""
    params = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in maybe_kwargs.items() if k in params})


def _fence_optimizer(optimizer: Any, engine: MegatronCheckpointer) -> None:
    if optimizer is None or getattr(optimizer, "_async_ckpt_fenced", False):
        return
    step = optimizer.step

    @functools.wraps(step)
    def fenced_step(*args, **kwargs):
        engine.fence()  # the last save's lazy copies finish before weights change
        return step(*args, **kwargs)

    optimizer.step = fenced_step
    optimizer._async_ckpt_fenced = True


#: ``save_checkpoint`` arguments a routed save cannot honour (process groups and ranks other than
#: Megatron-LM's global ones, an RNG key prefix): a save given any of them runs unchanged.
_NOT_ROUTED_WITH = ("pipeline_rank", "expert_rank", "tensor_rank", "pipeline_parallel",
                    "expert_parallel", "tp_group", "pp_group", "dp_cp_group", "dp_group",
                    "expt_dp_group", "rng_state_key_prefix")


def routed(arguments: dict, ckpt_format: str) -> bool:
    """Whether a ``save_checkpoint`` call with these (bound, explicitly passed) arguments goes
    to the engine: a persistent, non-release ``torch_dist`` save without arguments of
    :data:`_NOT_ROUTED_WITH` and of a model without ModelOpt state."""
    if arguments.get("non_persistent_ckpt") or arguments.get("release") or ckpt_format != "torch_dist":
        return False
    if any(arguments.get(k) not in (None, "") for k in _NOT_ROUTED_WITH):
        return False
    return not has_modelopt_state(arguments.get("model"))


def has_modelopt_state(model: Any) -> bool:
    """True for a model NVIDIA ModelOpt converted (quantized, pruned, ...): Megatron-LM saves its
    ModelOpt state into the checkpoint itself (``save_sharded_modelopt_state``)."""
    try:
        import modelopt.torch.opt as mto
    except ImportError:
        return False
    from megatron.core.utils import unwrap_model

    models = model if isinstance(model, (list, tuple)) else [model]
    return any(m is not None and mto.ModeloptStateManager.is_converted(unwrap_model(m)) for m in models)


def save_checkpoint(*args, **kwargs):
    """Megatron-LM's ``save_checkpoint``; routes persistent torch_dist saves (see :func:`routed`)."""
    import torch.distributed as dist
    from megatron.core import mpu
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.core.utils import unwrap_model
    from megatron.training import checkpointing as mlm
    from megatron.training import get_args

    margs = get_args()
    engine = _engine(margs)
    arguments = inspect.signature(_ORIGINALS["save"]).bind(*args, **kwargs).arguments
    if engine is None or not routed(arguments, margs.ckpt_format):
        return _ORIGINALS["save"](*args, **kwargs)
    iteration, optimizer = arguments["iteration"], arguments["optimizer"]
    opt_param_scheduler = arguments["opt_param_scheduler"]
    if dist.get_rank() == 0:  # Megatron-LM's lines, as its own save prints them
        print(f"[{_now()}] saving checkpoint at iteration {iteration:7d} to {margs.save} in "
              f"torch_dist format", flush=True)
    model = unwrap_model(arguments["model"])
    if "ckpt_format" in inspect.signature(mlm.get_rng_state).parameters:
        rng_state = _call(mlm.get_rng_state, ckpt_format=margs.ckpt_format,
                          tp_group=mpu.get_tensor_model_parallel_group(),
                          pp_group=mpu.get_pipeline_model_parallel_group())
    else:  # older Megatron-LM: get_rng_state(use_dist_ckpt)
        rng_state = _call(mlm.get_rng_state, use_dist_ckpt=True)
    metadata = _call(mlm._build_sharded_state_dict_metadata, margs)
    data_iterator = arguments.get("train_data_iterator")
    rerun_state = _call(get_rerun_state_machine().state_dict,
                        data_iterator=data_iterator, ckpt_format=margs.ckpt_format)
    state_dict = _call(mlm.generate_state_dict, margs, model, optimizer, opt_param_scheduler,
                       rng_state, iteration=iteration, optim_sd_kwargs=dict(metadata=metadata),
                       model_sd_kwargs=dict(metadata=metadata), rerun_state=rerun_state)
    state_dict["num_floating_point_operations_so_far"] = arguments["num_floating_point_operations_so_far"]
    validate = _STATE["saves"] == 0 or not getattr(margs, "ckpt_assume_constant_structure", False)
    engine.save(state_dict, margs.save, iteration,
                content_metadata=_clean_metadata_for_serialization(metadata),
                validate_access_integrity=validate,
                preprocess_common=arguments.get("preprocess_common_state_dict_fn"), model=model)
    _STATE["saves"] += 1
    if dist.get_rank() == 0 and engine.config.is_async:
        print(f"  [{_now()}] scheduled an async checkpoint save at iteration {iteration:7d} to "
              f"{margs.save}", flush=True)
    save_dataloader_state = getattr(mlm, "maybe_save_dataloader_state", None)
    if save_dataloader_state is not None:  # Energon's state, beside the checkpoint, as Megatron-LM does
        _call(save_dataloader_state, model=model, train_iterator=data_iterator, iteration=iteration,
              dataloader_save_path=getattr(margs, "dataloader_save", None))
    _fence_optimizer(optimizer, engine)


def skipped_by_load(arguments: Any) -> tuple[str, ...]:
    """What Megatron-LM's ``load_checkpoint`` leaves out of its request, by its arguments:
    the optimizer state under ``--finetune`` or ``--no-load-optim``, the RNG state under
    ``--finetune`` or ``--no-load-rng``; verification skips those bytes too."""
    finetune = bool(getattr(arguments, "finetune", False))
    skip = []
    if finetune or getattr(arguments, "no_load_optim", False):
        skip.append("optimizer")
    if finetune or getattr(arguments, "no_load_rng", False):
        skip.append("rng_state")
    return tuple(skip)


def load_checkpoint(*args, **kwargs):
    """Megatron-LM's ``load_checkpoint``, after pending saves landed and the checkpoint the
    tracker (or ``--ckpt-step``) names was checked against its manifest (what the load reads
    of it: :func:`skipped_by_load`). With the memory tier on, the keeper's checkpoint where
    it is the newest, from a tmpfs copy (``--load`` pointed there for the load and put back:
    see :mod:`deepspeed_async_ckpt.memory.restore`)."""
    from megatron.training import get_args

    margs = get_args()
    engine = _engine(margs)
    if engine is None:
        return _ORIGINALS["load"](*args, **kwargs)
    load_arg = inspect.signature(_ORIGINALS["load"]).bind(*args, **kwargs).arguments.get("load_arg", "load")
    load_dir = getattr(margs, load_arg, None)
    engine.wait(recover=load_dir)
    memory = engine.restore_from_memory(load_dir, getattr(margs, "ckpt_step", None)) if load_dir else None
    if memory is None:
        if load_dir:  # a node whose disk is empty: from the durable tiers
            engine.restore(load_dir, getattr(margs, "ckpt_step", None))
        return _checked_load(margs, engine, load_dir, args, kwargs)
    # Megatron-LM reads the directory its argument names: the keeper's tmpfs copy, for this load
    setattr(margs, load_arg, memory.load_dir)
    try:
        result = _checked_load(margs, engine, memory.load_dir, args, kwargs)
    except BaseException:
        memory.close()
        raise
    finally:
        setattr(margs, load_arg, load_dir)
    try:
        outcome("load_checkpoint", None, exchange=engine.checkpointer.exchange)  # every rank read it
    finally:
        memory.close()
    return result


def _checked_load(margs: Any, engine: MegatronCheckpointer, load_dir: str | None, args: tuple, kwargs: dict) -> Any:
    """Megatron-LM's load from ``load_dir`` after the checkpoint it will read was checked."""
    import torch.distributed as dist

    skip = skipped_by_load(margs)
    pretrained = getattr(margs, "pretrained_checkpoint", None)
    if pretrained is not None and not (load_dir and os.path.isfile(tracker_path(load_dir))):
        # As Megatron-LM's load_checkpoint: it then finetunes from --pretrained-checkpoint
        load_dir, skip = pretrained, ("optimizer", "rng_state")
    try:
        iteration = getattr(margs, "ckpt_step", None) or (read_tracker(load_dir) if load_dir else None)
    except IntegrityError:  # "release": not a checkpoint this engine writes
        iteration = None
    ckpt_dir = None if iteration is None or not load_dir else checkpoint_dir(load_dir, iteration)
    # Only this engine's checkpoints: Megatron-LM reads any other format (legacy torch,
    # torch_dcp, megatron-core's own torch_dist) itself, whatever --ckpt-format says.
    ours = ckpt_dir if ckpt_dir is not None and os.path.isdir(os.path.join(ckpt_dir, META_DIR)) else None
    if engine.config.verify_on_load:
        # Each rank read the tracker itself: the check is collective, so every rank must
        # agree on what it checks first, nothing included (a rank that read the tracker
        # just before a commit skipped the check, and the others waited in it for good)
        _, failed = outcome("load_checkpoint", None, exchange=exchange_across_ranks,
                            key=os.path.abspath(ours) if ours else "")
        if failed is not None:
            raise IntegrityError("load_checkpoint refused on every rank: the ranks read different "
                                 f"checkpoints from the tracker (rank(s) {by_rank(failed.failures)}); "
                                 "a save moved it meanwhile: load again") from failed
        if ours is not None:
            verify_checkpoint_dir(ours, rank=dist.get_rank(), world_size=dist.get_world_size(),
                                  skip=skip)
    return _ORIGINALS["load"](*args, **kwargs)


def maybe_finalize_async_save(blocking: bool = False, *args, **kwargs):
    if blocking and _STATE["engine"] is not None:
        _STATE["engine"].wait()
    return _ORIGINALS["finalize"](blocking, *args, **kwargs)


def _pretrain(*args, **kwargs):
    params = inspect.signature(_ORIGINALS["pretrain"]).parameters
    positional = [n for n, p in params.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    name = "extra_args_provider"
    if name in positional and len(args) > positional.index(name):
        i = positional.index(name)
        args = (*args[:i], extra_args_provider(args[i]), *args[i + 1:])
    else:
        kwargs[name] = extra_args_provider(kwargs.get(name))
    return _ORIGINALS["pretrain"](*args, **kwargs)


def install() -> bool:
    """Hook Megatron-LM (idempotent). Returns True if it patched."""
    import megatron.training as mt
    from megatron.training import checkpointing, training

    if _ORIGINALS:
        return False
    _ORIGINALS.update(save=checkpointing.save_checkpoint, load=checkpointing.load_checkpoint,
                      pretrain=training.pretrain,
                      finalize=getattr(training, "maybe_finalize_async_save", lambda *a, **k: None))
    checkpointing.save_checkpoint = training.save_checkpoint = save_checkpoint
    checkpointing.load_checkpoint = training.load_checkpoint = load_checkpoint
    training.maybe_finalize_async_save = maybe_finalize_async_save
    training.pretrain = mt.pretrain = _pretrain
    return True


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    import megatron.training as mt
    from megatron.training import checkpointing, training

    if not _ORIGINALS:
        return
    checkpointing.save_checkpoint = training.save_checkpoint = _ORIGINALS["save"]
    checkpointing.load_checkpoint = training.load_checkpoint = _ORIGINALS["load"]
    training.maybe_finalize_async_save = _ORIGINALS["finalize"]
    training.pretrain = mt.pretrain = _ORIGINALS["pretrain"]
    _ORIGINALS.clear()


def main(argv: list[str] | None = None) -> None:
    """``python -m megatron_adapter.megatron_lm SCRIPT [args...]``: run SCRIPT as ``__main__``
    with the hooks installed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m megatron_adapter.megatron_lm Megatron-LM/pretrain_gpt.py [args...]")
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))  # its sibling modules (model_provider, ...)
    install()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
