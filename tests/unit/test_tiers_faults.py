"""The S3 tier going away in the middle of an upload (its connections cut, new ones refused)
and coming back: training never waits for it, the tier's pointer stays on the checkpoint
before, and the drain completes once the tier is back."""

import json
import os
import statistics
import threading
import time

import torch

from deepspeed_async_ckpt.commit import Pointer

from helpers import make
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
