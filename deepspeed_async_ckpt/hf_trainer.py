"""Hugging Face ``transformers.Trainer`` with this engine: rotation, resume and Hub pushes that
know a save may still be in flight.

Trainer saves a DeepSpeed checkpoint into ``<output_dir>/checkpoint-N`` with
``engine.save_checkpoint``, which with this engine returns once the save is enqueued. In the
same call Trainer then deletes older ``checkpoint-*`` directories down to ``save_total_limit``,
always keeping the newest; ``train(resume_from_checkpoint=True)`` resumes from the
highest-numbered one; and with ``hub_strategy="checkpoint"`` (or ``"all_checkpoints"``) it
uploads ``checkpoint-N`` in the background right away. None of them knew that the newest might
not be committed yet:

- rotation deleted the last committed checkpoint while the new one was still being written
  (with ``save_total_limit=1``, a crash then left nothing to resume from), and deleted
  directories that earlier saves were still writing into (those saves failed);
- after a crash mid-persist, resume picked the ``checkpoint-N`` whose save it cut short, and
  raised;
- the Hub got a checkpoint without ``latest``, with temporary files.

:func:`install` wraps three functions of ``transformers.trainer_utils`` (transformers 5.x),
when that module is first imported (the ``.pth`` hook, see ``deepspeed_async_ckpt_autoload``),
before ``transformers.trainer`` binds their names:

- ``sort_checkpoints`` (the list rotation deletes from) leaves out the checkpoints that cannot
  be resumed yet or ever: still being saved by this process, or never committed (a crash or
  failure cut the save short). Trainer's own rule then runs on the rest, so
  ``save_total_limit`` counts resumable checkpoints, and those still being saved are kept on
  top, as during a synchronous save;
- ``rotate_checkpoints`` also deletes the never-committed ones older than the newest
  resumable one (nothing else would);
- ``get_last_checkpoint`` returns the newest resumable ``checkpoint-N``.

A rotation that left a save in flight out runs again at interpreter exit, once that save has
committed. When this engine is built (inside ``Trainer.train``), :func:`check_installed` also
wraps Trainer's Hub uploads: ``_push_from_checkpoint`` with a checkpoint strategy waits for
that checkpoint's save to commit first, and ``push_to_hub`` for the saves into
``output_dir``; the just-in-time checkpoint on SIGTERM marks its checkpoint complete once
committed; and a checkpoint's weights export (``model.safetensors``, which Trainer wrote
before the call returned, most of what was left of its stall) is written by the engine's
writers, committed with the DeepSpeed checkpoint beside it (:func:`save_model`).
Directories holding no checkpoint of this engine are judged as Trainer judges them.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import re
import shutil
import sys
import threading
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "transformers.trainer_utils"
POINTER = "latest"
"""DeepSpeed's pointer file in a save directory (Trainer's ``checkpoint-N``)."""
WRAPPED = ("sort_checkpoints", "rotate_checkpoints", "get_last_checkpoint")
PUSHED_CHECKPOINTS = ("checkpoint", "all_checkpoints")
"""Trainer's ``hub_strategy`` values that upload ``checkpoint-N`` itself."""

SAVING_REASON = "its DeepSpeed checkpoint is still being saved"

_ORIGINALS: dict[str, Any] = {}
_ROTATE_SIGNATURE: inspect.Signature | None = None
_hook: Any = None  # the post-import hook install() left for transformers' import
_deferred: dict[str, tuple[tuple, dict]] = {}  # output_dir -> a rotation to run again at exit
_best_only_at_exit: dict[str, str] = {}
"""output_dir -> the best model's checkpoint, where Trainer's end of training (with
``save_total_limit=1``: every checkpoint but the best one deleted) did not see a save in
flight: done again at exit, after the rotation (see :func:`sort_checkpoints`)."""
_exit_registered = False
_warned = False


class Judgement:
    """Why Trainer cannot resume from a ``checkpoint-N`` (``reason``; None: it can, or the
    directory holds no checkpoint of this engine), and whether that is known for good
    (``never``: its save never committed) rather than for now (still being saved) or unknown
    (unreadable), which rotation deletes only in the first case."""

    def __init__(self, reason: str | None = None, never: bool = False) -> None:
        self.reason, self.never = reason, never


