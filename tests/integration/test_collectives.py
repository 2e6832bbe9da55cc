"""Agreement across ranks (the engine's one collective per save, :func:`agree`), in real gloo
process groups (3 ranks)."""

import os

import torch.distributed as dist
import torch.multiprocessing as mp

from deepspeed_async_ckpt.agreement import KEY_DIFFERS, agree, exchange_across_ranks, gather
from deepspeed_async_ckpt.errors import AgreementError, Failure

WORLD = 3


def _rank(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    got = []

    def plain(exchanged):  # (value, {rank: (kind, message)}): comparable once read back
        value, failures = exchanged
        return value, {r: (f.kind, f.message) for r, f in failures.items()}

    # no error anywhere: everyone gets rank 0's value (each rank passes its own)
    got.append(plain(exchange_across_ranks(f"id-of-rank-{rank}", None)))
    # errors on ranks 1 and 2: every rank gets both, and still rank 0's value
    got.append(plain(exchange_across_ranks(f"id-{rank}", None if rank == 0 else
                                           Failure(f"E{rank}", "disk full ü"))))
    # rank 0's value too long for the fixed-size message, and non-ASCII: the fallback path
    got.append(plain(exchange_across_ranks("é" * 40 + str(rank), None)))
    # an error on rank 0 alone
    got.append(plain(exchange_across_ranks("x", Failure("E0", "m") if rank == 0 else None)))
    # no value (errors only, as the Megatron adapter's checks), and a typed one: a tuple
    got.append(plain(exchange_across_ranks(None, None)))
    got.append(plain(exchange_across_ranks((f"id{rank}", rank == 0), None)))
    # keys: all the same; rank 2's differs (and rank 1's error is kept as it is)
    got.append(plain(exchange_across_ranks("v", None, key="/ckpt/step9")))
    got.append(plain(exchange_across_ranks("v", Failure("E1", "m") if rank == 1 else None,
                                           key="/ckpt/step9" if rank < 2 else "/other/step9")))
    # rank 0's value cannot be pickled (a lock): every rank fails, none waits for rank 0
    import threading

    value, failures = exchange_across_ranks(threading.Lock() if rank == 0 else "x", None)
    got.append((value, sorted(failures), failures[0].message.startswith("rank 0's value cannot be pickled")))
    # agree: rank 0's result on every rank; one rank's exception raised on every rank, typed
    got.append(agree("step", lambda: ("tag", rank, None)))

    def part():
        if rank == 2:
            raise OSError(28, "No space left on device")
        return rank

    try:
        agree("save", part)
        got.append("agreed")
    except AgreementError as exc:
        got.append((exc.step, {r: (f.kind, f.message) for r, f in exc.failures.items()},
                    type(exc.own).__name__, str(exc)))
    # gather: every rank's value, in rank order; one rank's failure (or a value that cannot
    # travel) raised on every rank, typed
    got.append(gather("names", lambda: [f"n{rank}"] * rank))
    for case in ("raises", "lock"):
        def listed():
            if rank == 1 and case == "raises":
                raise KeyError("no such tensor")
            return threading.Lock() if rank == 2 and case == "lock" else rank

        try:
            gather("names", listed)
            got.append("gathered")
        except AgreementError as exc:
            got.append((exc.step, sorted(exc.failures), exc.failures[min(exc.failures)].kind))
    # begin() on ranks that save into different directories: an error on every rank at once
    from deepspeed_async_ckpt.core import AsyncCheckpointer
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from deepspeed_async_ckpt.errors import AsyncCheckpointError

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True), rank=rank, world_size=WORLD)
    try:
        ck.begin(os.path.join(out, "ckpt", f"step{9 if rank != 1 else 8}"), tag="step9")
        got.append("began")
    except AsyncCheckpointError as exc:
        got.append(str(exc).replace(out, "OUT"))
    ck.close()
    # The checkpoint directory exists, with its marker, on every rank when begin returns, even
    # with rank 0 slow to make it: rank 0 makes it before the exchange. Made after it, rank
    # 0's rename into place raced the other ranks' first files (ENOENT, the save failed).
    import time

    from deepspeed_async_ckpt.core import session as checkpointer_module

    real = checkpointer_module.make_checkpoint_dir
    checkpointer_module.make_checkpoint_dir = lambda *a, **k: (time.sleep(0.3), real(*a, **k))[1]
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True), rank=rank, world_size=WORLD)
    made = os.path.join(out, "made", "step1")
    seen = []
    ck.begin(made, tag="step1")
    seen.append(os.path.isdir(os.path.join(made, ".async_ckpt")))
    ck.end(commit=False)
    # the same for a staged save (the directory holds something now: the save is written
    # beside it), whose staging directory rank 0 makes with storage.makedirs
    real_makedirs = ck.storage.makedirs
    ck.storage.makedirs = lambda path: (time.sleep(0.3), real_makedirs(path))[1]
    handle = ck.begin(made, tag="step1")
    seen.append(handle.write_dir != made and os.path.isdir(os.path.join(handle.write_dir, ".async_ckpt")))
    ck.end(commit=False)
    with open(os.path.join(out, f"made{rank}.txt"), "w", encoding="utf-8") as f:
        f.write(repr(seen))
    ck.close()
    checkpointer_module.make_checkpoint_dir = real
    # A load whose checkpoint only rank 1 finds saved again meanwhile: no rank raises inside
    # the framework's load (the others would wait there for rank 1), every rank at its end.
    import torch

    from deepspeed_async_ckpt.errors import IntegrityError

    own = os.path.join(out, f"own{rank}", "t")  # each rank's own checkpoint, saved alone
    alone = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync"),
                              exchange=lambda value, error: (value, {}))
    # (each rank verifies its own directory here: an exchange without the key that refuses that)
    loader = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True), rank=rank, world_size=WORLD,
                               exchange=lambda value, error: exchange_across_ranks(value, error))
    for step in (1, 2):
        if step == 1 or rank == 1:
            alone.begin(own, tag="t")
            alone.save({"step": torch.tensor(step)}, os.path.join(own, "m.pt"))
            alone.end()
        if step == 1:
            loader.verify_all_ranks(own)
    try:
        with loader.collective_load("load_checkpoint"):
            loader.load(os.path.join(own, "m.pt"))
            dist.barrier()  # a framework collective: every rank reaches it
        got.append("loaded")
    except IntegrityError as exc:
        got.append(str(exc).split(": checkpoint")[0])
    alone.close()
    loader.close()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.txt"), "w", encoding="utf-8") as f:
        f.write(repr(got))


