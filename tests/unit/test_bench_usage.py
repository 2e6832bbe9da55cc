"""What a benchmark counts of a call it times (``deepspeed_async_ckpt.bench.usage.timed``)."""

import time

import pytest

from deepspeed_async_ckpt.bench.usage import timed


def test_a_timed_call_adds_its_seconds_and_start_and_returns_its_value():
    seconds, starts = [], []
    sleep = timed(lambda s: time.sleep(s) or "done", seconds.append, starts.append)
    before = time.perf_counter()
    assert sleep(0.02) == "done"
    assert len(seconds) == 1 and seconds[0] >= 0.02
    assert len(starts) == 1 and before <= starts[0] <= time.perf_counter()


def test_a_timed_call_that_raises_still_adds_its_seconds():
    seconds = []

    def fail():
        raise RuntimeError("store down")

    with pytest.raises(RuntimeError, match="store down"):
        timed(fail, seconds.append)()
    assert len(seconds) == 1