def judge(path: str) -> Judgement:
    from .commit import scan_checkpoints

    if _being_saved(path):
        return Judgement(SAVING_REASON)
    try:
        committed, partial = scan_checkpoints(path)  # one pass over the tags' manifests
    except OSError:
        return Judgement()  # unreadable: Trainer's own judgement (and its error)
    if not committed and not partial:
        return Judgement()
    try:
        with open(os.path.join(path, POINTER), encoding="utf-8") as f:
            tag = f.read().strip()
    except FileNotFoundError:
        return Judgement(f"its DeepSpeed checkpoint was never committed (no {POINTER!r} file)",
                         never=True)
    except OSError as exc:
        return Judgement(f"its {POINTER!r} file cannot be read: {exc}")
    if tag in partial:
        return Judgement(f"{POINTER!r} names {tag!r}, which was never committed", never=True)
    return Judgement()


def why_not_resumable(path: str) -> str | None:
    """Why ``Trainer`` cannot resume from the ``checkpoint-N`` directory ``path`` through this
    engine; None when it can, or when ``path`` holds no checkpoint of this engine (Trainer and
    DeepSpeed then judge it as they always do)."""
    return judge(path).reason


def _inside(path: str, real_root: str) -> bool:
    """Whether ``path`` is ``real_root`` (a real path) or lies under it."""
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root + os.sep)


def _being_saved(path: str) -> bool:
    checkpointer = sys.modules.get(f"{__package__}.core.lifecycle")
    if checkpointer is None:  # no checkpointer was ever made in this process
        return False
    real = os.path.realpath(path)
    return any(_inside(d, real) for d in checkpointer.saving_dirs())