def test_exchange_gives_rank0_value_and_every_error_to_every_rank(tmp_path):
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_rank, args=(init, str(tmp_path)), nprocs=WORLD, join=True)
    expected = [
        ("id-of-rank-0", {}),
        ("id-0", {1: ("E1", "disk full ü"), 2: ("E2", "disk full ü")}),
        ("é" * 40 + "0", {}),
        ("x", {0: ("E0", "m")}),
        (None, {}),
        (("id0", True), {}),
        ("v", {}),
        ("v", {1: ("E1", "m"), 2: (KEY_DIFFERS, "works in '/other/step9', rank 0 in '/ckpt/step9'")}),
        (None, [0], True),
        ("tag", 0, None),
    ]
    for rank in range(WORLD):
        with open(tmp_path / f"rank{rank}.txt", encoding="utf-8") as f:
            got = eval(f.read())
        assert got[-1] == "load_checkpoint refused on every rank: on rank(s) 1: IntegrityError", rank
        got.pop()
        assert got[-3:-1] == [("names", [1], "KeyError"), ("names", [2], "TypeError")], rank
        assert got[-4] == [[], ["n1"], ["n2", "n2"]], rank
        del got[-4:-1]
        assert got[:-2] == expected, f"rank {rank}"
        assert got[-2] == ("save", {2: ("OSError", "[Errno 28] No space left on device")},
                           "OSError" if rank == 2 else "NoneType",
                           "save failed on rank(s) 2: OSError: [Errno 28] No space left on device"), rank
        assert got[-1] == (
            f"the ranks are not saving the same checkpoint (rank {rank}: 'OUT/ckpt/step{9 if rank != 1 else 8}'): "
            "rank(s) 1: works in 'OUT/ckpt/step8', rank 0 in 'OUT/ckpt/step9'; every rank must "
            "pass the same save_dir and tag (nothing was written)"), f"rank {rank}"
    assert not os.path.exists(tmp_path / "ckpt")
    assert [(tmp_path / f"made{rank}.txt").read_text() for rank in range(WORLD)] == ["[True, True]"] * WORLD


