"""A save directory that becomes unwritable mid-run (permission denied), for a process that is
not root: the failing save raises, at that save or at the next wait, an error naming the path
it could not write; the last committed checkpoint stays loadable and `latest` names it; nothing
hangs; with the permission back, the next save commits.

Root ignores directory permissions, so when the tests run as root each scenario runs in a
forked child that has dropped to the user ``nobody`` (in a directory that user owns); the
real syscalls fail, as they would for a training job. The child first runs the scenario once
as root, where nothing fails, so that every module it needs is imported before it can no
longer read root's files."""

import json
import os
import pwd
import select
import shutil
import signal
import tempfile
import traceback

import pytest
import torch

from deepspeed_async_ckpt.commit import Pointer, verify_checkpoint
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer

#: where the directory becomes read-only (0o500): the save directory before the save begins,
#: or after (its checkpoint directory made, the pointer not yet written), or the save's own
#: checkpoint directory after it was made
WHERE = ["save_dir_before_begin", "save_dir_after_begin", "checkpoint_dir_after_begin"]


def _save(ck, root, tag, value, lock=lambda: None):
    d = os.path.join(root, tag)
    ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
    lock()
    ck.save({"w": torch.full((1024,), float(value))}, os.path.join(d, "model.pt"), eager_keys=())
    ck.end()


def _scenario(root, where, mode, unprivileged):
    """Save t1 (committed), make a directory read-only, save t2; what happened, as JSON."""
    out = {"raised_at": None, "error": None}
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode, host_buffer_gb=0.01))
    _save(ck, root, "t1", 1)
    ck.wait()
    target = os.path.join(root, "t2") if where == "checkpoint_dir_after_begin" else root

    def lock():
        if unprivileged:
            os.chmod(target, 0o500)

    if where == "save_dir_before_begin":
        lock()
    try:
        _save(ck, root, "t2", 2, lock=lock if where != "save_dir_before_begin" else lambda: None)
    except Exception as exc:
        out["raised_at"], out["error"] = "save", f"{type(exc).__name__}: {exc}"
        if ck.is_open:  # save raised: what an adapter does when the framework's save raised
            ck.end(commit=False)
    try:
        ck.wait()
    except Exception as exc:
        if out["error"] is not None:
            raise AssertionError(f"raised twice: {out['error']}, then at wait: {exc}") from exc
        out["raised_at"], out["error"] = "wait", f"{type(exc).__name__}: {exc}"
    with open(os.path.join(root, "latest")) as f:
        out["latest"] = f.read()
    verify_checkpoint(os.path.join(root, "t1"))
    out["t1"] = float(torch.load(os.path.join(root, "t1", "model.pt"))["w"][0])
    if unprivileged:
        os.chmod(target, 0o700)
    _save(ck, root, "t3", 3)  # the permission is back: nothing left pending
    ck.close()
    with open(os.path.join(root, "latest")) as f:
        out["latest_after"] = f.read()
    verify_checkpoint(os.path.join(root, "t3"))
    return out


def _run_unprivileged(where, mode, timeout=120):
    """Run the scenario in a forked child as ``nobody`` (as the current user if not root)."""
    base = tempfile.mkdtemp(prefix="unwritable-")
    root = os.path.join(base, "ckpt")
    os.makedirs(root)
    nobody = pwd.getpwnam("nobody") if os.geteuid() == 0 else None
    if nobody is not None:
        os.chown(base, nobody.pw_uid, nobody.pw_gid)
        os.chown(root, nobody.pw_uid, nobody.pw_gid)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            try:
                if nobody is not None:
                    _scenario(os.path.join(base, "warm-up"), where, mode, unprivileged=False)
                    shutil.rmtree(os.path.join(base, "warm-up"))
                    os.setgid(nobody.pw_gid)
                    os.setuid(nobody.pw_uid)
                result = _scenario(root, where, mode, unprivileged=True)
            except BaseException:
                result = {"crashed": traceback.format_exc()}
            os.write(w, json.dumps(result).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    data, deadline_left = b"", timeout
    try:
        while True:
            ready, _, _ = select.select([r], [], [], deadline_left)
            if not ready:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"the unprivileged save hung for {timeout} s ({where}, {mode})")
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
        shutil.rmtree(base, ignore_errors=True)
    result = json.loads(data)
    assert "crashed" not in result, result.get("crashed")
    return root, result


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("where", WHERE)
def test_a_save_dir_made_unwritable_fails_that_save_naming_the_path_and_keeps_the_last_checkpoint(where, mode):
    root, r = _run_unprivileged(where, mode)
    # the failing save raised once, naming what could not be written
    named = {"save_dir_before_begin": os.path.join(root, "t2"),
             "save_dir_after_begin": os.path.join(root, "latest"),
             "checkpoint_dir_after_begin": os.path.join(root, "t2", "model.pt")}[where]
    assert r["error"] is not None and "Permission denied" in r["error"] and named in r["error"], r
    if mode == "async" and where != "save_dir_before_begin":
        assert r["raised_at"] == "wait", r  # written in the background: raised at the next wait
    assert r["latest"] == "t1" and r["t1"] == 1.0, r  # the last committed checkpoint, loadable
    assert r["latest_after"] == "t3", r