def _checkpoint_number(path: str, prefix: str) -> int | None:
    match = re.fullmatch(re.escape(prefix) + r"-(\d+)", os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def sort_checkpoints(*args: Any, **kwargs: Any) -> list[str]:
    kept, in_flight = [], False
    for path in _ORIGINALS["sort_checkpoints"](*args, **kwargs):
        why = why_not_resumable(path)
        if why is None:
            kept.append(path)
        else:
            in_flight = in_flight or why == SAVING_REASON
            logger.info("async checkpoint: %s is left out of Trainer's checkpoint rotation: %s",
                        path, why)
    # Trainer's end of training asks with the best model's checkpoint (its rotation does not),
    # then, with save_total_limit=1, deletes every checkpoint but that one: a save in flight,
    # left out here, would stay (two checkpoints where Trainer leaves one). Noted, so that the
    # rotation at exit, once the save committed, deletes it as Trainer would have.
    if in_flight:
        given = inspect.signature(_ORIGINALS["sort_checkpoints"]).bind(*args, **kwargs).arguments
        best, output_dir = given.get("best_model_checkpoint"), given.get("output_dir")
        if best is not None and output_dir is not None:
            _best_only_at_exit[os.path.realpath(output_dir)] = best
    return kept


def rotate_checkpoints(*args: Any, **kwargs: Any) -> None:
    given = _ROTATE_SIGNATURE.bind(*args, **kwargs)
    given.apply_defaults()
    limit = given.arguments["save_total_limit"]
    if limit is None or limit <= 0:
        _ORIGINALS["rotate_checkpoints"](*args, **kwargs)
        return
    output_dir = given.arguments["output_dir"]
    prefix = given.arguments.get("checkpoint_prefix", _prefix())
    # before the rotation: a save that commits during it may have been left out all the same
    found = _ORIGINALS["sort_checkpoints"](output_dir=output_dir, checkpoint_prefix=prefix)
    in_flight = any(_being_saved(path) for path in found)
    best = given.arguments.get("best_model_checkpoint")
    if best is not None and _being_saved(best):
        # the best model's checkpoint is the save in flight (the metric improved at this save):
        # left out of the list, it is kept anyway; named as well, Trainer counted it among the
        # checkpoints to keep, and kept one committed checkpoint too many until the exit
        # (save_total_limit=1: two and the one in flight; a review, session 30)
        given.arguments["best_model_checkpoint"] = None
    _rotating.checkpointer = _async_checkpointer_of_process()
    try:
        _ORIGINALS["rotate_checkpoints"](*given.args, **given.kwargs)
        _remove_never_committed(output_dir, prefix, best)
    finally:
        _rotating.checkpointer = None
    if in_flight:
        _rotate_again_at_exit(os.path.realpath(output_dir), args, kwargs)
    else:
        _deferred.pop(os.path.realpath(output_dir), None)


_rotating = threading.local()
"""On the thread inside :func:`rotate_checkpoints`: ``checkpointer``, the open async-mode
checkpointer whose retention thread deletes what the rotation deletes (None: deleted here)."""


class _Shutil:
    """``shutil`` as ``transformers.trainer_utils`` sees it (:func:`install`): inside
    :func:`rotate_checkpoints`, with this engine in async mode, ``rmtree`` renames the
    directory out of Trainer's sight (``.async_ckpt_removing.checkpoint-N.<id>``, as retention
    does) and the engine's retention thread deletes it. Trainer deleted the previous
    checkpoint on the training thread: 0.3 s for 1.85 GB idle here, 0.6-1.0 s with the new
    save's writes in flight, most of what was left of its stall. What a crash leaves renamed
    is deleted at the next rotation in that directory. Anything else: ``shutil``'s."""

    def __getattr__(self, name: str) -> Any:
        return getattr(shutil, name)

    def rmtree(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        checkpointer = getattr(_rotating, "checkpointer", None)
        if checkpointer is None or not _remove_later(checkpointer, os.fspath(path)):
            return shutil.rmtree(path, *args, **kwargs)
        return None


_SHUTIL = _Shutil()


def _remove_later(checkpointer: Any, path: str) -> bool:
    """Rename ``path`` for deletion and queue its deletion (with any such leftover beside it)
    on ``checkpointer``'s retention thread; False, nothing done, if it cannot be renamed."""
    from .commit import REMOVING_PREFIX

    parent, name = os.path.split(os.path.abspath(path))
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    try:
        os.rename(path, os.path.join(parent, f"{REMOVING_PREFIX}{name}.{os.urandom(6).hex()}"))
    except OSError:
        return False
    checkpointer._later(checkpointer._remove_trash, parent)
    return True


def _async_checkpointer_of_process() -> Any:
    checkpointer = sys.modules.get(f"{__package__}.core.lifecycle")
    if checkpointer is None:
        return None
    return next((c for c in checkpointer.open_checkpointers() if c.config.is_async), None)


def _rotate_again_at_exit(key: str, args: tuple, kwargs: dict) -> None:
    """Trainer rotates only right after a save: when training ends with its last save in
    flight, the checkpoint before it would stay, one more than ``save_total_limit``. This
    rotation runs again at interpreter exit (``atexit``), after the engine's own exit flush
    (``threading``'s exit hooks, which run first) has committed that save."""
    global _exit_registered
    _deferred[key] = (args, kwargs)
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_rotate_at_exit)


def _forget_in_child() -> None:
    _deferred.clear()  # a forked child's exit must not rotate its parent's checkpoints
    _best_only_at_exit.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _rotate_at_exit() -> None:
    for key, (args, kwargs) in list(_deferred.items()):
        try:
            rotate_checkpoints(*args, **kwargs)
            best = _best_only_at_exit.get(key)
            limit = _ROTATE_SIGNATURE.bind(*args, **kwargs).arguments.get("save_total_limit")
            if best is not None and limit == 1:  # Trainer's end of training, as it would have
                for path in sort_checkpoints(output_dir=key, best_model_checkpoint=best):
                    if not os.path.samefile(path, best):
                        logger.info("async checkpoint: deleting %s (save_total_limit=1 keeps the "
                                    "best model's %s at the end of training)", path, best)
                        shutil.rmtree(path, ignore_errors=True)
        except Exception as exc:  # at exit: nobody to raise to
            logger.warning("async checkpoint: Trainer's checkpoint rotation at exit failed: %r", exc)
    _deferred.clear()
    _best_only_at_exit.clear()


def _remove_never_committed(output_dir: str, prefix: str, best: str | None) -> None:
    """Delete the ``checkpoint-N`` directories whose save never committed that are older, by
    step, than the newest resumable one (not the best model's: Trainer reads that one at the
    end of training)."""
    found = _ORIGINALS["sort_checkpoints"](output_dir=output_dir, checkpoint_prefix=prefix)
    judged = [(path, _checkpoint_number(path, prefix), judge(path)) for path in found]
    resumable = [n for _, n, j in judged if j.reason is None and n is not None]
    if not resumable:
        return
    for path, number, judgement in judged:
        if judgement.never and number is not None and number < max(resumable) \
                and not (best and os.path.realpath(best) == os.path.realpath(path)):
            logger.warning("async checkpoint: deleting %s (save_total_limit): %s", path,
                           judgement.reason)
            _SHUTIL.rmtree(path, ignore_errors=True)


def get_last_checkpoint(folder: str) -> str | None:
    newest = _ORIGINALS["get_last_checkpoint"](folder)
    if newest is None or why_not_resumable(newest) is None:
        return newest
    prefix = _prefix()
    numbered = []
    for name in os.listdir(folder):
        number = _checkpoint_number(name, prefix)
        if number is not None and os.path.isdir(os.path.join(folder, name)):
            numbered.append((number, os.path.join(folder, name)))
    for _, path in sorted(numbered, reverse=True):
        why = why_not_resumable(path)
        if why is None:
            return path
        logger.warning("async checkpoint: not resuming from %s: %s", path, why)
    return None


def _prefix() -> str:
    return getattr(sys.modules.get(TARGET), "PREFIX_CHECKPOINT_DIR", "checkpoint")


def _push_from_checkpoint(self: Any, checkpoint_folder: str, *args: Any, **kwargs: Any) -> Any:
    strategy = getattr(self.args, "hub_strategy", None)
    strategy = getattr(strategy, "value", strategy)
    previous = getattr(self, "push_in_progress", None)
    skipped = not getattr(self.args, "hub_always_push", False) and previous is not None \
        and not previous.is_done()  # Trainer's rule: this push will not happen
    if self.is_world_process_zero() and not skipped and strategy != "end":
        if strategy in PUSHED_CHECKPOINTS:
            wait_for_saves_in(checkpoint_folder, strict=True, before="Trainer uploads it")
        else:  # it copies the model files out of checkpoint_folder: model.safetensors whole
            _wait_beside(checkpoint_folder)
            _raise_failure(checkpoint_folder, "Trainer uploads its model files", exports_only=True)
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
    over the directory right after; until session 30 they got it without its weights), and
    ``save_only_model`` (no DeepSpeed checkpoint follows to carry it) stay as they are."""
    checkpointer = None
    if _internal_call and getattr(_checkpointing, "depth", 0) \
            and not getattr(self.args, "save_only_model", False):
        checkpointer = _async_checkpointer(self)
    if checkpointer is None:
        return _ORIGINALS["save_model"](self, output_dir, _internal_call, *args, **kwargs)
    # one export's weights in memory at a time (accelerate cloned them for it)
    checkpointer.wait_beside()
    _exporting.checkpointer, _exporting.model = checkpointer, getattr(self, "model", None)
    try:
        return _ORIGINALS["save_model"](self, output_dir, _internal_call, *args, **kwargs)
    finally:
        _exporting.checkpointer = _exporting.model = None


def _async_checkpointer(trainer: Any) -> Any:
    """The open async-mode checkpointer of the DeepSpeed engine ``trainer`` trains with, if any."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    engine = getattr(getattr(trainer, "deepspeed", None), "checkpoint_engine", None)
    checkpointer = getattr(engine, "checkpointer", None)
    from .core import AsyncCheckpointer

    if not isinstance(checkpointer, AsyncCheckpointer) or checkpointer._closed \
            or not checkpointer.config.is_async:
        return None
    return checkpointer