def _replica_state(rank: int, differ: bool = False) -> dict:
    import torch

    torch.manual_seed(0)  # the same tensors on every replica
    return {"module": {f"w{i}": torch.randn(64 * (i + 1), 64) for i in range(6)},
            "bias": torch.randn(7), "empty": torch.empty(0), "steps": 5,
            "client": rank if differ else 0}


def _replicas_rank(rank: int, init: str, out: str) -> None:
    import torch

    from deepspeed_async_ckpt.core import AsyncCheckpointer, Replicas
    from deepspeed_async_ckpt.commit import Pointer
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from deepspeed_async_ckpt.errors import AsyncCheckpointError

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    replicas = Replicas(rank=rank, size=WORLD)
    staged = {}
    for tag, mode, differ in (("same", "async", False), ("sync", "sync", False), ("differ", "async", True)):
        ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode, host_buffer_gb=0.05),
                               rank=rank, world_size=WORLD)
        d = os.path.join(out, tag)
        ck.begin(d, tag=tag, pointer=Pointer(os.path.join(out, f"latest_{tag}"), tag))
        staged[tag] = ck.save(_replica_state(rank, differ), os.path.join(d, "model.pt"), replicas=replicas)
        ck.save({"own": torch.full((10,), float(rank))}, os.path.join(d, f"rank{rank}.pt"))
        ck.end()
        ck.close()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True), rank=rank, world_size=WORLD)
    ck.begin(os.path.join(out, "names"), tag="names")
    try:  # replicas that save different files: an error on every replica, not a silent drop
        ck.save(_replica_state(rank), os.path.join(out, "names", f"m{rank % 2}.pt"), replicas=replicas)
        staged["names"] = "no error"
    except AsyncCheckpointError as exc:
        staged["names"] = str(exc)
    ck.end(commit=False)
    ck.close()
    dist.destroy_process_group()
    with open(os.path.join(out, f"staged{rank}.txt"), "w", encoding="utf-8") as f:
        f.write(repr(staged))


