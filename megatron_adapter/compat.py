"""Workarounds for megatron-core 0.16's distributed optimizer on torch's own Adam (no Apex,
no Transformer Engine: every CPU run, and GPU installs without those). They concern loading
any ``fully_reshardable`` optimizer checkpoint, ours or megatron's, not the engine.

1. ``DistributedOptimizer.state_dict()`` asserts that every param has an Adam ``step``; a fresh
   optimizer has none, so it cannot build the sharded state dict it loads into.
   :func:`materialize_optimizer_state` gives it megatron's own dummy state first (the load then
   overwrites every value).
2. ``load_parameter_state_from_fully_reshardable`` copies every key of the live Adam state from
   the checkpoint, including ``step``, which the checkpoint keeps in ``param_groups`` instead:
   ``KeyError: 'step'``. The patched copy copies the keys the live state has and the
   checkpoint holds (a ``dp_reshardable`` entry, Megatron-LM's default, also holds ``padding``
   and its buffer offsets, which the live state lacks), never ``step`` (a ``dp_reshardable``
   load request carries the live step, which must not overwrite the loaded one), under
   ``no_grad`` (an fp32 main param is a view of a leaf that requires grad).
3. ``load_state_dict`` gives every param the *same* ``step`` tensor, which torch Adam then
   increments once per param per iteration (wrong bias correction after a resume). The patch
   gives each param its own copy.

:func:`install` applies 2 and 3 (idempotent); with Apex or Transformer Engine it does nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_INSTALLED = False


def _torch_adam_path() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)


def materialize_optimizer_state(optimizer: Any) -> None:
    """Workaround 1: call before ``optimizer.sharded_state_dict(..., is_loading=True)``."""
    from megatron.core.optimizer import DistributedOptimizer

    if not _torch_adam_path():
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()


def install() -> bool:
    """Apply workarounds 2 and 3. Returns True if it patched."""
    global _INSTALLED
    if _INSTALLED or not _torch_adam_path():
        return False
    from megatron.core.optimizer import DistributedOptimizer

    original_set = DistributedOptimizer._set_main_param_and_optimizer_states
    original_load = DistributedOptimizer.load_state_dict

    @functools.wraps(original_set)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original_set(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destination = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():  # an fp32 main param is a view of a leaf that requires grad
            for key, target in destination.items():
                # not ``step``: load_state_dict set it from the checkpoint's param_groups (see
                # 2), and a dp_reshardable load request's entry holds the live one, which
                # would overwrite it (Adam's step after a resume would be the live one); a
                # dp_reshardable entry holds more keys
                if key in tensors and key != "step":
                    target.copy_(tensors[key])

    @functools.wraps(original_load)
    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = load_state_dict
    _INSTALLED = True
    return True