def safe_save_file(tensors: dict, filename: str, metadata: dict | None = None, *args: Any,
                   **kwargs: Any) -> Any:
    """``safetensors.torch.save_file`` as ``transformers.modeling_utils`` calls it from
    ``save_pretrained``. Inside :func:`save_model` for a checkpoint, the file is written by
    the engine's writers (:meth:`~.core.AsyncCheckpointer.write_beside`), whole or not
    at all, byte for byte what that function writes, but with direct I/O
    (:func:`~.persist.write_safetensors`), and the DeepSpeed checkpoint that Trainer saves
    next into the same directory commits only once it is durable. The tensors are accelerate's
    CPU clones (or, under ZeRO-3, the gathered 16-bit weights), which nothing else changes; any
    that is on an accelerator or shares memory with the model's parameters or buffers is
    copied first. Tensors that function would refuse (or a dtype not in
    :data:`~.persist.SAFETENSORS_DTYPES`) go to it, as before."""
    from .persist import safetensors_writable, write_safetensors

    checkpointer = getattr(_exporting, "checkpointer", None)
    if checkpointer is not None and tensors and not args and not kwargs:
        owned = _owned(tensors, getattr(_exporting, "model", None))
        if safetensors_writable(owned, metadata):  # else the library's own error, or file, right here
            checkpointer.write_beside(filename, lambda f: write_safetensors(f, owned, metadata))
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
        _raise_failure(self.args.output_dir, "Trainer uploads it", directly_in=True)
    return _ORIGINALS["_finish_current_push"](self, *args, **kwargs)


