"""The keeper: one process per node and save directory that owns the memory tier's shared
memory, so that a checkpoint copied there survives the death of every rank.

Started by :func:`start` (a rank that found none) as ``python -m
deepspeed_async_ckpt.memory.keeper``, in a new session (``setsid``) and forked once more, so
it is neither in the ranks' process group or session nor their child: a signal to the ranks'
group and the death of the rank that started it leave it running. Its stdin and stdout are
``/dev/null``, its stderr and log the file :attr:`~.address.KeeperAddress.log_path`.

Binding the save directory's abstract socket decides which of several starters becomes the
keeper (the others exit; their ranks connect to the winner). The winner first removes the
segments a killed keeper of the same save directory left (names with the same prefix), then
serves clients on one thread (:class:`~.slots.SlotTable` holds the slots).

It exits, unlinking every segment it made, on :class:`~.messages.Shutdown`, on ``SIGTERM``,
or once no client has been connected for ``idle_timeout_s``. A ``SIGKILL``ed keeper leaves its
segments to its successor's start.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time

from . import segment
from .address import KeeperAddress
from .messages import (Abandon, Commit, Done, Hello, Newest, Refused, Report, Reserve, Shutdown, Status, Welcome,
                       decode, encode)
from .slots import SlotTable

log = logging.getLogger("deepspeed_async_ckpt.memory.keeper")

_MAX_LINE = 256 << 20  # bytes of one request (a Reserve: a few hundred bytes a file; a Commit carries
# the late files inline: megatron-core's .metadata grows with the shards)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class KeeperStartError(RuntimeError):
    """The keeper process could not be started (its log says why)."""


def start(save_dir: str, *, keep_last: int, max_bytes: int | None, idle_timeout_s: float,
          timeout_s: float = 30.0, node: int = 0) -> None:
    """Start the keeper of ``save_dir`` on node ``node`` unless one runs; return once one
    listens (this one or another starter's). Called by any rank of the node; the socket's bind
    settles races between them."""
    address = KeeperAddress.of(save_dir, node=node)
    read, write = os.pipe()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))
    argv = [sys.executable, "-m", "deepspeed_async_ckpt.memory.keeper", "--save-dir", address.save_dir,
            "--keep-last", str(keep_last), "--idle-timeout-s", repr(float(idle_timeout_s)), "--ready-fd", str(write), "--node", str(node)]
    if max_bytes is not None:
        argv += ["--max-bytes", str(max_bytes)]
    try:
        child = subprocess.Popen(argv, start_new_session=True, pass_fds=(write,), env=env, cwd="/",
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        os.close(write)
    try:
        child.wait(timeout_s)  # the first process exits once it forked the keeper
        answer, deadline = b"", time.monotonic() + timeout_s
        while b"\n" not in answer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read], [], [], left)[0]:
                raise KeeperStartError(f"the keeper of {address.save_dir} did not come up in {timeout_s:g} s; "
                                       f"its log: {address.log_path}")
            chunk = os.read(read, 256)
            if not chunk:
                break
            answer += chunk
    except subprocess.TimeoutExpired as exc:
        child.kill()
        child.wait()
        raise KeeperStartError(f"the keeper of {address.save_dir} did not start in {timeout_s:g} s") from exc
    finally:
        os.close(read)
    if not answer.startswith((b"ready", b"busy")):
        said = answer.decode(errors="replace").strip() or f"exit {child.returncode}"
        raise KeeperStartError(f"the keeper of {address.save_dir} failed to start ({said}); its log: "
                               f"{address.log_path}")


class Keeper:
    """The serving loop: the listening socket, the clients' connections, signals, the idle clock."""

    def __init__(self, address: KeeperAddress, listener: socket.socket, table: SlotTable, idle_timeout_s: float):
        self.address, self.listener, self.table = address, listener, table
        self.idle_timeout_s = idle_timeout_s
        self.selector = selectors.DefaultSelector()
        self.conns: dict[int, tuple[socket.socket, bytearray]] = {}
        self.stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        # Each request type -> (connection, request) -> reply.
        self._handlers = {Hello: self._hello, Reserve: table.reserve, Report: lambda _c, m: table.report(m),
                          Commit: lambda _c, m: table.commit(m), Abandon: lambda _c, m: table.abandon(m),
                          Newest: lambda _c, m: table.newest(m), Status: lambda _c, _m: table.state(len(self.conns)),
                          Shutdown: self._shutdown}

    def serve(self) -> None:
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno())
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self._wake_r, selectors.EVENT_READ)
        idle_since = time.monotonic()
        try:
            while not self.stopping:
                if self.conns:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= self.idle_timeout_s:
                    log.info("no client for %g s: exiting", self.idle_timeout_s)
                    break
                wait = None if self.conns else max(0.0, idle_since + self.idle_timeout_s - time.monotonic())
                for key, _ in self.selector.select(wait):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._wake_r.recv(64)
                    else:
                        self._read(key.fileobj)
        finally:
            self.table.release_all()  # before the socket goes: a successor cannot bind until then
            for conn, _ in list(self.conns.values()):
                conn.close()
            self.listener.close()
            log.info("exited; every segment unlinked")

    def _on_sigterm(self, signum, frame) -> None:
        log.info("SIGTERM: exiting")
        self.stopping = True

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != self.address.uid:  # the abstract namespace has no file permissions
            log.warning("refused a connection from pid %d of user %d", pid, uid)
            conn.close()
            return
        conn.setblocking(True)
        self.conns[conn.fileno()] = (conn, bytearray())
        self.selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        fd = conn.fileno()
        try:
            data = conn.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            return self._close(fd)
        buf = self.conns[fd][1]
        buf += data
        if len(buf) > _MAX_LINE and b"\n" not in buf:
            log.warning("a client sent %d bytes without a line end: closed", len(buf))
            return self._close(fd)
        while b"\n" in buf and fd in self.conns and not self.stopping:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            try:
                message = decode(line)
                handler = self._handlers[type(message)]
            except (ValueError, KeyError, TypeError) as exc:
                reply = Refused(f"not a request the keeper understands: {exc}")
            else:
                try:
                    reply = handler(fd, message)
                except Exception as exc:  # one request's failure (a segment not made) is its own
                    log.exception("%s failed", type(message).__name__)
                    reply = Refused(f"the keeper failed on {type(message).__name__}: {type(exc).__name__}: {exc}")
            try:
                conn.sendall(encode(reply))
            except OSError:
                return self._close(fd)

    def _close(self, fd: int) -> None:
        conn, _ = self.conns.pop(fd)
        self.selector.unregister(conn)
        conn.close()
        self.table.connection_closed(fd)

    def _hello(self, _conn: int, m: Hello) -> Welcome:
        self.table.configure(m.keep_last, m.max_bytes)
        self.idle_timeout_s = m.idle_timeout_s
        return Welcome(os.getpid(), self.address.log_path)

    def _shutdown(self, _conn: int, _m: Shutdown) -> Done:
        log.info("shutdown asked by the job")
        self.stopping = True
        return Done()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepspeed_async_ckpt.memory.keeper")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--keep-last", type=int, required=True)
    p.add_argument("--max-bytes", type=int)
    p.add_argument("--idle-timeout-s", type=float, required=True)
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("--node", type=int, default=0)
    args = p.parse_args(argv)
    if os.fork():  # the starter waits for this first process; the keeper is its orphan
        os._exit(0)
    address = KeeperAddress.of(args.save_dir, node=args.node)
    ready = args.ready_fd
    try:
        log_fd = os.open(address.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                            format=f"%(asctime)s keeper[{os.getpid()}] %(levelname)s %(message)s")
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address.socket_name)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            os.write(ready, b"busy\n")  # another starter's keeper won
            return 0
        listener.listen(256)
        stale = address.segments_on_node()
        for name in stale:
            segment.unlink(name)
        log.info("keeper of %s on %s; removed %d stale segment(s)%s", address.save_dir, address.shown, len(stale),
                 f": {', '.join(stale)}" if stale else "")
        keeper = Keeper(address, listener, SlotTable(address, os.getpid(), keep_last=args.keep_last,
                                                     max_bytes=args.max_bytes), args.idle_timeout_s)
        os.write(ready, f"ready {os.getpid()}\n".encode())
        os.close(ready)
        ready = -1
        keeper.serve()
        return 0
    except BaseException as exc:
        log.exception("keeper failed")
        if ready >= 0:
            os.write(ready, f"failed: {type(exc).__name__}: {exc}\n".encode())
        return 1


if __name__ == "__main__":
    sys.exit(main())
