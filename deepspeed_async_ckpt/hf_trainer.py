"""Hugging Face ``transformers.Trainer`` with this engine: rotation and resume that know a save
may still be in flight.

Trainer saves a DeepSpeed checkpoint into ``<output_dir>/checkpoint-N`` with
``engine.save_checkpoint``, which with this engine returns once the save is enqueued. In the
same call Trainer then deletes older ``checkpoint-*`` directories down to ``save_total_limit``,
always keeping the newest; and ``train(resume_from_checkpoint=True)`` resumes from the
highest-numbered one. Neither knew that the newest might not be committed yet:

- rotation deleted the last committed checkpoint while the new one was still being written
  (with ``save_total_limit=1``, a crash then left nothing to resume from), and deleted
  directories that earlier saves were still writing into (those saves failed);
- after a crash mid-persist, resume picked the ``checkpoint-N`` whose save it cut short, and
  raised.

:func:`install` wraps three functions of ``transformers.trainer_utils`` (transformers 5.x),
when that module is first imported (the ``.pth`` hook, see ``deepspeed_async_ckpt_autoload``),
before ``transformers.trainer`` binds their names:

- ``sort_checkpoints`` (the list rotation deletes from) leaves out the checkpoints that cannot
  be resumed yet or ever: still being saved by this process, or never committed (a crash or
  failure cut the save short). Trainer's own rule then runs on the rest, so
  ``save_total_limit`` counts resumable checkpoints, and one still being saved is kept on top,
  as during a synchronous save;
- ``rotate_checkpoints`` also deletes the never-committed ones older than the newest
  resumable one (nothing else would);
- ``get_last_checkpoint`` returns the newest resumable ``checkpoint-N``.

Directories holding no checkpoint of this engine are judged as Trainer judges them.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import shutil
import sys
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "transformers.trainer_utils"
POINTER = "latest"
"""DeepSpeed's pointer file in a save directory (Trainer's ``checkpoint-N``)."""

SAVING = "its DeepSpeed checkpoint is still being saved"

_ORIGINALS: dict[str, Any] = {}
_ROTATE_SIGNATURE: inspect.Signature | None = None
_hooked = False  # install() waits for transformers' import
_warned = False


def why_not_resumable(path: str) -> str | None:
    """Why ``Trainer`` cannot resume from the ``checkpoint-N`` directory ``path`` through this
    engine; None when it can, or when ``path`` holds no checkpoint of this engine (Trainer and
    DeepSpeed then judge it as they always do)."""
    from .commit import abandoned_checkpoints, committed_checkpoints

    if _being_saved(path):
        return SAVING
    committed = committed_checkpoints(path)
    partial = abandoned_checkpoints(path, before=float("inf"))
    if not committed and not partial:
        return None
    try:
        with open(os.path.join(path, POINTER), encoding="utf-8") as f:
            tag = f.read().strip()
    except FileNotFoundError:
        return f"its DeepSpeed checkpoint was never committed (no {POINTER!r} file)"
    except OSError as exc:
        return f"its {POINTER!r} file cannot be read: {exc}"
    if tag in partial:
        return f"{POINTER!r} names {tag!r}, which was never committed"
    return None


def _being_saved(path: str) -> bool:
    checkpointer = sys.modules.get(f"{__package__}.checkpointer")
    if checkpointer is None:  # no checkpointer was ever made in this process
        return False
    real = os.path.realpath(path)
    return any(d == real or d.startswith(real + os.sep) for d in checkpointer.saving_dirs())


def _checkpoint_number(path: str, prefix: str) -> int | None:
    match = re.fullmatch(re.escape(prefix) + r"-(\d+)", os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def sort_checkpoints(*args: Any, **kwargs: Any) -> list[str]:
    found = _ORIGINALS["sort_checkpoints"](*args, **kwargs)
    kept = []
    for path in found:
        why = why_not_resumable(path)
        if why is None:
            kept.append(path)
        else:
            logger.info("async checkpoint: %s is left out of Trainer's checkpoint rotation: %s",
                        path, why)
    return kept


def rotate_checkpoints(*args: Any, **kwargs: Any) -> None:
    _ORIGINALS["rotate_checkpoints"](*args, **kwargs)
    given = _ROTATE_SIGNATURE.bind(*args, **kwargs)
    given.apply_defaults()
    limit = given.arguments["save_total_limit"]
    if limit is not None and limit > 0:
        _remove_unresumable(given.arguments["output_dir"], given.arguments["checkpoint_prefix"])


def _remove_unresumable(output_dir: str, prefix: str) -> None:
    """Delete the ``checkpoint-N`` directories whose save never committed (and is not in
    flight) that are older, by step, than the newest resumable one."""
    found = _ORIGINALS["sort_checkpoints"](output_dir=output_dir, checkpoint_prefix=prefix)
    judged = [(path, _checkpoint_number(path, prefix), why_not_resumable(path)) for path in found]
    resumable = [n for _, n, why in judged if why is None and n is not None]
    if not resumable:
        return
    for path, number, why in judged:
        if why not in (None, SAVING) and number is not None and number < max(resumable):
            logger.warning("async checkpoint: deleting %s (save_total_limit): %s", path, why)
            shutil.rmtree(path, ignore_errors=True)


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


def install(module: Any = None) -> bool:
    """Wrap ``transformers.trainer_utils``' functions (see the module docstring); with no
    ``module``, the one imported, or, if transformers is not imported yet, when it is.
    Idempotent; returns True if it patched now."""
    global _hooked
    if _ORIGINALS:
        return False
    if module is None:
        module = sys.modules.get(TARGET)
        if module is None:
            if not _hooked:
                from deepspeed_async_ckpt_autoload import hook_import

                hook_import(TARGET, install)
                _hooked = True
            return False
    if not all(callable(getattr(module, name, None))
               for name in ("sort_checkpoints", "rotate_checkpoints", "get_last_checkpoint")):
        return False  # transformers < 5: see check_installed()
    global _ROTATE_SIGNATURE
    _ROTATE_SIGNATURE = inspect.signature(module.rotate_checkpoints)
    wrappers = {"sort_checkpoints": sort_checkpoints, "rotate_checkpoints": rotate_checkpoints,
                "get_last_checkpoint": get_last_checkpoint}
    for name in wrappers:
        _ORIGINALS[name] = getattr(module, name)
    # transformers.trainer (and the package's lazy attributes) bind these names at import: if
    # they were imported before us, rebind them there too.
    for holder in (module, sys.modules.get("transformers.trainer"), sys.modules.get("transformers")):
        for name, wrapper in wrappers.items():
            if holder is not None and vars(holder).get(name) is _ORIGINALS[name]:
                setattr(holder, name, wrapper)
    return True


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    for holder in (sys.modules.get(TARGET), sys.modules.get("transformers.trainer"),
                   sys.modules.get("transformers")):
        for name, original in _ORIGINALS.items():
            if holder is not None and vars(holder).get(name) is globals()[name]:
                setattr(holder, name, original)
    _ORIGINALS.clear()


def check_installed() -> None:
    """Warn once, when this engine is built in a process that has imported Trainer's helpers
    without the wrappers (transformers < 5, or auto-activation off without ``install()``)."""
    global _warned
    if _warned or _ORIGINALS or TARGET not in sys.modules:
        return
    _warned = True
    logger.warning("async checkpoint: transformers' Trainer is imported, but its checkpoint "
                   "rotation (save_total_limit) and resume_from_checkpoint=True are not adapted "
                   "to asynchronous saves (transformers 5.x is, through the auto-activation hook "
                   "or deepspeed_async_ckpt.install()): rotation may delete the last committed "
                   "checkpoint while a new one is written, and resume may pick one a crash cut "
                   "short")