def execute_jit_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
    """transformers' just-in-time checkpoint on SIGTERM (``enable_jit_checkpoint``) removes its
    ``checkpoint-is-incomplete.txt`` sentinel and logs "completed successfully" once
    ``_save_checkpoint`` returns: here, once the save has also committed. Training stops right
    after it, so the wait costs nothing that the exit would not; a SIGKILL before the commit
    now leaves the sentinel in place."""
    trainer = self.trainer
    had = "_save_checkpoint" in vars(trainer)
    save = trainer._save_checkpoint

    def save_then_wait(*save_args: Any, **save_kwargs: Any) -> Any:
        # a failure raised here keeps the sentinel and is logged as Trainer logs its own
        # ("Failed to save JIT checkpoint"): training stops next, no later save would raise it
        checkpointer = _async_checkpointer(trainer)
        if checkpointer is None:
            result = save(*save_args, **save_kwargs)
            folder = os.path.join(trainer._get_output_dir(trial=None),
                                  f"{_prefix()}-{trainer.state.global_step}")
            wait_for_saves_in(folder, strict=True, before="Trainer marks its just-in-time checkpoint complete")
            return result
        # Every rank runs this and removes the same sentinel: each must know that rank 0
        # committed, not only that its own part is durable; and a rank whose own steps of the
        # save failed (rank 0's Hub push, say) must still meet the others there, or they wait
        # for it in the exchange (two reviews, session 30)
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
                       "_save_checkpoint": _save_checkpoint},
                   ("transformers.trainer_jit_checkpoint", "CheckpointManager"): {
                       "execute_jit_checkpoint": execute_jit_checkpoint},
                   ("transformers.modeling_utils", None): {"safe_save_file": safe_save_file}}
"""What :func:`check_installed` wraps: Trainer's methods that upload to the Hub, save the
model or end a checkpoint, and the safetensors writer ``save_pretrained`` calls:
(module, class or None for the module itself) -> name -> wrapper."""


def _owner(module: str, owner: str | None) -> Any:
    """The class (or, for None, the module) holding a wrapped name, if imported."""
    found = sys.modules.get(module)
    return found if owner is None else getattr(found, owner, None)


def _wait_beside(path: str) -> None:
    checkpointer = sys.modules.get(f"{__package__}.core.lifecycle")
    if checkpointer is not None:
        checkpointer.wait_beside(path)


def wait_for_saves_in(path: str, strict: bool = False, before: str = "going on") -> None:
    """Block until this process's saves into ``path`` (a ``checkpoint-N``, or the directory
    holding them) are committed or have failed. A failure is raised at the next save, as
    always; with ``strict``, also here (:func:`_raise_failure`), for callers that do something
    next that cannot wait for that save (an upload, the end of training)."""
    checkpointer = sys.modules.get(f"{__package__}.core.lifecycle")
    if checkpointer is None:
        return
    checkpointer.wait_beside(path)  # the saves into path wait for them too; pushes of other kinds
    real = os.path.realpath(path)
    for handle in checkpointer.saves_in_flight():
        if _inside(handle.ckpt_dir, real):
            logger.info("async checkpoint: waiting for %s to commit before %s", handle.ckpt_dir, before)
            handle.wait_committed()
    if strict:
        _raise_failure(path, before)


