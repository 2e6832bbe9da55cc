"""One rank of the DeepSpeed memory tier test (started by tools/launch.py): save at every step
with ``memory: {"persist_every": 3}``; after each save, rank 0 reads the keeper's newest
checkpoint back (every rank's files, verified) and notes what it holds against the state it
saved and, for a save on disk, against the files there. Then ``destroy()``: the last save
persisted, so the keeper ends. Writes ``memory.json`` under --out."""

import argparse
import io
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_worker import ds_config, init, train  # noqa: E402

from deepspeed_async_ckpt.commit import read_manifest  # noqa: E402
from deepspeed_async_ckpt.memory.client import KeeperClient  # noqa: E402


def same_state(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--saves", type=int, default=7)
    args = p.parse_args()
    args.bf16, args.pipeline_stages = 0, 0
    engine = init(args, ds_config(args, {"enabled": True, "host_buffer_gb": 0.05, "writer_threads": 2,
                                         "memory": {"enabled": True, "persist_every": 3, "keep_last": 2}}))
    save_dir = os.path.join(args.out, "ckpt")
    rank = torch.distributed.get_rank()
    seen = []
    for step in range(1, args.saves + 1):
        train(engine, args, 1, start=step - 1)
        engine.save_checkpoint(save_dir)
        engine.checkpoint_engine.checkpointer.wait()  # rank 0: committed
        if rank == 0:
            tag = f"global_step{step}"
            copy = KeeperClient.find(save_dir).newest()
            files = {r: copy.files(r) for r in copy.ranks}
            model = next(f for fs in files.values() for f in fs if f.endswith("model_states.pt"))
            owner = next(r for r, fs in files.items() if model in fs)
            view = copy.read(owner, model)
            saved = torch.load(io.BytesIO(bytes(view)), weights_only=False)["module"]
            view.release()
            on_disk = os.path.isdir(os.path.join(save_dir, tag))
            same_bytes = None
            if on_disk:
                same_bytes = True
                for r, names in files.items():
                    for name in names:
                        view = copy.read(r, name)
                        with open(os.path.join(save_dir, tag, name), "rb") as f:
                            same_bytes = same_bytes and f.read() == bytes(view)
                        view.release()
            seen.append({"tag": tag, "newest": copy.name, "files": {str(r): fs for r, fs in files.items()},
                         "manifest_tag": copy.manifest["tag"], "on_disk": on_disk, "same_bytes": same_bytes,
                         "same_manifest": on_disk and copy.manifest == read_manifest(os.path.join(save_dir, tag)),
                         "same_state": same_state(saved, engine.module.state_dict())})
            copy.close()
        torch.distributed.barrier()
    engine.destroy()
    if rank == 0:
        with open(os.path.join(args.out, "memory.json"), "w") as f:
            json.dump(seen, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
