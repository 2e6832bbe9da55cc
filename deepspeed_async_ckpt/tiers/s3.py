"""An S3 tier (or any S3-compatible store), through boto3 and s3transfer.

Large files go up in parallel multipart uploads (``part_size_mb`` parts, ``concurrency`` in
flight: s3transfer's ``TransferConfig``); every request retries transient errors and
throttling with exponential backoff (botocore's ``standard`` retry mode, ``max_attempts``).
Credentials, region and endpoint come from boto3's usual chain (``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``, ``~/.aws/config``, an instance role), the endpoint optionally from the
tier's ``endpoint_url``; nothing secret is logged or put in an error.

How long one request may take: ``connect_timeout_s`` to connect, :data:`READ_TIMEOUT_S` for
each read of a reply, ``max_attempts`` tries. A store that stops answering can still hold a
drain for minutes; ``close`` does not wait for it beyond ``close_timeout_s``, and the
transfers' threads are daemons (:class:`_DaemonExecutor`), so such a drain, abandoned at
close, does not hold the process's exit either.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from .config import TierConfig
from .keys import manifest_key

_MiB = 1024 * 1024

READ_TIMEOUT_S = 60.0
"""Seconds to wait for each read of a reply (a part's reply comes once its bytes are sent)."""


def _import_boto3():
    try:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config
        from s3transfer.manager import TransferManager
    except ImportError as exc:
        raise ImportError("an s3:// tier needs boto3: pip install 'deepspeed-async-ckpt[s3]'") from exc
    return boto3, TransferConfig, Config, TransferManager


class _DaemonExecutor:
    """The executor s3transfer runs a transfer's requests on, its threads daemons: the
    workers of ``concurrent.futures.ThreadPoolExecutor`` (s3transfer's default) are joined at
    interpreter exit, so one waiting on a store that stopped answering would hold the exit
    for as long as its retries last."""

    def __init__(self, max_workers: int) -> None:
        self._max = max(1, max_workers)
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn, *args, **kwargs) -> Future:
        future: Future = Future()
        self._tasks.put((future, fn, args, kwargs))
        with self._lock:
            if len(self._threads) < self._max:
                thread = threading.Thread(target=self._work, name="async-ckpt-s3", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args, kwargs = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to the transfer's future
                    future.set_exception(exc)

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._tasks.put(None)
        if wait:
            for thread in threads:
                thread.join()


class S3Remote:
    """``s3://bucket/prefix``: keys under ``prefix/``."""

    def __init__(self, tier: TierConfig) -> None:
        boto3, TransferConfig, Config, TransferManager = _import_boto3()
        self.url = tier.url.rstrip("/")
        bucket, _, prefix = tier.url[len("s3://"):].partition("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        config = Config(connect_timeout=tier.connect_timeout_s, read_timeout=READ_TIMEOUT_S,
                        retries={"mode": "standard", "max_attempts": tier.max_attempts},
                        max_pool_connections=max(10, tier.concurrency * 2))
        session = boto3.session.Session()
        # a user name or password in the endpoint means nothing to S3 (requests are signed with
        # the credentials), and boto3 would repeat it in its errors: left out
        endpoint = tier.safe_endpoint
        self.client = session.client("s3", endpoint_url=endpoint, config=config)
        # the check at build: one attempt, a short timeout (a wrong endpoint fails in seconds)
        self._probe = session.client("s3", endpoint_url=endpoint, config=Config(
            connect_timeout=tier.connect_timeout_s, read_timeout=tier.connect_timeout_s,
            retries={"mode": "standard", "max_attempts": 1}))
        part = tier.part_size_mb * _MiB
        self.transfer = TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                                       max_concurrency=tier.concurrency, use_threads=True)
        # boto3's upload_file and download_file, on daemon threads (one manager for every call:
        # its threads are reused)
        self._transfers = TransferManager(self.client, self.transfer, executor_cls=_DaemonExecutor)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def check(self) -> None:
        self._probe.head_bucket(Bucket=self.bucket)

    def put_file(self, local_path: str, key: str) -> None:
        self._transfers.upload(local_path, self.bucket, self._key(key)).result()

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def get_file(self, key: str, local_path: str) -> None:
        try:
            self._transfers.download(self.bucket, self._key(key), local_path).result()
        except Exception as exc:
            if _missing(exc):
                raise FileNotFoundError(f"{self.describe(key)} does not exist") from None
            raise

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except Exception as exc:
            if _missing(exc):
                raise FileNotFoundError(f"{self.describe(key)} does not exist") from None
            raise

    def list_names(self) -> list[str]:
        root = f"{self.prefix}/" if self.prefix else ""
        names: set[str] = set()
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=root, Delimiter="/"):
            names.update(p["Prefix"][len(root):].rstrip("/") for p in page.get("CommonPrefixes", ()))
            names.update(o["Key"][len(root):] for o in page.get("Contents", ()))
        return sorted(names)

    def delete_tree(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(manifest_key(name)))
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(name) + "/"):
            keys += [{"Key": o["Key"]} for o in page.get("Contents", ())]
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[i:i + 1000],
                                                                   "Quiet": True})

    def last_modified(self, name: str) -> float | None:
        newest = None
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(name) + "/"):
            for o in page.get("Contents", ()):
                at = o["LastModified"].timestamp()
                newest = at if newest is None else max(newest, at)
        return newest

    def describe(self, key: str) -> str:
        return f"{self.url}/{key}"


def _missing(exc: Exception) -> bool:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")
