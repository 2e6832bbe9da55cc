"""Trainer's methods that hand a checkpoint on, wrapped when this engine is built (inside
``Trainer.train``, :func:`install`): ``_push_from_checkpoint`` with a checkpoint strategy waits
for that checkpoint's save to commit first, and ``push_to_hub`` for the saves into
``output_dir``; the just-in-time checkpoint on SIGTERM marks its checkpoint complete once
committed; a checkpoint's weights export (``model.safetensors``, which Trainer would write
before the call returns, most of its stall) is written by the engine's writers, committed
with the DeepSpeed checkpoint beside it (:func:`save_model`); and the tiers' endpoint
credentials leave Trainer's copies of the DeepSpeed config before anything saves or logs
them (:func:`.credentials.forget_credentials`)."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from . import beside
from .credentials import forget_credentials
from .in_flight import async_checkpointer, raise_failure, wait_for_saves_in
from .rotation import checkpoint_prefix

PUSHED_CHECKPOINTS = ("checkpoint", "all_checkpoints")
"""Trainer's ``hub_strategy`` values that upload ``checkpoint-N`` itself."""

_ORIGINALS: dict[str, Any] = {}
"""Name -> Trainer's own method (or function) that :func:`install` replaced."""


def _push_from_checkpoint(self: Any, checkpoint_folder: str, *args: Any, **kwargs: Any) -> Any:
    forget_credentials(self)  # it saves training_args.bin into output_dir
    strategy = getattr(self.args, "hub_strategy", None)
    strategy = getattr(strategy, "value", strategy)
    previous = getattr(self, "push_in_progress", None)
    skipped = not getattr(self.args, "hub_always_push", False) and previous is not None \
        and not previous.is_done()  # Trainer's rule: this push will not happen
    if self.is_world_process_zero() and not skipped and strategy != "end":
        if strategy in PUSHED_CHECKPOINTS:
            wait_for_saves_in(checkpoint_folder, strict=True, before="Trainer uploads it")
        else:  # it copies the model files out of checkpoint_folder: model.safetensors whole
            beside.wait_beside(checkpoint_folder)
            raise_failure(checkpoint_folder, "Trainer uploads its model files", exports_only=True)
    return _ORIGINALS["_push_from_checkpoint"](self, checkpoint_folder, *args, **kwargs)


_exporting = threading.local()
"""On the thread inside :func:`save_model` for a checkpoint: ``checkpointer`` (None outside)
and ``model``, for :func:`safe_save_file`."""
_checkpointing = threading.local()
"""On the thread inside Trainer's ``_save_checkpoint``: ``depth`` > 0."""


