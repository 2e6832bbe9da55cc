"""A tier going away (the S3 server's connections cut, new ones refused; a path tier refusing
or never answering): training never waits for it, the tier's pointer stays on the checkpoint
before, the drain completes once the tier is back; close gives it one last try, bounded by
``close_timeout_s``, names what stays undrained, and the next start drains it."""

import json
import os
import statistics
import threading
import time

import torch

from deepspeed_async_ckpt.commit import Pointer

from fakes import DeadRemote, GatedRemote, HungRemote
from helpers import eventually, make
from s3server import s3, s3_server  # noqa: F401  (fixtures)


def timed_save(ck, save_dir, step, state):
    d = os.path.join(save_dir, f"step{step}")
    t0 = time.perf_counter()
    ck.begin(d, tag=f"step{step}", pointer=Pointer(os.path.join(save_dir, "latest"), f"step{step}"))
    ck.save(state, os.path.join(d, "model.pt"))
    ck.end()
    ck.fence()
    return time.perf_counter() - t0


def tier_pointer(bucket):
    try:
        return json.loads(bucket.get("run/.async_ckpt/pointer.json"))["checkpoint"]
    except bucket.client.exceptions.NoSuchKey:
        return None


def test_remote_cut_mid_upload_never_stalls_saves_and_the_drain_completes_later(tmp_path, s3, s3_server):
    local = str(tmp_path / "local")
    state = {"w": torch.randn(2 * 1024 * 1024)}  # 8 MiB: two 5 MiB parts
    ck = make(gb=0.05, tiers=[s3.tier("run", part_size_mb=5, max_attempts=2, retry_delay_s=0.3,
                                      connect_timeout_s=1)])
    drainer = ck.tiers.drainers[0]
    calm = [timed_save(ck, local, 1, state)]
    ck.wait()
    assert ck.tiers.wait_idle(60) and tier_pointer(s3) == "step1"
    for step in (2, 3):  # the same run's saves with no remote trouble, each drained
        calm.append(timed_save(ck, local, step, state))
        ck.wait()
        assert ck.tiers.wait_idle(60)
    assert tier_pointer(s3) == "step3"

    s3_server.relay.delay_s = 0.01  # a slow link: the next upload takes seconds
    uploading = threading.Event()
    real_put = drainer.remote.put_file

    def put_file(path, key):
        uploading.set()
        return real_put(path, key)

    drainer.remote.put_file = put_file
    trouble = [timed_save(ck, local, 4, state)]
    assert uploading.wait(30)
    time.sleep(0.3)  # some parts on their way
    s3_server.relay.cut()  # the tier goes away mid-upload
    s3_server.relay.delay_s = 0.0
    for step in (5, 6):
        trouble.append(timed_save(ck, local, step, state))
        ck.wait()  # commits on the first tier go on
    deadline = time.monotonic() + 60
    while not drainer.failures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert drainer.failures, "the drain did not notice the tier went away"
    assert tier_pointer(s3) == "step3"  # never a partial copy
    assert open(os.path.join(local, "latest")).read() == "step6"  # the first tier is committed
    # training never waited for the tier (generous: a loaded machine)
    assert statistics.median(trouble) <= 3 * statistics.median(calm) + 0.05, (calm, trouble)

    s3_server.relay.restore()  # the tier is back: the waiting drain (the newest) completes
    assert ck.tiers.wait_idle(120)
    assert tier_pointer(s3) == "step6"
    for rel in ("model.pt", ".async_ckpt/manifest.json"):
        assert s3.get(f"run/step6/{rel}") == open(os.path.join(local, "step6", rel), "rb").read()
    ck.close()


def save_step(ck, save_dir, step):
    timed_save(ck, save_dir, step, {"w": torch.full((256,), float(step))})
    ck.wait()
    assert ck.tiers.wait_queued(10)  # its commit callback queued the drain


def tier_with(ck, remote):
    """``ck``'s only tier, its drainer writing through ``remote`` instead."""
    drainer = ck.tiers.drainers[0]
    drainer.remote = ck.tiers.remotes[0] = remote
    return drainer


