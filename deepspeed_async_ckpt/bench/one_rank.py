"""What the load benchmarks stand on: one DeepSpeed rank on CPU, a ZeRO-1 engine that took one
step, the page cache dropped between loads, and a committed checkpoint copied into its save
directory's memory keeper as the ranks that saved it would have.

Used by ``scripts/bench_load.py`` and ``scripts/bench_memory_load.py``, and (the keeper fill)
by the memory tier's load tests. Imports torch and DeepSpeed only inside the functions.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
from typing import Any, Sequence

ZERO1 = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
         "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
"""The DeepSpeed config both load benchmarks train with (plus their ``async_checkpoint``)."""


def arguments(doc: str, work_dir: str) -> argparse.ArgumentParser:
    """The load benchmarks' options: the model's size, the repeats, the work directory
    (``work_dir``: its default), the JSON output."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=15, help="15 x hidden 2048: a 0.96 GB checkpoint")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", default=work_dir)
    p.add_argument("--out", default=None, help="JSON file for the results")
    return p


def init_one_rank() -> None:
    """This process as rank 0 of 1 (gloo, CPU accelerator), with this package's plugin on."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ..tools.launch import free_port  # a fixed port failed when another run held it

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed

    import deepspeed_async_ckpt

    deepspeed_async_ckpt.install()
    deepspeed.init_distributed(dist_backend="gloo")


def zero1_engine(hidden: int, layers: int, async_checkpoint: dict | None = None) -> Any:
    """A ZeRO-1 engine of :func:`~.model.build_model` (seeded: the same weights every call)
    after one training step; ``async_checkpoint``: the config's block (None: DeepSpeed's own
    checkpoint engine)."""
    import deepspeed
    import torch

    from .model import build_model

    config = copy.deepcopy(ZERO1)
    if async_checkpoint is not None:
        config["async_checkpoint"] = dict(async_checkpoint)
    torch.manual_seed(0)
    model = build_model(hidden, layers)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    eng.backward(eng(torch.randn(2, hidden)).sum())
    eng.step()
    return eng


def drop_page_cache(root: str) -> str | None:
    """Drop the page cache: every cache (``/proc/sys/vm/drop_caches``, root only), else
    ``root``'s files (``posix_fadvise(POSIX_FADV_DONTNEED)``). How it was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise(POSIX_FADV_DONTNEED)"


def owner(rel: str, ranks: Sequence[int]) -> int:
    """The rank whose part of a slot holds ``rel``: DeepSpeed's ``zero_pp_rank_<r>_`` files
    their rank's, every other file the first rank's."""
    match = re.match(r"(?:bf16_)?zero_pp_rank_(\d+)_", os.path.basename(rel))
    rank = int(match.group(1)) if match else ranks[0]
    return rank if rank in ranks else ranks[0]


def fill_keeper(save_dir: str, ckpt_dir: str, config: Any, ranks: Sequence[int] = (0,),
                late: Sequence[str] = ()) -> Any:
    """Copy the committed ``ckpt_dir`` (of ``save_dir``) into ``save_dir``'s keeper, started if
    none runs, each file in its :func:`owner`'s part of the slot, and commit it there with its
    manifest; the :class:`~..memory.client.KeeperClient`, connected. ``late``: files of
    ``ckpt_dir`` copied too and listed as the manifest's ``late_files`` (written after the
    commit, as megatron-core's markers are)."""
    from ..commit.manifest import read_manifest
    from ..memory.client import KeeperClient

    manifest = read_manifest(ckpt_dir)
    if late:
        manifest = dict(manifest, late_files=sorted(late))
    name = os.path.basename(ckpt_dir)
    client = KeeperClient.connect(save_dir, config)
    parts = {r: [rel for rel in [*manifest["files"], *late] if owner(rel, ranks) == r] for r in ranks}
    for rank, files in parts.items():
        sizes = {rel: os.path.getsize(os.path.join(ckpt_dir, rel)) for rel in files}
        res = client.reserve(name, manifest["save_id"], rank, tuple(ranks), sizes)
        for rel in files:
            with open(os.path.join(ckpt_dir, rel), "rb") as f:
                res.write(rel, f.read())
        res.report()
    client.commit(name, manifest["save_id"], manifest)
    return client