def _save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``Trainer._save_checkpoint``, marked on this thread: the ``save_model`` inside it is the
    one whose export a DeepSpeed checkpoint follows (``_internal_call`` alone is not that:
    ``push_to_hub`` and Ray Tune's ``_tune_save_checkpoint`` pass it too, then upload or hand
    over the directory right away)."""
    _checkpointing.depth = getattr(_checkpointing, "depth", 0) + 1
    try:
        return _ORIGINALS["_save_checkpoint"](self, *args, **kwargs)
    finally:
        _checkpointing.depth -= 1


def save_model(self: Any, output_dir: str | None = None, _internal_call: bool = False,
               *args: Any, **kwargs: Any) -> Any:
    """``Trainer.save_model``: inside ``_save_checkpoint`` (``_internal_call``), before the
    DeepSpeed checkpoint into the same ``checkpoint-N``, with this engine in async mode, the
    weights export (``model.safetensors``, or its shards) goes to the engine's writers
    (:func:`safe_save_file`) instead of being written before the call returns. A save called
    by the user (``trainer.save_model()``, read right after by ``from_pretrained`` or an
    upload), by ``push_to_hub`` or Ray Tune's ``_tune_save_checkpoint`` (which upload or hand
    over the directory right after, so it must hold its weights by then), and
    ``save_only_model`` (no DeepSpeed checkpoint follows to carry it) stay as they are."""
    forget_credentials(self)  # Trainer's _save writes training_args.bin beside the weights
    checkpointer = None
    if _internal_call and getattr(_checkpointing, "depth", 0) \
            and not getattr(self.args, "save_only_model", False):
        checkpointer = async_checkpointer(self)
    if checkpointer is None:
        return _ORIGINALS["save_model"](self, output_dir, _internal_call, *args, **kwargs)
    # one export's weights in memory at a time (accelerate cloned them for it)
    beside.wait_beside(checkpointer=checkpointer)
    _exporting.checkpointer, _exporting.model = checkpointer, getattr(self, "model", None)
    try:
        return _ORIGINALS["save_model"](self, output_dir, _internal_call, *args, **kwargs)
    finally:
        _exporting.checkpointer = _exporting.model = None



def safe_save_file(tensors: dict, filename: str, metadata: dict | None = None, *args: Any,
                   **kwargs: Any) -> Any:
    """``safetensors.torch.save_file`` as ``transformers.modeling_utils`` calls it from
    ``save_pretrained``. Inside :func:`save_model` for a checkpoint, the file is written by
    the engine's writers (:func:`.beside.write_beside`), whole or not at all,
    byte for byte what that function writes, but with direct I/O (the core's
    ``persist.write_safetensors``), and the DeepSpeed checkpoint that Trainer saves next into
    the same directory commits only once it is durable. The tensors are accelerate's CPU
    clones (or, under ZeRO-3, the gathered 16-bit weights), which nothing else changes; any
    that is on an accelerator or shares memory with the model's parameters or buffers is
    copied first. Tensors that function would refuse (or a dtype not in the core's
    ``persist.SAFETENSORS_DTYPES``) go to it."""
    from ...persist import safetensors_writable, write_safetensors

    checkpointer = getattr(_exporting, "checkpointer", None)
    if checkpointer is not None and tensors and not args and not kwargs:
        owned = _owned(tensors, getattr(_exporting, "model", None))
        if safetensors_writable(owned, metadata):  # else the library's own error, or file, right here
            beside.write_beside(checkpointer, filename, lambda f: write_safetensors(f, owned, metadata))
            return None
    return _ORIGINALS["safe_save_file"](tensors, filename, metadata, *args, **kwargs)


def _owned(tensors: dict, model: Any) -> dict:
    """``tensors``, each copied to the CPU if it is elsewhere or shares memory with ``model``
    (which training goes on changing)."""
    import torch

    live = set()
    if isinstance(model, torch.nn.Module):
        for t in (*model.parameters(), *model.buffers()):
            if t.device.type == "cpu" and t.numel():
                live.add(t.untyped_storage().data_ptr())
    return {name: t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
            if t.device.type != "cpu" or t.untyped_storage().data_ptr() in live else t
            for name, t in tensors.items()}


def create_scheduler(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``Trainer.create_scheduler``: the first of Trainer's methods that ``train()`` calls once
    ``accelerator.prepare`` built the engine, before the callbacks' ``on_train_begin``, where
    reporting integrations log ``args.to_json_string()`` (the config as given among them)."""
    forget_credentials(self)
    return _ORIGINALS["create_scheduler"](self, *args, **kwargs)


_pushing = threading.local()  # inside Trainer.push_to_hub, on this thread


def push_to_hub(self: Any, *args: Any, **kwargs: Any) -> Any:
    _pushing.depth = getattr(_pushing, "depth", 0) + 1
    try:
        return _ORIGINALS["push_to_hub"](self, *args, **kwargs)
    finally:
        _pushing.depth -= 1


def _finish_current_push(self: Any, *args: Any, **kwargs: Any) -> Any:
    # push_to_hub calls it between save_model (under ZeRO-3 without gathered 16-bit weights, a
    # DeepSpeed checkpoint in output_dir) and uploading output_dir (also with args.push_to_hub
    # off); the end of train() calls it too, where nothing is uploaded from output_dir
    if getattr(_pushing, "depth", 0):
        # push_to_hub uploads output_dir without its checkpoint-* folders: the saves made
        # directly into it matter (ZeRO-3's global_stepN), not an older checkpoint-N's
        wait_for_saves_in(self.args.output_dir)
        raise_failure(self.args.output_dir, "Trainer uploads it", directly_in=True)
    return _ORIGINALS["_finish_current_push"](self, *args, **kwargs)