def test_close_gives_a_dead_tier_one_last_try_and_names_what_stays_undrained(tmp_path, caplog):
    local, tier = str(tmp_path / "local"), str(tmp_path / "tier")
    ck = make(tiers=[{"url": tier, "retry_delay_s": 60, "close_timeout_s": 40}])
    remote = DeadRemote(tier)
    drainer = tier_with(ck, remote)
    save_step(ck, local, 1)
    assert ck.tiers.wait_idle(60) and drainer.drained == ["step1"]
    remote.dead = True  # the store goes away
    save_step(ck, local, 2)
    assert eventually(lambda: drainer.failures)  # failed once, its retry 60 s away
    refused = remote.refused
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="deepspeed_async_ckpt.tiers.drain"):
        ck.close()
    took = time.monotonic() - t0
    assert remote.refused == refused + 1  # one last try at once, no retry
    assert took < 40 / 4, took  # not close_timeout_s, nor the retry's delay
    assert drainer.undrained == ["step2"] and drainer.drained == ["step1"]
    said = [r.getMessage() for r in caplog.records if "not drained at close" in r.getMessage()]
    assert len(said) == 1 and f"tier {tier}: step2 not drained at close (its last try failed)" in said[0]
    assert "the next start drains" in said[0]


def test_close_waits_close_timeout_s_for_a_tier_that_never_answers(tmp_path, caplog):
    local, tier = str(tmp_path / "local"), str(tmp_path / "tier")
    ck = make(tiers=[{"url": tier, "close_timeout_s": 0.5}])
    remote = HungRemote(tier)
    drainer = tier_with(ck, remote)
    save_step(ck, local, 1)
    assert eventually(lambda: drainer.backlog == 1)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="deepspeed_async_ckpt.tiers.drain"):
        ck.close()
    took = time.monotonic() - t0
    remote.answer.set()
    assert 0.5 <= took < 5, took
    assert drainer.undrained == ["step1"]
    assert any("step1 not drained at close (close_timeout_s=0.5 s passed)" in r.getMessage()
               for r in caplog.records)


def test_close_gives_every_tier_its_last_try_at_once(tmp_path):
    local = str(tmp_path / "local")
    tiers = [str(tmp_path / "a"), str(tmp_path / "b")]
    ck = make(tiers=[{"url": t, "close_timeout_s": 2} for t in tiers])
    remotes = [HungRemote(t) for t in tiers]
    for drainer, remote in zip(ck.tiers.drainers, remotes):
        drainer.remote = remote
    save_step(ck, local, 1)
    assert eventually(lambda: all(d.backlog == 1 for d in ck.tiers.drainers))
    t0 = time.monotonic()
    ck.close()
    took = time.monotonic() - t0
    for remote in remotes:
        remote.answer.set()
    assert 2 <= took < 2 * 1.75, took  # the longest close_timeout_s, not their sum
    assert [d.undrained for d in ck.tiers.drainers] == [["step1"], ["step1"]]


def test_first_save_drains_the_checkpoint_the_tier_lacks_before_its_own(tmp_path):
    local, tier = str(tmp_path / "local"), str(tmp_path / "tier")
    ck = make(tiers=[{"url": tier, "close_timeout_s": 1}])
    remote = DeadRemote(tier)
    tier_with(ck, remote)
    save_step(ck, local, 1)
    assert ck.tiers.wait_idle(60)
    remote.dead = True
    save_step(ck, local, 2)
    ck.close()  # step2 left on the first tier only
    assert json.loads(open(os.path.join(tier, ".async_ckpt", "pointer.json")).read())["checkpoint"] == "step1"

    ck = make(tiers=[{"url": tier}])  # the next start, the store back
    remote = GatedRemote(tier)
    drainer = tier_with(ck, remote)
    d = os.path.join(local, "step3")
    ck.begin(d, tag="step3", pointer=Pointer(os.path.join(local, "latest"), "step3"))
    assert remote.started.wait(30)  # step2's drain began at the save's begin
    ck.save({"w": torch.full((256,), 3.0)}, os.path.join(d, "model.pt"))
    ck.end()
    ck.wait()
    assert ck.tiers.wait_queued(10)
    remote.gate.set()
    assert ck.tiers.wait_idle(60)
    ck.close()
    assert drainer.drained == ["step2", "step3"] and drainer.replaced == []
    for step in (2, 3):
        rel = f"step{step}/model.pt"
        assert open(os.path.join(tier, rel), "rb").read() == open(os.path.join(local, rel), "rb").read()


