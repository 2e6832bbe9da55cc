"""Audit: the hook's load_checkpoint with Megatron-LM's --pretrained-checkpoint (stand-ins for
megatron.training, one gloo rank). Megatron-LM's load_checkpoint reads the pretrained
directory (and sets args.finetune) when --load is unset or has no tracker."""

import argparse
import json
import os
import sys
import tempfile
import types

import torch.distributed as dist

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
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
pretrained = tempfile.mkdtemp()
margs = argparse.Namespace(async_ckpt=True, async_ckpt_config=None, async_ckpt_writers="replica",
                           async_save=False, save_retain_interval=None, load=None, ckpt_step=None,
                           pretrained_checkpoint=pretrained,
                           no_load_optim=False, no_load_rng=False, finetune=False)
mt.get_args = lambda: margs
sys.modules.update({"megatron.training": mt, "megatron.training.checkpointing": checkpointing,
                    "megatron.training.training": training})

from megatron.core import parallel_state  # noqa: E402

from megatron_adapter import megatron_lm  # noqa: E402

parallel_state.initialize_model_parallel(1, 1)
megatron_lm.install()
result = {}
# This engine's checkpoint in the pretrained directory, never committed (no manifest).
os.makedirs(os.path.join(pretrained, "iter_0000200", ".async_ckpt"))
with open(os.path.join(pretrained, "latest_checkpointed_iteration.txt"), "w") as f:
    f.write("200")


def attempt(name):
    loaded.clear()
    try:
        checkpointing.load_checkpoint([None], None, None)
        result[name] = "loaded"
    except Exception as exc:
        result[name] = f"{type(exc).__name__}: {exc}"


attempt("no_load")                     # --pretrained-checkpoint only
margs.load = tempfile.mkdtemp()        # --load without a checkpoint yet: Megatron-LM falls back
attempt("empty_load")
margs.load, margs.ckpt_step = None, 200  # --pretrained-checkpoint P --ckpt-step 200
attempt("ckpt_step")
print(json.dumps(result))
sys.stdout.flush()
os._exit(0)
