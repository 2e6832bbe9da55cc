"""The engine's one collective per save, in real gloo process groups (3 ranks)."""

import os

import torch.distributed as dist
import torch.multiprocessing as mp

from deepspeed_async_ckpt.checkpointer import exchange_across_ranks

WORLD = 3


def _rank(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    got = []
    # no error anywhere: everyone gets rank 0's value (each rank passes its own)
    got.append(exchange_across_ranks(f"id-of-rank-{rank}", None))
    # errors on ranks 1 and 2: every rank gets both messages, and still rank 0's value
    got.append(exchange_across_ranks(f"id-{rank}", None if rank == 0 else f"E{rank}: disk full ü"))
    # rank 0's value too long for the fixed-size message, and non-ASCII: the fallback path
    got.append(exchange_across_ranks("é" * 40 + str(rank), None))
    # an error on rank 0 alone
    got.append(exchange_across_ranks("x", "E0" if rank == 0 else None))
    # an empty value (errors only, as the Megatron adapter's finalize check)
    got.append(exchange_across_ranks("", None))
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.txt"), "w", encoding="utf-8") as f:
        f.write(repr(got))


def test_exchange_gives_rank0_value_and_every_error_to_every_rank(tmp_path):
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_rank, args=(init, str(tmp_path)), nprocs=WORLD, join=True)
    expected = [
        ("id-of-rank-0", {}),
        ("id-0", {1: "E1: disk full ü", 2: "E2: disk full ü"}),
        ("é" * 40 + "0", {}),
        ("x", {0: "E0"}),
        ("", {}),
    ]
    for rank in range(WORLD):
        with open(tmp_path / f"rank{rank}.txt", encoding="utf-8") as f:
            assert eval(f.read()) == expected, f"rank {rank}"