def test_a_start_queues_nothing_the_tier_holds(tmp_path):
    local, tier = str(tmp_path / "local"), str(tmp_path / "tier")
    ck = make(tiers=[{"url": tier}])
    save_step(ck, local, 1)
    ck.close()
    ck = make(tiers=[{"url": tier}])
    remote = GatedRemote(tier)
    remote.gate.set()
    drainer = tier_with(ck, remote)
    ck.tiers.restore_all_ranks(ck, local, pointer_name="latest")
    assert ck.tiers.wait_idle(60)
    ck.close()
    assert drainer.drained == [] and remote.writes == []


def test_the_next_start_drains_what_close_left_on_the_first_tier_without_a_new_save(
        tmp_path, s3, s3_server, caplog):
    local = str(tmp_path / "local")
    tier = s3.tier("run", max_attempts=1, retry_delay_s=60, connect_timeout_s=1, close_timeout_s=20)
    ck = make(tiers=[tier])
    save_step(ck, local, 1)
    assert ck.tiers.wait_idle(60) and tier_pointer(s3) == "step1"
    s3_server.relay.cut()  # the store goes away
    save_step(ck, local, 2)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="deepspeed_async_ckpt.tiers.drain"):
        ck.close()
    assert time.monotonic() - t0 < 20 / 2  # a refused store: its last try fails at once
    assert ck.tiers.drainers[0].undrained == ["step2"] and tier_pointer(s3) == "step1"
    assert f"tier {s3.url('run')} (endpoint {s3.endpoint}): step2 not drained at close" in caplog.text

    s3_server.relay.restore()  # the store is back; the next start loads, saves nothing
    ck = make(tiers=[tier])
    ck.tiers.restore_all_ranks(ck, local, pointer_name="latest")
    assert ck.tiers.wait_idle(60)
    ck.close()
    assert tier_pointer(s3) == "step2" and s3.get("run/latest") == b"step2"
    assert s3.get("run/step2/model.pt") == open(os.path.join(local, "step2", "model.pt"), "rb").read()


_HUNG_STORE_EXIT = """
import os, sys, time
import torch
from deepspeed_async_ckpt.commit import Pointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer

url, endpoint, local = sys.argv[1:4]
tier = dict(url=url, endpoint_url=endpoint, max_attempts=1, close_timeout_s=1)
ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.05, tiers=[tier]))
print("built", flush=True)
sys.stdin.readline()  # the store stops answering
d = os.path.join(local, "step1")
ck.begin(d, tag="step1", pointer=Pointer(os.path.join(local, "latest"), "step1"))
ck.save({"w": torch.zeros(2 * 1024 * 1024)}, os.path.join(d, "model.pt"))
ck.end()
ck.wait()
t0 = time.monotonic()
ck.close()
print(f"closed {time.monotonic() - t0:.2f} {ck.tiers.drainers[0].undrained}", flush=True)
"""


def test_an_s3_store_that_stops_answering_holds_neither_close_nor_the_exit(
        tmp_path, s3, s3_server, repo_env):
    """Its upload waits on a read timeout (60 s) on s3transfer's threads; they are daemons, so
    once close gave up the process exits at once."""
    import socket
    import subprocess
    import sys

    relay = s3_server.relay
    proc = subprocess.Popen([sys.executable, "-c", _HUNG_STORE_EXIT, s3.url("run"), s3.endpoint,
                             str(tmp_path / "local")], env=repo_env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hole = socket.create_server(("127.0.0.1", 0))  # connections queue there, never read or answered
    try:
        assert proc.stdout.readline().strip() == "built", proc.stderr.read()
        relay.target = hole.getsockname()[1]  # the store stops answering
        proc.stdin.write("\n")
        proc.stdin.flush()
        closed = proc.stdout.readline().split()
        t0 = time.monotonic()
        proc.wait(50)  # held, the exit would wait for the read timeout (60 s)
        exited = time.monotonic() - t0
    finally:
        relay.target = s3_server.port
        relay.cut()  # the connections to the hole
        hole.close()
        proc.kill()
        proc.wait()
    assert closed[:1] == ["closed"] and 1.0 <= float(closed[1]) < 5, closed
    assert closed[2:] == ["['step1']"]
    assert exited < 10, exited