def test_replicas_write_one_share_each_of_the_same_file(tmp_path):
    """Three replicas of one state each stage and write a share of its file; the file is byte
    for byte what one rank writes alone, the manifest checks each share, and a file that
    differs between replicas is written whole by the first one."""
    import pytest
    import torch

    from deepspeed_async_ckpt.core import AsyncCheckpointer
    from deepspeed_async_ckpt.commit import read_manifest, verify_checkpoint, verify_file
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from deepspeed_async_ckpt.errors import IntegrityError

    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_replicas_rank, args=(init, str(tmp_path)), nprocs=WORLD, join=True)
    staged = [eval((tmp_path / f"staged{r}.txt").read_text(encoding="utf-8")) for r in range(WORLD)]
    alone = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, split_replicated_files=False))
    alone.begin(str(tmp_path / "alone"), tag="alone")
    total = alone.save(_replica_state(0), str(tmp_path / "alone" / "model.pt"))
    alone.end()
    alone.close()
    reference = (tmp_path / "alone" / "model.pt").read_bytes()
    for tag in ("same", "sync"):
        assert (tmp_path / tag / "model.pt").read_bytes() == reference, tag
        # each replica staged only its share, about a third, and together every record once
        assert sum(s[tag] for s in staged) == total
        assert all(0.2 * total < s[tag] < 0.5 * total for s in staged), [s[tag] for s in staged]
        manifest = verify_checkpoint(str(tmp_path / tag))
        entry = manifest["files"]["model.pt"]
        assert [s[0] for s in entry["segments"]][0] == 0 and len(entry["segments"]) == WORLD
        assert sorted(manifest["files"]) == ["model.pt"] + [f"rank{r}.pt" for r in range(WORLD)]
        assert not list((tmp_path / tag).glob("model.pt.tmp.*"))
    # the first replica's file, written by it alone, when the replicas' states differ
    assert [s["differ"] for s in staged] == [total, 0, 0]
    assert torch.load(tmp_path / "differ" / "model.pt", weights_only=False)["client"] == 0
    assert "segments" not in read_manifest(str(tmp_path / "differ"))["files"]["model.pt"]
    for s in staged:
        assert "replicas are saving different files" in s["names"], s["names"]
    # a flipped byte in the middle share is found, and named with its byte range
    offset, length, _ = read_manifest(str(tmp_path / "same"))["files"]["model.pt"]["segments"][1]
    path = tmp_path / "same" / "model.pt"
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=rf"model.pt: xxh128 \w+ \(bytes {offset}-{offset + length}\).*corrupted"):
        verify_file(str(path))


def _verify_rank(rank: int, init: str, out: str) -> None:
    import torch

    from deepspeed_async_ckpt.core import AsyncCheckpointer
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from deepspeed_async_ckpt.errors import IntegrityError

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    loader = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True), rank=rank, world_size=2)
    # each rank read `latest` a moment apart, and the trainer moved it in between
    d = os.path.join(out, "step5" if rank == 0 else "step6")
    try:
        loader.verify_all_ranks(d, action="load_checkpoint")
        with loader.collective_load("load_checkpoint"):
            x = loader.load(os.path.join(d, "a.pt"))["x"]
            dist.barrier()
        result = "loaded" if torch.equal(x, torch.arange(1000)) else "LOADED DAMAGED DATA"
    except IntegrityError as exc:
        result = f"refused: {exc}"
    loader.close()
    dist.destroy_process_group()
    with open(os.path.join(out, f"result{rank}.txt"), "w") as f:
        f.write(result)


def test_ranks_verifying_different_checkpoints_are_refused(tmp_path):
    """Ranks that resolved different checkpoints (an evaluation job whose ranks read `latest`
    on either side of the trainer's commit) each verify only their share of their own one:
    step6's a.pt (unit 0, rank 0's share of step6) is checked by nobody, and rank 1 loads it
    damaged. They are refused, as begin() refuses ranks saving into different directories."""
    import zipfile

    import torch

    from deepspeed_async_ckpt.core import AsyncCheckpointer
    from deepspeed_async_ckpt.commit import Pointer
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig

    root = str(tmp_path)
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01))
    for tag in ("step5", "step6"):
        d = os.path.join(root, tag)
        ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
        ck.save({"x": torch.arange(1000)}, os.path.join(d, "a.pt"))
        ck.save({"y": torch.arange(1000)}, os.path.join(d, "b.pt"))
        ck.end()
    ck.close()
    path = tmp_path / "step6" / "a.pt"
    with zipfile.ZipFile(path) as z:  # the tensor's bytes: damaged, size unchanged
        info = next(i for i in z.infolist() if i.filename.endswith("data/0"))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + n + m + 8)
        f.write(b"\xff\xff\xff\xff")
    mp.spawn(_verify_rank, args=(f"file://{tmp_path / 'store'}", root), nprocs=2, join=True)
    results = [(tmp_path / f"result{r}.txt").read_text() for r in range(2)]
    assert all(r.startswith("refused") for r in results), results
    assert "works in" in results[0] and "step6" in results[0] and "step5" in results[0], results
