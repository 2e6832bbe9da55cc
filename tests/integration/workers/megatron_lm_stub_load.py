"""The Megatron-LM hook's load_checkpoint, with stand-ins for ``megatron.training`` (Megatron-LM
is not pip-installable): one rank, gloo. Prints one JSON line: what the hook did for a legacy
checkpoint (Megatron-LM's own ``--ckpt-format torch``) and for a partial one of this engine."""

import json
import os
import sys
import tempfile

from _megatron_lm_stand_ins import checkpointing, loaded, margs  # first: the group, the hook
import torch

load_dir = margs.load = tempfile.mkdtemp()
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
