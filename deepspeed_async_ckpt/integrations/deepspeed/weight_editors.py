"""DeepSpeed's own in-place weight edits outside the optimizer step, made to fence first.

A save copies the weights lazily and only the optimizer step waits for those copies; an edit
between a save and the next step must wait for them too, or it reaches the file."""

from __future__ import annotations

import functools
from typing import Any

#: DeepSpeed's methods that change weights in place outside the optimizer step, patched to
#: fence first (see :func:`patch_weight_editors`): (owner, attribute) -> the original.
_EDITORS: dict[tuple[Any, str], Any] = {}


def patch_weight_editors() -> None:
    """Make DeepSpeed's own in-place weight edits outside the optimizer step fence first
    (:func:`~deepspeed_async_ckpt.core.fence_all`), so a save's lazy copies are done
    before them:

    - ``DeepSpeedHybridEngine._fuse_lora_layer``: ``generate()`` (RLHF rollouts) adds the
      LoRA product into the frozen base weights (``weight.data += scaling * A @ B``), then
      subtracts it, between a save and the next step; frozen weights are not rebuilt from
      the optimizer's fp32 copy on load, so the wrong value would survive a resume;
    - ``zero.GatheredParameters.__enter__`` with a ``modifier_rank``: the documented way to
      change ZeRO-3 parameters outside the step.

    Idempotent; called when an engine is built (DeepSpeed is fully imported by then)."""
    if _EDITORS:
        return
    from ...core import fence_all

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
