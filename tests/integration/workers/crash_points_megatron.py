"""``crash_points.py`` for the Megatron adapter (megatron-core's ``torch_dist`` format, one rank).

``python crash_points_megatron.py SCENARIO OUT_DIR``: iteration 1 is committed (the tracker
names it); the scenario saves iteration 2 (``new``, ``keep_last=1``) or iteration 1 again
(``resave``), in a forked child killed right before its ``n``-th filesystem operation, for
every ``n``. Then, per run, a second child does what a resuming job does: the adapter's load
(recover, verify, ``dist_checkpointing.load``) of the iteration the tracker names, and the next
save (iteration 3). The commit's last steps (the marker files, a finalize step, and their
record, the swap of a re-saved iteration, the tracker) are crash points too.

``OUT_DIR/report.json``: ``{"n", "exit", "tracker", "loaded", "after"}`` per run: the iteration
the tracker named after the crash, the state that loaded (its iteration; the tensors are
compared with what that iteration saved, byte for byte: ``"same": true``), and the tracker
and the save directory's listing after the next save; ``"error"`` if the check failed.
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the CPU shim

import crash_points as cp  # noqa: E402
from megatron_cpu_shim import apply as apply_cpu_shim  # noqa: E402

apply_cpu_shim()
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402

from deepspeed_async_ckpt.config import AsyncCheckpointConfig  # noqa: E402
from megatron_adapter.checkpointer import MegatronCheckpointer, checkpoint_dir, read_tracker  # noqa: E402

SCENARIOS = ("new", "resave")
KEYS = ("w", "b", "exp_avg")


def tensors(step: int) -> dict:
    s = cp.state(step)
    return {"w": s["model"]["w"], "b": s["model"]["b"], "exp_avg": s["optim"]["exp_avg"]}


def sharded(values: dict, step: int | None) -> dict:
    out = {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in values.items()}
    if step is not None:
        out["iteration"] = step  # common state (common.pt)
    return out


def start(store: str) -> MegatronCheckpointer:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    return MegatronCheckpointer(AsyncCheckpointConfig(enabled=True, mode="async", host_buffer_gb=0.05,
                                                      writer_threads=2, keep_last=1))


def save(root: str, iteration: int, step: int, store: str, crash_at: int | None = None,
         count_file: str | None = None) -> None:
    ck = start(store)
    if crash_at is not None:
        cp.arm(crash_at)
    ck.save(sharded(tensors(step), step), root, iteration)
    ck.close()
    if count_file is not None:
        cp.write_count(count_file)


def check(root: str, store: str, result: str) -> None:
    out: dict = {}
    try:
        ck = start(store)
        ck.wait(recover=root)
        out["tracker"] = it = read_tracker(root)
        template = sharded({k: torch.empty_like(v) for k, v in tensors(1).items()}, None)
        template["iteration"] = None
        loaded = ck.load(template, checkpoint_dir(root, it))
        step = out["loaded"] = loaded["iteration"]
        expected = tensors(step)
        out["same"] = all(torch.equal(loaded[k], expected[k]) and loaded[k].dtype == expected[k].dtype
                          for k in KEYS)
        ck.save(sharded(tensors(3), 3), root, 3)
        ck.close()
        out["after"] = {"tracker": read_tracker(root), "listing": sorted(os.listdir(root)),
                        "files": sorted(os.listdir(checkpoint_dir(root, 3)))}
    except BaseException as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    with open(result, "w") as f:
        json.dump(out, f)


def main() -> int:
    scenario, out = sys.argv[1], os.path.abspath(sys.argv[2])
    if scenario not in SCENARIOS:
        raise SystemExit(f"unknown scenario {scenario!r}; one of {', '.join(SCENARIOS)}")
    torch.set_num_threads(1)
    stores = iter(range(10**6))

    def store() -> str:  # a fresh file store for each child's process group (runs in the child)
        return os.path.join(out, f"store.{os.getpid()}.{next(stores)}")

    def checked(n: int, root: str) -> dict:
        result = os.path.join(out, f"check.{n}.json")
        if cp.in_child(lambda: check(root, store(), result)) != 0 or not os.path.exists(result):
            return {"error": "the checking process failed"}
        with open(result) as f:
            return json.load(f)

    iteration = 2 if scenario == "new" else 1
    cp.crash_every_operation(
        scenario, out, lambda root: save(root, 1, 1, store()),
        lambda root, crash_at, count_file: save(root, iteration, 2, store(), crash_at, count_file),
        checked)
    return 0


if __name__ == "__main__":
    sys.exit(main())