def _raise_failure(path: str, before: str, exports_only: bool = False, directly_in: bool = False) -> None:
    """Raise a :class:`~.errors.PersistError` if this process's last save into ``path`` (or
    under it; ``directly_in``: its checkpoints directly in ``path``) failed, or the weights
    export into it (:meth:`~.core.AsyncCheckpointer.write_beside`), waiting for the
    exports; ``exports_only``: only those. Only failures the engine has not reported yet
    count (one it raised at a save or ``wait`` was dealt with). The error stays the engine's
    too (raised at its next save or ``close``). Until session 30 the callers waited and went
    on: a checkpoint whose save failed was uploaded to the Hub, or marked complete by the
    just-in-time checkpoint, and training ended with the error only on stderr at exit."""
    from .errors import PersistError, describe

    module = sys.modules.get(f"{__package__}.core.lifecycle")
    if module is None:
        return
    real = os.path.realpath(path)

    def here(directory: str, is_file_dir: bool) -> bool:
        if not directly_in:
            return _inside(directory, real)
        where = os.path.realpath(directory)  # a file beside: in path; a checkpoint: a child
        return (where if is_file_dir else os.path.dirname(where)) == real

    failures = [failure for checkpointer in module.open_checkpointers()
                for failure in checkpointer.unreported_failures(here, exports_only=exports_only)]
    if failures:
        where, error = failures[0]
        raise PersistError(f"{where}: the save failed, so it is not ready for what comes next "
                           f"({before}): {type(error).__name__}: {describe(error)}") from error


def install(module: Any = None) -> bool:
    """Wrap ``transformers.trainer_utils``' functions (see the module docstring); with no
    ``module``, the one imported, or, if transformers is not imported yet, when it is.
    Idempotent; returns True if it patched now."""
    global _hook, _ROTATE_SIGNATURE
    if "rotate_checkpoints" in _ORIGINALS:
        return False
    if module is None:
        module = sys.modules.get(TARGET)
        if module is None:
            if _hook is None:
                from deepspeed_async_ckpt_autoload import hook_import

                _hook = hook_import(TARGET, install)
            return False
    if not all(callable(getattr(module, name, None)) for name in WRAPPED):
        return False  # transformers < 5: see check_installed()
    signature = inspect.signature(module.rotate_checkpoints)
    if not {"output_dir", "save_total_limit"} <= set(signature.parameters):
        return False  # a rotation these wrappers do not know: see check_installed()
    _ROTATE_SIGNATURE = signature
    for name in WRAPPED:
        _ORIGINALS[name] = getattr(module, name)
    if vars(module).get("shutil") is shutil:  # its rotation's rmtree (see _Shutil)
        module.shutil = _SHUTIL
    # transformers.trainer (and the package's lazy attributes) bind these names at import: if
    # they were imported before us, rebind them there too.
    for holder in _holders(module):
        for name in WRAPPED:
            if vars(holder).get(name) is _ORIGINALS[name]:
                setattr(holder, name, globals()[name])
    return True


def _holders(module: Any = None) -> list[Any]:
    found = [module or sys.modules.get(TARGET), sys.modules.get("transformers.trainer"),
             sys.modules.get("transformers")]
    return [m for m in found if m is not None]


def uninstall() -> None:
    """Undo :func:`install` and :func:`check_installed`'s patch (tests)."""
    global _hook
    for holder in _holders():
        for name in WRAPPED:
            if name in _ORIGINALS and vars(holder).get(name) is globals()[name]:
                setattr(holder, name, _ORIGINALS[name])
        if vars(holder).get("shutil") is _SHUTIL:
            holder.shutil = shutil
    for (module, owner), methods in TRAINER_METHODS.items():
        for name in methods:
            if name in _ORIGINALS:
                setattr(_owner(module, owner), name, _ORIGINALS[name])
    if _hook is not None and _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
    _hook = None
    _ORIGINALS.clear()


def check_installed() -> None:
    """When this engine is built: wrap Trainer's Hub uploads, its model export and its
    just-in-time checkpoint (:data:`TRAINER_METHODS`) where transformers has imported them,
    and warn once if Trainer's
    helpers are imported without the wrappers (transformers < 5, or auto-activation off
    without ``install()``)."""
    global _warned
    for (module, owner), methods in TRAINER_METHODS.items():
        holder = _owner(module, owner)
        for name, wrapper in methods.items():
            method = getattr(holder, name, None)
            if method is not None and name not in _ORIGINALS:
                _ORIGINALS[name] = method
                setattr(holder, name, wrapper)
    if _warned or "rotate_checkpoints" in _ORIGINALS or TARGET not in sys.modules:
        return
    _warned = True
    logger.warning("async checkpoint: transformers' Trainer is imported, but its checkpoint "
                   "rotation (save_total_limit) and resume_from_checkpoint=True are not adapted "
                   "to asynchronous saves (transformers 5.x is, through the auto-activation hook "
                   "or deepspeed_async_ckpt.install()): rotation may delete the last committed "
                   "checkpoint while a new one is written, and resume may pick one a crash cut "
                   "short")
