"""The finalize-step seam of the core: steps a save carries (``begin(..., finalize=[...])``),
run by rank 0's committer after every rank persisted, between the manifest and the pointer.

Fast, single process: two ranks are two checkpointers in two threads, whose ``begin``
exchange meets in memory."""

from __future__ import annotations

import errno
import json
import os
import threading
from typing import Any

import pytest
import torch

from deepspeed_async_ckpt.commit import (LATE_FILES, META_DIR, FinalizeContext, KeepLast, Pointer,
                                         RetentionPolicy, read_manifest, verify_checkpoint)
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import CommitError, Failure, IntegrityError
from deepspeed_async_ckpt.storage import LocalStorage


class Step:
    """A finalize step writing ``files`` (name -> text), recording that it ran."""

    def __init__(self, events: list, files: dict[str, str] | None = None, fail: bool = False) -> None:
        self.events, self.contents, self.fail = events, files or {}, fail
        self.files = tuple(self.contents)
        self.seen: list[FinalizeContext] = []

    def __call__(self, ctx: FinalizeContext) -> None:
        self.seen.append(ctx)
        self.events.append(("step", tuple(self.files)))
        if self.fail:
            raise OSError(errno.EIO, "Input/output error")
        for name, text in self.contents.items():
            ctx.write_file(name, text)


class Recording(LocalStorage):
    """Records the commit's renames and exchanges, by the name they make."""

    def __init__(self, events: list) -> None:
        super().__init__(fsync=True)
        self.events = events

    def replace(self, src, dst, *, durable=True):
        super().replace(src, dst, durable=durable)
        self.events.append(("replace", os.path.basename(dst)))

    def swap(self, a, b):
        swapped = super().swap(a, b)
        if swapped:
            self.events.append(("swap", os.path.basename(b)))
        return swapped


class Recorded(RetentionPolicy):
    def __init__(self, events: list) -> None:
        self.events = events

    def should_keep(self, checkpoints):
        self.events.append(("retention", tuple(c.name for c in checkpoints)))
        return [True] * len(checkpoints)


def save(ck: AsyncCheckpointer, root: str, tag: str, steps=(), value: float = 1.0):
    d = os.path.join(root, tag)
    ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag), finalize=steps)
    ck.save({"w": torch.full((8,), value)}, os.path.join(d, f"rank{ck.rank}.pt"))
    return ck.end()


def test_the_commit_runs_manifest_then_steps_then_swap_then_pointer_then_retention(tmp_path):
    events: list = []
    root = str(tmp_path)
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01),
                           storage=Recording(events), retention=Recorded(events))
    first, second = Step(events, {"marker.json": "1"}), Step(events, {"sub/extra.txt": "2"})
    save(ck, root, "t", [first])
    ck.wait()
    del events[:]
    save(ck, root, "t", [first, second], value=2.0)  # a re-save: staged, then swapped in
    ck.wait()
    ck.close()
    commit = [e for e in events if e[0] != "replace" or e[1] in
              ("manifest.json", LATE_FILES, "marker.json", "extra.txt", "latest")]
    assert commit == [("replace", "manifest.json"),
                      ("step", ("marker.json",)), ("replace", "marker.json"),
                      ("step", ("sub/extra.txt",)), ("replace", "extra.txt"),
                      ("replace", LATE_FILES),
                      ("swap", "t"),
                      ("replace", "latest"),
                      ("retention", ("t",))], events
    ctx = second.seen[-1]
    assert ctx.ckpt_dir == os.path.join(root, "t") and ctx.write_dir != ctx.ckpt_dir  # staged
    assert ctx.tag == "t" and ctx.manifest["files"].keys() == {"rank0.pt"}
    assert read_manifest(os.path.join(root, "t"))["late_files"] == ["marker.json", "sub/extra.txt"]
    assert open(os.path.join(root, "latest")).read() == "t"


def test_the_commit_returns_the_bytes_its_steps_wrote(tmp_path):
    """A copy of the checkpoint kept elsewhere (the memory tier's slot of a save that also
    persists) takes the steps' files from the commit, as they were written, not read back."""
    from deepspeed_async_ckpt.commit import commit, write_rank_record

    d = str(tmp_path / "t")
    storage = LocalStorage(fsync=False)
    os.makedirs(os.path.join(d, META_DIR))  # as begin makes it
    write_rank_record(storage, d, rank=0, save_id="s1", checksum="xxh128", files=[])
    steps = [Step([], {"marker.json": '{"v": 1}'}), Step([], {"sub/extra.txt": "2"})]
    manifest, late = commit(storage, d, tag="t", save_id="s1", world_size=1, checksum="xxh128",
                            timeout_s=5, pointer=Pointer(str(tmp_path / "latest"), "t"), finalize=steps)
    assert late == {"marker.json": b'{"v": 1}', "sub/extra.txt": b"2"}
    assert manifest["late_files"] == sorted(late)
    for rel, data in late.items():
        with open(os.path.join(d, rel), "rb") as f:
            assert f.read() == data
    verify_checkpoint(d)


