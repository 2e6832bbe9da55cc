"""Write pacing (``pace_writes``, :mod:`deepspeed_async_ckpt.persist.pacing`): the rate follows
the save cadence, pacing never makes a save finish after the next one is due, a new save or a
wait ends it, and paced files are byte for byte the unpaced ones."""

import os
import threading
import time

import pytest
import torch

from deepspeed_async_ckpt.persist.pacing import WritePacer

from helpers import make, sample_state, save_one

MiB = 1 << 20


class FakeClock:
    """Seconds that pass only when someone sleeps, or a fake disk writes."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def write_all(schedule, clock, nbytes, chunk=MiB, disk_bytes_per_s=None):
    """Write ``nbytes`` in ``chunk``s through ``schedule`` on ``clock``; each write takes
    ``chunk / disk_bytes_per_s`` seconds (none: instant). The (time, bytes written) after
    each write."""
    done, trace = 0, []
    while done < nbytes:
        schedule.take(chunk)
        if disk_bytes_per_s:
            clock.now += chunk / disk_bytes_per_s
        done += chunk
        trace.append((clock.now, done))
    return trace


def test_the_first_save_is_not_paced_and_the_next_ones_follow_the_cadence():
    clock = FakeClock()
    pacer = WritePacer(0.5, clock=clock, sleep=clock.sleep, burst=4 * MiB)
    assert pacer.start("s0", 0.0, 100 * MiB) is None  # no cadence yet: flat out
    for key, begun, interval in (("s1", 10.0, 10.0), ("s2", 30.0, 20.0), ("s3", 35.0, 5.0)):
        clock.now = begun
        schedule = pacer.start(key, begun, 100 * MiB)
        assert pacer.interval == interval
        assert schedule.deadline == begun + 0.5 * interval
        trace = write_all(schedule, clock, 100 * MiB)
        # never ahead of the line (bytes by time t: burst + total x elapsed / span) ...
        for t, done in trace:
            assert done <= 4 * MiB + 100 * MiB * (t - begun) / (0.5 * interval) + 1e-6, (key, t, done)
        # ... and done by the deadline, the burst's worth before it: the rate is
        # total / (fraction x interval)
        assert trace[-1][0] == pytest.approx(begun + 0.5 * interval * 96 / 100, abs=1e-6), key
        half = next(t for t, done in trace if done >= 50 * MiB)
        assert half == pytest.approx(begun + 0.5 * interval * 46 / 100, abs=0.01 * interval), key


@pytest.mark.parametrize("disk_s", [2.0, 4.9, 8.0, 30.0])
def test_pacing_never_makes_a_save_finish_after_the_next_one_is_due(disk_s):
    """A disk that writes the save in ``disk_s`` seconds, flat out; saves every 10 s, paced
    over 5 s. Where the disk keeps up, the save is done by the deadline; where it does not,
    pacing holds no write at all, and the save finishes when it would have unpaced."""
    clock = FakeClock()
    pacer = WritePacer(0.5, clock=clock, sleep=clock.sleep, burst=MiB)
    pacer.start("s0", 0.0, 0)
    clock.now = 10.0
    schedule = pacer.start("s1", 10.0, 100 * MiB)
    trace = write_all(schedule, clock, 100 * MiB, disk_bytes_per_s=100 * MiB / disk_s)
    finished = trace[-1][0]
    assert finished <= max(10.0 + 5.0, 10.0 + disk_s) + 1e-6
    assert finished < 20.0 or disk_s > 10.0  # the next save is due at 20
    if disk_s >= 5.0:
        assert schedule.waited_s == pytest.approx(0.0, abs=0.02 * disk_s), disk_s
    else:
        assert finished == pytest.approx(15.0, abs=0.05)


def test_bytes_added_to_a_save_speed_its_pace_up_and_an_early_save_hurries_the_last():
    clock = FakeClock()
    pacer = WritePacer(0.5, clock=clock, sleep=clock.sleep, burst=0)
    pacer.start("s0", 0.0, 0)
    clock.now = 10.0
    schedule = pacer.start("s1", 10.0, 50 * MiB)
    assert pacer.start("s1", 10.0, 50 * MiB) is schedule and schedule.total == 100 * MiB
    trace = write_all(schedule, clock, 50 * MiB)
    assert trace[-1][0] == pytest.approx(12.5, abs=1e-6)  # half the bytes: half the span
    pacer.start("s2", clock.now, 10 * MiB)  # a save before s1's writes are done: s1 goes at once
    before = clock.now
    write_all(schedule, clock, 50 * MiB)
    assert clock.now == before


def test_a_sleeping_writer_wakes_when_the_next_save_begins_or_someone_waits():
    for end in ("next save", "hurry"):
        pacer = WritePacer(0.5, burst=0)
        now = time.perf_counter()
        pacer.start("s0", now - 100.0, 0)
        schedule = pacer.start("s1", now, 100 * MiB)  # 50 s for 100 MiB
        took = []
        writer = threading.Thread(target=lambda: (schedule.take(90 * MiB), took.append(time.perf_counter())))
        writer.start()
        time.sleep(0.2)
        assert not took  # asleep: 90 MiB are due 45 s in
        t0 = time.perf_counter()
        pacer.start("s2", t0, 0) if end == "next save" else pacer.hurry()
        writer.join(10)
        assert took and took[0] - t0 < 1.0, end


def test_paced_files_are_the_unpaced_files_byte_for_byte(tmp_path):
    state = sample_state()
    state["module"]["big"] = torch.randn(512, 1024)  # 2 MiB: more than the burst below
    for persist_in in ("thread", "process"):
        files = {}
        for paced in (False, True):
            ck = make(gb=0.05, pace_writes=paced, persist_in=persist_in)
            pacer = ck._files._persist.pacer
            assert (pacer is not None) == paced
            if paced:
                pacer._burst = 0
            root = tmp_path / f"{persist_in}-{paced}"
            for tag in ("t1", "t2", "t3"):
                save_one(ck, str(root), state, tag=tag)
                ck.fence()
                time.sleep(0.05)
            ck.wait()
            if paced:  # the second and third saves went through their schedules
                assert pacer.interval is not None and pacer.current.taken > 2 * MiB
            files[paced] = [(root / tag / "model.pt").read_bytes() for tag in ("t1", "t2", "t3")]
            ck.close()
        assert files[True] == files[False], persist_in


def test_wait_hurries_paced_writes(tmp_path):
    """A save paced over a long interval (saves 100 s apart) is written at once when someone
    waits for it, with its bytes as saved."""
    state = sample_state()
    state["module"]["big"] = torch.randn(1024, 1024)
    ck = make(gb=0.05, pace_writes=True)
    pacer = ck._files._persist.pacer
    pacer._burst = 0
    save_one(ck, str(tmp_path), state, tag="t1")
    ck.wait()
    pacer._begun_at -= 100.0  # as if the first save began 100 s ago
    expect = {k: v.clone() for k, v in state["module"].items()}
    save_one(ck, str(tmp_path), state, tag="t2")
    ck.fence()
    assert pacer.current is not None and pacer.current.span > 40
    time.sleep(0.3)
    t0 = time.perf_counter()
    ck.wait()
    assert time.perf_counter() - t0 < 10.0
    got = torch.load(os.path.join(tmp_path, "t2", "model.pt"), weights_only=False)["module"]
    assert all(torch.equal(got[k], v) for k, v in expect.items())
    ck.close()


def test_both_writers_take_the_calls_the_file_writer_declares_and_pace_alike():
    """The core holds a ``FileWriter``: both writers take its calls as declared, and pacing is
    one helper they share: no pacer, nothing paced; with one, a save's files submitted after
    ``pace`` follow that save's schedule until ``hurry``."""
    from deepspeed_async_ckpt.persist import FileWriter, ProcessWriter, ThreadWriter
    from deepspeed_async_ckpt.persist.pacing import PacedWrites
    from helpers import declared_calls, takes_declared_calls

    assert declared_calls(FileWriter) == ["close", "hurry", "pace", "submit", "write"]
    for cls in (ThreadWriter, ProcessWriter):
        assert takes_declared_calls(cls, FileWriter) == [] and issubclass(cls, PacedWrites)
    assert PacedWrites(None).take() is None
    clock = FakeClock()
    paced = PacedWrites(WritePacer(0.5, clock=clock, sleep=clock.sleep, burst=MiB))
    paced.pace("s0", 0.0, 10 * MiB)
    assert paced.take() is None  # the first save: no cadence yet
    paced.pace("s1", 10.0, 10 * MiB)
    take = paced.take()
    assert take.__self__ is paced.pacer.current and paced.pacer.current.span == 5.0
    paced.hurry()
    clock.now = 10.0
    take(10 * MiB)  # hurried: at once
    assert clock.now == 10.0
