"""Trainer's checkpoint rotation and resume with saves in flight: the three functions of
``transformers.trainer_utils`` (transformers 5.x) that :func:`install` wraps, when that
module is first imported and before ``transformers.trainer`` binds their names (or rebinding
them there when it did):

- ``sort_checkpoints`` (the list rotation deletes from) leaves out the checkpoints that cannot
  be resumed yet or ever: still being saved by this process, or never committed (a crash or
  failure cut the save short). Trainer's own rule then runs on the rest, so
  ``save_total_limit`` counts resumable checkpoints, and those still being saved are kept on
  top, as during a synchronous save;
- ``rotate_checkpoints`` also deletes the never-committed ones older than the newest
  resumable one (nothing else would), and, in async mode, hands its deletions to the engine's
  retention thread (:class:`_Shutil`);
- ``get_last_checkpoint`` returns the newest resumable ``checkpoint-N``.

A rotation that left a save in flight out runs again at interpreter exit, once that save has
committed. Directories holding no checkpoint of this engine are judged as Trainer judges them.
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

from .in_flight import async_checkpointer_of_process, being_saved

logger = logging.getLogger(__name__)

TARGET = "transformers.trainer_utils"
POINTER = "latest"
"""DeepSpeed's pointer file in a save directory (Trainer's ``checkpoint-N``)."""
WRAPPED = ("sort_checkpoints", "rotate_checkpoints", "get_last_checkpoint")

SAVING_REASON = "its DeepSpeed checkpoint is still being saved"

_ORIGINALS: dict[str, Any] = {}
_ROTATE_SIGNATURE: inspect.Signature | None = None
_deferred: dict[str, tuple[tuple, dict]] = {}  # output_dir -> a rotation to run again at exit
_best_only_at_exit: dict[str, str] = {}
"""output_dir -> the best model's checkpoint, where Trainer's end of training (with
``save_total_limit=1``: every checkpoint but the best one deleted) did not see a save in
flight: done again at exit, after the rotation (see :func:`sort_checkpoints`)."""
_exit_registered = False


class Judgement:
    """Why Trainer cannot resume from a ``checkpoint-N`` (``reason``; None: it can, or the
    directory holds no checkpoint of this engine), and whether that is known for good
    (``never``: its save never committed) rather than for now (still being saved) or unknown
    (unreadable), which rotation deletes only in the first case."""

    def __init__(self, reason: str | None = None, never: bool = False) -> None:
        self.reason, self.never = reason, never


def judge(path: str) -> Judgement:
    from ...commit import scan_checkpoints

    if being_saved(path):
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
    prefix = given.arguments.get("checkpoint_prefix", checkpoint_prefix())
    # before the rotation: a save that commits during it may have been left out all the same
    found = _ORIGINALS["sort_checkpoints"](output_dir=output_dir, checkpoint_prefix=prefix)
    in_flight = any(being_saved(path) for path in found)
    best = given.arguments.get("best_model_checkpoint")
    if best is not None and being_saved(best):
        # the best model's checkpoint is the save in flight (the metric improved at this save):
        # left out of the list, it is kept anyway; named as well, Trainer counted it among the
        # checkpoints to keep, and would keep one committed checkpoint too many until the exit
        # (save_total_limit=1: two and the one in flight)
        given.arguments["best_model_checkpoint"] = None
    _rotating.checkpointer = async_checkpointer_of_process()
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
    does) and the engine's retention thread deletes it (``AsyncCheckpointer.remove_later``),
    off the training thread: deleting the previous checkpoint there takes 0.3 s for 1.85 GB
    idle, 0.6-1.0 s with the new save's writes in flight. What a crash leaves renamed is
    deleted at the next rotation in that directory. Anything else: ``shutil``'s."""

    def __getattr__(self, name: str) -> Any:
        return getattr(shutil, name)

    def rmtree(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        checkpointer = getattr(_rotating, "checkpointer", None)
        if checkpointer is None or not checkpointer.remove_later(os.fspath(path)):
            return shutil.rmtree(path, *args, **kwargs)
        return None


_SHUTIL = _Shutil()


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
    prefix = checkpoint_prefix()
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


def checkpoint_prefix() -> str:
    """Trainer's ``checkpoint-N`` prefix (``PREFIX_CHECKPOINT_DIR``)."""
    return getattr(sys.modules.get(TARGET), "PREFIX_CHECKPOINT_DIR", "checkpoint")


def is_installed() -> bool:
    return "rotate_checkpoints" in _ORIGINALS


def install(module: Any = None) -> bool:
    """Wrap ``transformers.trainer_utils``' functions (see the module docstring) in ``module``,
    or in the one imported (none: nothing done here; ``activation.adapt_trainer`` waits for
    the import). Idempotent; returns True if it patched now."""
    global _ROTATE_SIGNATURE
    if is_installed():
        return False
    if module is None:
        module = sys.modules.get(TARGET)
        if module is None:
            return False
    if not all(callable(getattr(module, name, None)) for name in WRAPPED):
        return False  # transformers < 5: see activation.check_installed
    signature = inspect.signature(module.rotate_checkpoints)
    if not {"output_dir", "save_total_limit"} <= set(signature.parameters):
        return False  # a rotation these wrappers do not know: see activation.check_installed
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
    """Undo :func:`install` (tests)."""
    for holder in _holders():
        for name in WRAPPED:
            if name in _ORIGINALS and vars(holder).get(name) is globals()[name]:
                setattr(holder, name, _ORIGINALS[name])
        if vars(holder).get("shutil") is _SHUTIL:
            holder.shutil = shutil
    _ORIGINALS.clear()
