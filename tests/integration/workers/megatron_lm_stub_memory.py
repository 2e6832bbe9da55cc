"""The Megatron-LM hook's load_checkpoint with the memory tier, with stand-ins for
``megatron.training``: one rank, gloo. The keeper holds iter_0000002, the save directory only
iter_0000001 (the tracker rolled back); Megatron-LM's load (a stand-in recording what it
would read: ``--load``, the tracker there, a file's bytes) must read the keeper's copy, then
with the keeper killed the disk's. Prints one JSON line."""

import json
import os
import shutil
import sys
import tempfile

from _megatron_lm_stand_ins import checkpointing, margs  # first: the group, the hook

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + "/tests")
import torch  # noqa: E402

from _memory import fill_keeper, kill_keepers, restore_dirs  # noqa: E402
from deepspeed_async_ckpt.commit import Pointer  # noqa: E402
from deepspeed_async_ckpt.memory.config import MemoryConfig  # noqa: E402
from megatron_adapter import megatron_lm  # noqa: E402

load_dir = margs.load = os.path.join(tempfile.mkdtemp(), "ckpt")
os.environ["XDG_RUNTIME_DIR"] = os.path.dirname(load_dir)
engine = megatron_lm._engine(margs)
object.__setattr__(engine.config, "memory", MemoryConfig(enabled=True, idle_timeout_s=60))
tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
ck = engine.checkpointer
for it in (1, 2):
    d = os.path.join(load_dir, f"iter_{it:07d}")
    ck.begin(d, tag=str(it), pointer=Pointer(tracker, str(it)))
    ck.save({"w": torch.full((64,), float(it))}, os.path.join(d, "model.pt"))
    for marker in (".metadata", "metadata.json"):  # megatron-core's, which the hook's check wants
        ck.save({"marker": marker}, os.path.join(d, marker))
    ck.end()
    ck.wait()
saved = open(os.path.join(load_dir, "iter_0000002", "model.pt"), "rb").read()
fill_keeper(load_dir, os.path.join(load_dir, "iter_0000002")).close()
shutil.rmtree(os.path.join(load_dir, "iter_0000002"))
with open(tracker, "w") as f:
    f.write("1")

seen = []


def megatron_lm_load(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    where = getattr(margs, load_arg)
    it = open(os.path.join(where, "latest_checkpointed_iteration.txt")).read()
    data = open(os.path.join(where, f"iter_{int(it):07d}", "model.pt"), "rb").read()
    seen.append({"dir": where, "tracker": it, "same_bytes": data == saved})
    return 0, 0


megatron_lm._ORIGINALS["load"] = megatron_lm_load
result = {}
checkpointing.load_checkpoint([None], None, None)
result["memory"] = dict(seen[-1], load_after=margs.load, left=restore_dirs(load_dir))
kill_keepers(load_dir)
checkpointing.load_checkpoint([None], None, None)
result["killed"] = dict(seen[-1], load_after=margs.load, left=restore_dirs(load_dir))
result["load_dir"] = load_dir
print(json.dumps(result))
sys.stdout.flush()
os._exit(0)
