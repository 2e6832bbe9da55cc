"""The Megatron-LM hook installed over stand-ins for ``megatron.training`` (Megatron-LM is not
pip-installable), in a one-rank gloo group (:mod:`_one_megatron_rank`), or in the group of the
ranks ``scripts/launch.py`` started; import it first.
``margs`` is what ``get_args()`` returns (set its fields per case); Megatron-LM's own
``load_checkpoint``, once the hook passes a load on, records its ``load_arg`` in ``loaded``."""

import argparse
import os
import sys
import types

if "RANK" in os.environ:  # started by scripts/launch.py: its ranks
    import _megatron_rank  # noqa: F401  (first: the process group, the shim, parallel state)
else:
    import _one_megatron_rank  # noqa: F401

loaded = []


def megatron_lm_load(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    loaded.append(load_arg)
    return 0, 0


checkpointing = types.ModuleType("megatron.training.checkpointing")
checkpointing.load_checkpoint = megatron_lm_load
checkpointing.save_checkpoint = lambda *a, **k: None
training = types.ModuleType("megatron.training.training")
training.pretrain = lambda *a, **k: None
training.load_checkpoint, training.save_checkpoint = megatron_lm_load, checkpointing.save_checkpoint
mt = types.ModuleType("megatron.training")
mt.__path__ = []
mt.checkpointing, mt.training, mt.pretrain = checkpointing, training, training.pretrain
margs = argparse.Namespace(async_ckpt=True, async_ckpt_config=None, async_ckpt_writers="replica",
                           async_save=False, save_retain_interval=None, load=None, ckpt_step=None,
                           pretrained_checkpoint=None, no_load_optim=False, no_load_rng=False,
                           finetune=False)
mt.get_args = lambda: margs
sys.modules.update({"megatron.training": mt, "megatron.training.checkpointing": checkpointing,
                    "megatron.training.training": training})

from megatron_adapter import megatron_lm  # noqa: E402

megatron_lm.install()
