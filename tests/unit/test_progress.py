"""Progress of long operations: bytes done of the total, the rate and the time left, reported
no sooner than a first delay and then at a bounded rate; a restore and a drain log it, and
``ds-async-ckpt verify`` writes it to standard error only (a bar on a terminal)."""

import io
import json
import logging
import os
import shutil
import sys

import torch

from deepspeed_async_ckpt import progress
from deepspeed_async_ckpt.commit import Pointer
from deepspeed_async_ckpt.progress import Progress, track
from deepspeed_async_ckpt.tiers.remote import PathRemote
from deepspeed_async_ckpt.tiers.restore import restore

from helpers import make, sample_state, save_one


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_nothing_before_the_first_delay_then_at_most_one_line_per_interval():
    clock, out = Clock(), io.StringIO()
    p = Progress("restore of step1", 4_000_000_000, stream=out, first_after_s=5, every_s=30, clock=clock)
    clock.now += 4
    p.add(1_000_000_000)
    assert out.getvalue() == ""  # a short operation says nothing
    clock.now += 6  # 10 s in: 2 GB done
    p.add(1_000_000_000)
    clock.now += 10  # within the interval: nothing more
    p.add(1_000_000_000)
    lines = out.getvalue().splitlines()
    assert lines == ["restore of step1: 2 GB of 4 GB (50%), 200 MB/s, 10s left"]
    clock.now += 25  # 45 s in, 35 since the last line
    p.add(500_000_000)
    clock.now += 5
    p.add(500_000_000)
    p.done()
    p.done()  # once
    assert out.getvalue().splitlines()[1:] == [
        "restore of step1: 3.5 GB of 4 GB (88%), 77.8 MB/s, 6s left",
        "restore of step1: done, 4 GB in 50s (80 MB/s)"]


def test_track_counts_each_item_once_the_loop_moves_on_and_logs_without_a_stream(caplog):
    clock = Clock()
    seen = []
    with caplog.at_level(logging.INFO, logger="deepspeed_async_ckpt.progress"):
        for item in track(["a", "bb", "ccc"], lambda s: len(s) * 1000, "drain of x", first_after_s=0,
                          every_s=0, clock=clock):
            clock.now += 1
            seen.append(item)
    assert seen == ["a", "bb", "ccc"]
    assert [r.getMessage() for r in caplog.records] == [
        "async checkpoint: drain of x: 1 kB of 6 kB (17%), 1 kB/s, 5s left",
        "async checkpoint: drain of x: 3 kB of 6 kB (50%), 1.5 kB/s, 2s left",
        "async checkpoint: drain of x: 6 kB of 6 kB (100%), 2 kB/s, 0s left",
        "async checkpoint: drain of x: done, 6 kB in 3s (2 kB/s)"]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_a_bar():
    out = Terminal()
    p = Progress("verify ckpt/step1", 2_000_000, stream=out, first_after_s=0, every_s=0)
    p.add(1_000_000)
    p.add(1_000_000)
    p.done()
    text = out.getvalue()
    assert "verify ckpt/step1" in text and "100%" in text and "2.00M" in text, text


def test_the_verify_cli_writes_its_progress_to_standard_error_only(tmp_path, capsys, monkeypatch):
    from deepspeed_async_ckpt.tools.cli import main

    ck = make()
    save_one(ck, str(tmp_path), sample_state())
    ck.close()
    monkeypatch.setattr(progress, "FIRST_AFTER_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    assert main(["verify", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("OK: ") and len(out.splitlines()) == 1, out
    path = os.path.join(str(tmp_path), "t1")
    assert f"verify {path}: " in err and " of " in err and f"verify {path}: done" in err, err
    monkeypatch.setattr("sys.stderr", Terminal())  # a terminal: a bar, still on standard error
    assert main(["verify", str(tmp_path)]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("OK: ") and len(out.splitlines()) == 1, out
    assert "100%" in sys.stderr.getvalue()
    assert main(["list", str(tmp_path), "--json"]) == 0
    json.loads(capsys.readouterr().out)  # nothing but the JSON


def test_a_drain_and_a_restore_log_their_progress(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(progress, "FIRST_AFTER_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    local, tier = tmp_path / "local", tmp_path / "tier"
    with caplog.at_level(logging.INFO, logger="deepspeed_async_ckpt.progress"):
        ck = make(tiers=[{"url": str(tier)}])
        d = str(local / "step1")
        ck.begin(d, tag="step1", pointer=Pointer(str(local / "latest"), "step1"))
        ck.save({"w": torch.randn(256, 64)}, os.path.join(d, "model.pt"))
        ck.end()
        ck.wait()
        assert ck.tiers.wait_idle(60)
        ck.close()
        shutil.rmtree(local)
        assert restore(str(local), [PathRemote(str(tier))], pointer_name="latest") == "step1"
    messages = [r.getMessage() for r in caplog.records]
    assert f"async checkpoint: drain of step1 to {tier}: done" in " ".join(messages), messages
    assert any(m.startswith(f"async checkpoint: restore of step1 into {local}: ") and " of " in m
               for m in messages), messages
