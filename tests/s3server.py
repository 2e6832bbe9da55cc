"""A real S3-compatible server for the tier tests: moto's standalone server in a subprocess on
127.0.0.1, reached by a real boto3 client over HTTP, behind a TCP relay the tests can cut and
restore (the remote going away mid-upload, then coming back with what it held).

Fixtures: ``s3_server`` (one server per test module) and ``s3`` (a fresh bucket per test,
credentials in the environment)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Relay:
    """Forwards 127.0.0.1:<port> to the server; :meth:`cut` closes the listener and every
    connection (clients see refused and reset connections), :meth:`restore` listens again."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.port = free_port()
        self.delay_s = 0.0
        """Seconds to wait before forwarding each chunk (64 KiB at most): a slow link."""
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        if self._listener is not None:
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            socks, self._socks = self._socks, []
        for s in [listener, *socks]:
            if s is None:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class S3Server:
    """``python -m moto.server`` on a free port, and a relay in front of it."""

    def __init__(self) -> None:
        self.port = free_port()
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                      "-p", str(self.port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start")
                time.sleep(0.2)
        self.relay = Relay(self.port)
        self.endpoint = f"http://127.0.0.1:{self.relay.port}"

    def client(self, direct: bool = False):
        """A client through the relay, or (``direct``) straight to the server."""
        endpoint = f"http://127.0.0.1:{self.port}" if direct else self.endpoint
        return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def stop(self) -> None:
        self.relay.cut()
        self.proc.terminate()
        self.proc.wait(10)


class Bucket:
    """One test's bucket on the server: ``url`` for a tier, ``objects()`` to read it back."""

    def __init__(self, server: S3Server, name: str) -> None:
        self.server, self.name = server, name
        self.endpoint = server.endpoint
        self.client = server.client(direct=True)  # reads back whatever the relay does
        self.client.create_bucket(Bucket=name)

    def url(self, prefix: str = "run") -> str:
        return f"s3://{self.name}/{prefix}"

    def tier(self, prefix: str = "run", **kw) -> dict:
        return dict(url=self.url(prefix), endpoint_url=self.endpoint, **kw)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.name, Key=key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)

    def keys(self, prefix: str = "") -> list[str]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", ())]
        return sorted(out)


@pytest.fixture(scope="module")
def s3_server():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A fresh bucket; the standard AWS environment variables point boto3 at the server."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    s3_server.relay.restore()  # a test before may have cut it
    return Bucket(s3_server, f"b-{uuid.uuid4().hex[:12]}")