def execute_jit_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
    """transformers' just-in-time checkpoint on SIGTERM (``enable_jit_checkpoint``) removes its
    ``checkpoint-is-incomplete.txt`` sentinel and logs "completed successfully" once
    ``_save_checkpoint`` returns: here, once the save has also committed. Training stops right
    after it, so the wait costs nothing that the exit would not; a SIGKILL before the commit
    leaves the sentinel in place."""
    trainer = self.trainer
    had = "_save_checkpoint" in vars(trainer)
    save = trainer._save_checkpoint

    def save_then_wait(*save_args: Any, **save_kwargs: Any) -> Any:
        # a failure raised here keeps the sentinel and is logged as Trainer logs its own
        # ("Failed to save JIT checkpoint"): training stops next, no later save would raise it
        checkpointer = async_checkpointer(trainer)
        if checkpointer is None:
            result = save(*save_args, **save_kwargs)
            folder = os.path.join(trainer._get_output_dir(trial=None),
                                  f"{checkpoint_prefix()}-{trainer.state.global_step}")
            wait_for_saves_in(folder, strict=True,
                              before="Trainer marks its just-in-time checkpoint complete")
            return result
        # Every rank runs this and removes the same sentinel: each must know that rank 0
        # committed, not only that its own part is durable; and a rank whose own steps of the
        # save failed (rank 0's Hub push, say) must still meet the others there, or they wait
        # for it in the exchange
        failed, result = None, None
        try:
            result = save(*save_args, **save_kwargs)
        except Exception as exc:
            failed = exc
        checkpointer.wait_all_ranks(action="marking the just-in-time checkpoint complete", error=failed)
        return result

    trainer._save_checkpoint = save_then_wait
    try:
        return _ORIGINALS["execute_jit_checkpoint"](self, *args, **kwargs)
    finally:
        if had:
            trainer._save_checkpoint = save
        else:
            del trainer._save_checkpoint


TRAINER_METHODS = {("transformers.trainer", "Trainer"): {
                       "_push_from_checkpoint": _push_from_checkpoint, "push_to_hub": push_to_hub,
                       "_finish_current_push": _finish_current_push, "save_model": save_model,
                       "_save_checkpoint": _save_checkpoint, "create_scheduler": create_scheduler},
                   ("transformers.trainer_jit_checkpoint", "CheckpointManager"): {
                       "execute_jit_checkpoint": execute_jit_checkpoint},
                   ("transformers.modeling_utils", None): {"safe_save_file": safe_save_file}}
"""What :func:`install` wraps: Trainer's methods that upload to the Hub, save the
model or end a checkpoint, the first it calls once the engine is built, and the safetensors
writer ``save_pretrained`` calls:
(module, class or None for the module itself) -> name -> wrapper."""


def _owner(module: str, owner: str | None) -> Any:
    """The class (or, for None, the module) holding a wrapped name, if imported."""
    found = sys.modules.get(module)
    return found if owner is None else getattr(found, owner, None)


def install() -> None:
    """Wrap :data:`TRAINER_METHODS` where transformers has imported them. Idempotent."""
    for (module, owner), methods in TRAINER_METHODS.items():
        holder = _owner(module, owner)
        for name, wrapper in methods.items():
            method = getattr(holder, name, None)
            if method is not None and name not in _ORIGINALS:
                _ORIGINALS[name] = method
                setattr(holder, name, wrapper)


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    for (module, owner), methods in TRAINER_METHODS.items():
        for name in methods:
            if name in _ORIGINALS:
                setattr(_owner(module, owner), name, _ORIGINALS[name])
    _ORIGINALS.clear()
