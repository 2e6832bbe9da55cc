"""The Megatron-LM hook's load_checkpoint, with stand-ins for ``megatron.training`` (Megatron-LM
is not pip-installable): one rank, gloo. Prints one JSON line: what the hook did for a legacy
checkpoint (Megatron-LM's own ``--ckpt-format torch``) and for a partial one of this engine."""

import argparse
import json
import os
import sys
import tempfile
import types

import torch
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
load_dir = tempfile.mkdtemp()
margs = argparse.Namespace(async_ckpt=True, async_ckpt_config=None, async_ckpt_writers="replica",
                           async_save=False, save_retain_interval=None, load=load_dir, ckpt_step=None,
                           no_load_optim=False, no_load_rng=False, finetune=False)
mt.get_args = lambda: margs
sys.modules.update({"megatron.training": mt, "megatron.training.checkpointing": checkpointing,
                    "megatron.training.training": training})

from megatron.core import parallel_state  # noqa: E402

from megatron_adapter import megatron_lm  # noqa: E402

parallel_state.initialize_model_parallel(1, 1)
megatron_lm.install()
result = {}
# Megatron-LM's legacy format at iteration 100: Megatron-LM detects it on disk and loads it.
os.makedirs(os.path.join(load_dir, "iter_0000100", "mp_rank_00"))
torch.save({"iteration": 100}, os.path.join(load_dir, "iter_0000100", "mp_rank_00", "model_optim_rng.pt"))
with open(os.path.join(load_dir, "latest_checkpointed_iteration.txt"), "w") as f:
    f.write("100")
checkpointing.load_checkpoint([None], None, None)
result["legacy"] = loaded[:]
# This engine's checkpoint, never committed (no manifest): refused before Megatron-LM reads it.
os.makedirs(os.path.join(load_dir, "iter_0000200", ".async_ckpt"))
with open(os.path.join(load_dir, "latest_checkpointed_iteration.txt"), "w") as f:
    f.write("200")
try:
    checkpointing.load_checkpoint([None], None, None)
    result["partial"] = "loaded"
except Exception as exc:
    result["partial"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(result))
sys.stdout.flush()
os._exit(0)
