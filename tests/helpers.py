"""Helpers shared by the unit tests: a checkpointer with a small pool (``make``), a sample
state, one save (``save_one``), the held copier fixture, scripts run in a fresh
interpreter, the CLI, permission faults, a class checked against a declared protocol."""

import errno
import os
import time

import pytest
import torch

from deepspeed_async_ckpt.commit import LOCK_FILE, Pointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer


def listing(path) -> list[str]:
    """A directory's names, sorted, without the save directory's lock (see claim_save_dir)."""
    return sorted(n for n in os.listdir(path) if n != LOCK_FILE)


def eventually(check, timeout=30.0):
    """Whether ``check()`` became true within ``timeout`` seconds (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def make(mode="async", gb=0.01, **kw):
    """An enabled checkpointer in ``mode`` with a ``gb`` GB host pool; ``kw``: more config fields."""
    return AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode, host_buffer_gb=gb, **kw))


def sample_state():
    """A small DeepSpeed-like state: tied views, a bf16 and a non-contiguous tensor, optimizer
    state, plain values, an empty tensor (seeded: the same values at every call)."""
    torch.manual_seed(0)
    flat = torch.randn(4096)
    return {
        "module": {"w": flat[:1024].view(32, 32), "b": torch.randn(32).to(torch.bfloat16),
                   "tied": flat[:1024].view(32, 32), "nc": torch.randn(16, 8).t()},
        "optimizer": {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(32, 32)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "global_steps": 5, "client": torch.arange(4), "empty": torch.empty(0),
    }


@pytest.fixture
def held_copier(monkeypatch):
    """The background copier held until the training thread's next fence, for this test only
    (``tests/_copier.py``): the returned event, set by every fence; ``clear()`` it to hold the
    next save's copies."""
    from _copier import hold_copier_until_fence
    from deepspeed_async_ckpt.snapshot import Stager

    monkeypatch.setattr(Stager, "_copy", Stager._copy)  # undone after the test
    monkeypatch.setattr(Stager, "fence", Stager.fence)
    return hold_copier_until_fence()


def save_one(ck, root, state, tag="t1", eager=("client",)):
    """Save ``state`` as ``root/tag/model.pt`` with ``root/latest`` as its pointer; the handle."""
    d = os.path.join(root, tag)
    ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
    ck.save(state, os.path.join(d, "model.pt"), eager_keys=eager)
    return ck.end()


def torch_save_reference(tmp_path, state):
    """``state`` written by ``torch.save`` to ``tmp_path/ref.pt``, to compare files against."""
    path = tmp_path / "ref.pt"
    torch.save(state, path)
    return path


def run_script(script: str, env: dict, *args: str, timeout: float = 120):
    """Run ``script`` (Python source) in a fresh interpreter with ``args``; its completed process."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def run_rank_script(script: str, args, env: dict, timeout: float = 120):
    """Run the rank script ``script`` with ``args`` as ``python script args`` would, forked from the
    warm interpreter where ``env`` asks for one (``deepspeed_async_ckpt.tools.warm_start``); its completed
    process, stdout and stderr as text."""
    import subprocess
    import tempfile

    from deepspeed_async_ckpt.tools import warm_start

    args = [str(a) for a in args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        rank = warm_start.popen(script, args, env, stdout=out.fileno(), stderr=err.fileno())
        try:
            code = rank.wait(timeout)
        except subprocess.TimeoutExpired:
            rank.kill()
            rank.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([script, *args], code, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def the_next_save_commits_and_closes(ck, tmp_path):
    """After a save that failed: the next one (tag ``t2``) commits, and ``close`` returns."""
    save_one(ck, str(tmp_path), sample_state(), tag="t2")
    ck.fence()
    ck.wait(timeout=30)
    ck.close()
    assert (tmp_path / "latest").read_text() == "t2"


def lock_held(save_dir) -> bool:
    """Whether a process holds ``save_dir``'s claim (this one included: flock conflicts across
    open files)."""
    import fcntl

    fd = os.open(os.path.join(save_dir, LOCK_FILE), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class Crash(BaseException):
    """Stands for the process dying at this point (nothing after it runs)."""


def saved_steps(path):
    """The ``global_steps`` a saved ``model.pt`` holds."""
    return torch.load(path, weights_only=False)["global_steps"]


def save_like_deepspeed(ck, root, state, tag):
    """``save_one`` as the DeepSpeed plugin runs it: a save that raises is ended uncommitted."""
    d = os.path.join(root, tag)
    handle = ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
    ok = False
    try:
        ck.save(state, os.path.join(d, "model.pt"))
        ok = True
    finally:
        ck.end(commit=ok)
    return handle


def flip_byte(path, at=None):
    """Flip the lowest bit of the byte at offset ``at`` of ``path`` (its middle by default)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2 if at is None else at)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))


def cli_main(argv):
    """``ds-async-ckpt`` with ``argv``, in this process; its exit code."""
    from deepspeed_async_ckpt.tools.cli import main

    return main(argv)


def deny_access(monkeypatch, module, name, denied):
    """``module.name`` (``open``, ``os.listdir``) raising PermissionError for paths ``denied``
    accepts, as for another user's checkpoint (tests run as root, whom modes do not stop)."""
    real = getattr(module, name, None) or open

    def fake(path, *args, **kwargs):
        if denied(str(path)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(module, name, fake, raising=False)


def save_small(ck, save_dir, tag):
    """Save 16 random floats as ``save_dir/tag/model.pt``, ``save_dir/latest`` its pointer."""
    d = os.path.join(save_dir, tag)
    ck.begin(d, tag=tag, pointer=Pointer(os.path.join(save_dir, "latest"), tag))
    ck.save({"w": torch.randn(16)}, os.path.join(d, "model.pt"))
    return ck.end()


def declared_calls(protocol) -> list[str]:
    """The methods a ``typing.Protocol`` declares, sorted."""
    return sorted(n for n, v in vars(protocol).items() if not n.startswith("_") and callable(v))


def takes_declared_calls(cls, protocol) -> list[str]:
    """What keeps ``cls`` from taking every call ``protocol`` declares as declared: a method
    missing, or one whose parameters are not the declared ones (names and kinds, in order)
    followed only by parameters with defaults. Empty if none."""
    import inspect

    problems = []
    for name in declared_calls(protocol):
        method = getattr(cls, name, None)
        if method is None:
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        want = list(inspect.signature(getattr(protocol, name)).parameters.values())
        have = list(inspect.signature(method).parameters.values())
        if [(p.name, p.kind) for p in have[:len(want)]] != [(p.name, p.kind) for p in want] or \
                any(p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                    for p in have[len(want):]):
            problems.append(f"{cls.__name__}.{name}{inspect.signature(method)} is not "
                            f"{name}{inspect.signature(getattr(protocol, name))}")
    return problems