def test_a_steps_file_is_verified_as_every_other(tmp_path):
    root = str(tmp_path)
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01))
    save(ck, root, "t", [Step([], {"marker.json": '{"v": 1}'})])
    ck.close()
    d = os.path.join(root, "t")
    recorded = json.load(open(os.path.join(d, META_DIR, LATE_FILES)))
    assert list(recorded) == ["marker.json"] and recorded["marker.json"]["bytes"] == 8
    verify_checkpoint(d)
    with open(os.path.join(d, "marker.json"), "w") as f:
        f.write('{"v": 2}')  # same size, other bytes
    with pytest.raises(IntegrityError, match="marker.json"):
        verify_checkpoint(d)
    os.remove(os.path.join(d, META_DIR, LATE_FILES))  # as if the commit stopped after the steps
    with pytest.raises(IntegrityError, match="never finalized"):
        verify_checkpoint(d)


def test_a_step_writing_a_file_it_did_not_declare_fails_the_save(tmp_path):
    """The manifest lists the declared files before the steps run, so that a checkpoint whose
    steps never finished does not verify: a file not declared would go unchecked."""
    def sneaky(ctx):
        ctx.write_file("undeclared.json", "{}")

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01))
    with pytest.raises(CommitError, match="finalize step .*sneaky failed .*'undeclared.json' is not among"):
        save(ck, str(tmp_path), "t", [sneaky])
    assert not os.path.exists(tmp_path / "latest")
    ck.close()


@pytest.mark.parametrize("bad,match", [([42], "not callable"),
                                       ([type("S", (), {"files": "a.json", "__call__": lambda s, c: 0})()],
                                        "sequence of paths"),
                                       ([type("S", (), {"files": ("../a",), "__call__": lambda s, c: 0})()],
                                        "outside the checkpoint")])
def test_begin_refuses_a_step_that_cannot_run_before_anything_is_written(tmp_path, bad, match):
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    with pytest.raises(ValueError, match=match):
        ck.begin(str(tmp_path / "t"), tag="t", finalize=bad)
    assert not ck.is_open and not os.path.exists(tmp_path / "t")
    ck.close()


class TwoRanks:
    """``begin``'s exchange for two checkpointers of one process, one per thread."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=30)
        self.slots: list = [None, None]

    def exchange(self, rank: int):
        def exchange(value: Any, error: Failure | None, key: str = "") -> tuple[Any, dict[int, Failure]]:
            self.slots[rank] = (value, error)
            self.barrier.wait()
            got = self.slots[0][0], {r: e for r, (_, e) in enumerate(self.slots) if e is not None}
            self.barrier.wait()
            return got
        return exchange


def on_both_ranks(fn, cks) -> list:
    """``fn(ck)`` on each checkpointer, each in its own thread: what it returned or raised."""
    out: list = [None, None]

    def run(rank):
        try:
            out[rank] = fn(cks[rank])
        except BaseException as exc:  # noqa: BLE001
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_failing_step_fails_the_save_on_every_rank_and_leaves_the_previous_pointer(tmp_path):
    root = str(tmp_path)
    meet = TwoRanks()
    cks = [AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, keep_last=1),
                             rank=r, world_size=2, exchange=meet.exchange(r)) for r in (0, 1)]
    events: list = []
    ran_on_rank1 = Step(events, {"never.json": "{}"})

    def save_step(step_of_rank):
        def run(ck):
            handle = save(ck, root, step_of_rank[ck.rank][0], step_of_rank[ck.rank][1])
            handle.wait_committed(30)
            return handle
        return run

    on_both_ranks(save_step({0: ("s1", [Step([], {"m.json": "1"})]), 1: ("s1", [])}), cks)
    assert open(os.path.join(root, "latest")).read() == "s1"
    handles = on_both_ranks(save_step({0: ("s2", [Step(events, {"m.json": "2"}, fail=True)]),
                                       1: ("s2", [ran_on_rank1])}), cks)
    assert not handles[0].committed and handles[0].error is not None
    assert events == [("step", ("m.json",))]  # rank 0's step ran, rank 1's did not
    assert open(os.path.join(root, "latest")).read() == "s1"  # the previous checkpoint
    raised = on_both_ranks(lambda ck: save(ck, root, "s3"), cks)  # the next begin: every rank
    assert isinstance(raised[0], CommitError) and "finalize step Step failed" in str(raised[0]), raised
    assert "Input/output error" in str(raised[0])
    assert isinstance(raised[1], CommitError) and "on rank(s) 0" in str(raised[1]), raised
    assert not any(ck.is_open for ck in cks)
    verify_checkpoint(os.path.join(root, "s1"))  # kept: s2 never moved the pointer
    with pytest.raises(IntegrityError, match="never finalized"):
        verify_checkpoint(os.path.join(root, "s2"))
    for ck in cks:
        ck.close()


def test_keep_last_is_the_policy_the_core_builds_from_the_config(tmp_path):
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, keep_last=2))
    assert ck._retention.policy == KeepLast(2)
    ck.close()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    assert ck._retention.policy is None  # keep_last 0: every checkpoint kept
    ck.close()
    with pytest.raises(ValueError, match="retention must be a RetentionPolicy"):
        AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), retention=2)
