"""Audit: the hook's load_checkpoint with Megatron-LM's --pretrained-checkpoint (stand-ins for
megatron.training, one gloo rank). Megatron-LM's load_checkpoint reads the pretrained
directory (and sets args.finetune) when --load is unset or has no tracker."""

import json
import os
import sys
import tempfile

from _megatron_lm_stand_ins import checkpointing, loaded, margs  # first: the group, the hook

pretrained = margs.pretrained_checkpoint = tempfile.mkdtemp()
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
