"""The figures of a committed save: each rank's times travel in its record, the commit keeps
the largest over the ranks in the manifest and the commit report, and :class:`CommitFigures`
writes them, and the durable tiers' drains, as monitor events at the save's step."""

import json
import os
import time

import pytest
import torch

from deepspeed_async_ckpt import AsyncCheckpointConfig
from deepspeed_async_ckpt.commit import Pointer, read_manifest
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.core.figures import CommitFigures, write_to

from helpers import make

NAMES = ["async-ckpt/save-call-ms", "async-ckpt/fence-wait-ms", "async-ckpt/bytes",
         "async-ckpt/persisted-s", "async-ckpt/committed-s"]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_largest_save_call_over_the_ranks_reaches_the_manifest_and_the_commit_report(tmp_path, mode):
    """Rank 1's save call lasts 0.3 s longer than rank 0's: its record carries it, the manifest
    names rank 1 with it, and rank 0's commit report has it, though rank 0 never measured it."""
    same = lambda v, e, key="": (("same-id", False), {})  # noqa: E731
    infos = []
    r0 = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode), rank=0, world_size=2,
                           exchange=same, on_commit=infos.append)
    r1 = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode), rank=1, world_size=2,
                           exchange=same)
    d = str(tmp_path / "t1")
    r1.begin(d, tag="t1")
    r1.save({"w": torch.ones(1000)}, os.path.join(d, "rank1.pt"))
    time.sleep(0.3)
    r1.end()
    r0.begin(d, tag="t1", pointer=Pointer(str(tmp_path / "latest"), "t1"))
    r0.save({"w": torch.ones(10)}, os.path.join(d, "rank0.pt"))
    r0.end()
    for ck in (r1, r0):
        ck.wait()
        ck.close()
    record = json.load(open(os.path.join(d, ".async_ckpt", "rank_00001.same-id.json")))
    assert record["timings"]["save_call_s"] >= 0.3
    timings = read_manifest(d)["timings"]
    assert timings["save_call_s"] == {"max": record["timings"]["save_call_s"], "rank": 1}
    assert set(timings) == {"save_call_s", "fence_wait_s", "persisted_s"}
    (info,) = infos
    assert info.save_id == "same-id"
    assert info.save_call_s == record["timings"]["save_call_s"]
    assert info.persisted_s == timings["persisted_s"]["max"] and info.fence_wait_s == timings["fence_wait_s"]["max"]


class FakeWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))

    def flush(self):
        pass


def test_each_commit_is_written_at_its_step_and_each_drain_when_it_ends(tmp_path):
    """Saves at steps 10 and 20 (and one kept aside at 15): five figures each, at its step,
    equal to the commit report's; the drains to the tier as their own figure, at the step of
    the checkpoint drained; and how many checkpoints the tier is behind at each commit."""
    local, tier = tmp_path / "local", tmp_path / "tier"
    ck = make(tiers=[{"url": str(tier)}])
    infos = []
    ck.add_commit_callback(infos.append)
    writer = FakeWriter()
    steps = {}
    CommitFigures(write_to([writer]), step_of=lambda h: steps[h.tag]).attach(ck)
    for step, aside in ((10, False), (15, True), (20, False)):
        tag = f"step{step}"
        steps[tag] = step
        d = str(local / tag)
        ck.begin(d, tag=tag, pointer=None if aside else Pointer(str(local / "latest"), tag))
        ck.save({"w": torch.randn(64, 64)}, os.path.join(d, "model.pt"))
        ck.end()
        ck.fence()
        ck.wait()
        assert ck.tiers.wait_idle(60)
    ck.close()
    by_step = {}
    for name, value, step in writer.scalars:
        by_step.setdefault(step, {})[name] = value
    assert sorted(by_step) == [10, 15, 20]
    for info, step in zip(infos, (10, 15, 20)):
        row = by_step[step]
        assert row["async-ckpt/bytes"] == info.bytes
        assert row["async-ckpt/committed-s"] == round(info.seconds, 6)
        assert row["async-ckpt/save-call-ms"] == round(info.save_call_s * 1e3, 3)
        assert row["async-ckpt/fence-wait-ms"] == round(info.fence_wait_s * 1e3, 3)
        assert row["async-ckpt/persisted-s"] == info.persisted_s
    assert set(by_step[15]) == set(NAMES)  # kept aside: never drained, no tier figures
    for step in (10, 20):
        assert set(by_step[step]) == {*NAMES, "async-ckpt/tier0/drained-s", "async-ckpt/tier0/behind"}
        assert by_step[step]["async-ckpt/tier0/behind"] == 0  # each drained before the next save
        assert by_step[step]["async-ckpt/tier0/drained-s"] >= by_step[step]["async-ckpt/committed-s"]


def test_a_tier_that_drains_nothing_falls_further_behind_at_each_commit():
    """Commit numbers against the newest checkpoint on the tier: 0, 1, 2 behind while nothing
    drains; once the second is drained, the fourth commit is one behind."""
    events = []
    figures = CommitFigures(events.extend, step_of=lambda h: h.step)
    figures._tiers = 1

    class Handle:
        def __init__(self, i):
            self.save_id, self.step, self.times, self.pointer = f"s{i}", i, {"begin": 0.0}, "p"

    class Info:
        def __init__(self, i):
            self.save_id, self.ckpt_dir, self.bytes, self.seconds = f"s{i}", f"/c/{i}", 1, 1.0
            self.save_call_s = self.fence_wait_s = self.persisted_s = 0.0

    for i in range(3):
        figures.begun(Handle(i))
        figures.committed(Info(i))
    figures.drained(0, "/c/1")
    figures.begun(Handle(3))
    figures.committed(Info(3))
    behind = [(v, s) for n, v, s in events if n == "async-ckpt/tier0/behind"]
    assert behind == [(0, 0), (1, 1), (2, 2), (1, 3)]
    assert [s for n, v, s in events if n == "async-ckpt/tier0/drained-s"] == [1]
