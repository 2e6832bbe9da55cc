"""Ranks forked from a warm interpreter: :func:`start` runs a script as a fresh ``python script``
would, in a process forked from multiprocessing's fork server, which imported the heavy modules
(``torch``, ``deepspeed``, ``megatron.core``) once.

Importing torch and DeepSpeed costs about 4 CPU-seconds per process on a small CPU host, and
megatron-core another 5; a test suite that launches a few hundred ranks spends most of its time
there. :mod:`launch` starts ranks this way when ``ASYNC_CKPT_LAUNCH_PRELOAD`` names the modules
(``torch,deepspeed``); the test suite sets it. :func:`popen` makes that choice.

A forked rank sees what an ``exec``'d one would: its own environment, ``sys.argv``, working
directory, ``sys.path[0]`` (the script's directory), stdout and stderr, ``OMP_NUM_THREADS`` and
``PYTHONWARNINGS``, and it exits as the interpreter does (non-daemon threads joined, ``atexit``
handlers run, the exit code of ``sys.exit`` or 1 after a traceback; negative when killed by a
signal). What it shares with the server: the modules imported there, imported once with the
environment the server started in (the first launch's, so the variables read at import time,
``DS_ACCELERATOR`` among them, must agree between launches), and the hash seed.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback
import warnings
from multiprocessing import reduction

PRELOAD = "ASYNC_CKPT_LAUNCH_PRELOAD"
"""Environment variable: the comma-separated modules the fork server imports (unset or empty:
ranks start as fresh interpreters)."""

_context = multiprocessing.get_context("forkserver")
_lock = threading.Lock()
_started = False


def preloads(env: dict) -> list[str]:
    """The modules ``env`` asks the fork server to import; empty: start ranks the usual way."""
    return [m.strip() for m in env.get(PRELOAD, "").split(",") if m.strip()]


def popen(script: str, args: list[str], env: dict, *, cwd: str | None = None,
          stdout: int | None = None, stderr: int | None = None) -> "Rank | subprocess.Popen":
    """``python script args`` in ``env``: forked from the fork server where ``env`` names
    preloads (:func:`start`), else a fresh interpreter. ``stdout``, ``stderr``: descriptors
    (default: this process's own)."""
    if preloads(env):
        return start(script, args, env, cwd=cwd, stdout=stdout, stderr=stderr)
    return subprocess.Popen([sys.executable, script, *args], env=env, cwd=cwd, stdout=stdout, stderr=stderr)


def start(script: str, args: list[str], env: dict, *, cwd: str | None = None,
          stdout: int | None = None, stderr: int | None = None) -> "Rank":
    """Run ``script`` with ``args`` in a process forked from the fork server (started at the first
    call, with ``env``'s preloads). ``stdout``, ``stderr``: descriptors (default: this
    process's own)."""
    _ensure_server(env)
    process = _context.Process(target=_run, args=(os.path.abspath(script), list(args), dict(env), cwd,
                                                   _Fd(1 if stdout is None else stdout),
                                                   _Fd(2 if stderr is None else stderr)),
                               name=os.path.basename(script))
    process.start()  # the descriptors travel to the fork server now
    return Rank(process)


class Rank:
    """A started rank, with the part of :class:`subprocess.Popen` the launchers use."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process
        self.pid = process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
            self._process.close()  # its sentinel descriptor
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited since
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _ensure_server(env: dict) -> None:
    """Start the fork server, at the first call, in ``env``: its sys.path from ``PYTHONPATH``
    (the working tree's code, as the ranks import it) and the directory holding this package (for
    :func:`_run`).
    Later starts reach it through multiprocessing itself."""
    from multiprocessing import forkserver

    global _started
    with _lock:
        if _started:
            return
        _context.set_forkserver_preload(preloads(env))
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        server_env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (env.get("PYTHONPATH"), here) if p))
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            server_env.pop(key, None)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(server_env)
        try:  # the server inherits this process's environment
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _started = True


class _Fd:
    """A descriptor sent to the fork server with the process (``SCM_RIGHTS``), a copy in the rank."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _run(script: str, args: list[str], env: dict, cwd: str | None, stdout: int, stderr: int) -> None:
    """In the forked rank: become ``python script args`` in ``env``, run it, exit as it would."""
    for fd, target in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = path
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    if env.get("PYTHONWARNINGS"):
        warnings._processoptions(env["PYTHONWARNINGS"].split(","))  # as at interpreter start
    threads = env.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # the interpreter's exit: non-daemon threads joined, then the atexit handlers
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)
