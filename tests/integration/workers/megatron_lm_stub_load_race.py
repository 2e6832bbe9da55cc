"""Two ranks (``scripts/launch.py``) through the Megatron-LM hook's load_checkpoint, with
stand-ins for ``megatron.training``: rank 0 finds no tracker, rank 1 one naming a checkpoint
of this engine, as ranks reading the tracker on either side of another job's first commit
would (each its own --load here, to fix the order). Argument: an output directory; each rank
writes ``rank<N>.json`` with the error it got."""

import json
import os
import sys

from _megatron_lm_stand_ins import checkpointing, loaded, margs  # first: the group, the hook
import torch.distributed as dist

out = sys.argv[1]
rank = dist.get_rank()
margs.load = os.path.join(out, f"load{rank}")
os.makedirs(margs.load, exist_ok=True)
if rank == 1:
    os.makedirs(os.path.join(margs.load, "iter_0000200", ".async_ckpt"), exist_ok=True)
    with open(os.path.join(margs.load, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("200")
result = {}
try:
    checkpointing.load_checkpoint([None], None, None)
    result["error"] = None
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
result["loaded"] = loaded[:]
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
