"""An S3 tier (or any S3-compatible store), through boto3 and s3transfer.

Large files go up in parallel multipart uploads (``part_size_mb`` parts, ``concurrency`` in
flight: s3transfer's ``TransferConfig``); every request retries transient errors and
throttling with exponential backoff (botocore's ``standard`` retry mode, ``max_attempts``).
Credentials, region and endpoint come from boto3's usual chain (``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``, ``~/.aws/config``, an instance role), the endpoint optionally from the
tier's ``endpoint_url``; nothing secret is logged or put in an error.
"""

from __future__ import annotations

from .config import TierConfig
from .remote import manifest_key

_MiB = 1024 * 1024


def _import_boto3():
    try:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config
    except ImportError as exc:
        raise ImportError("an s3:// tier needs boto3: pip install 'deepspeed-async-ckpt[s3]'") from exc
    return boto3, TransferConfig, Config


class S3Remote:
    """``s3://bucket/prefix``: keys under ``prefix/``."""

    def __init__(self, tier: TierConfig) -> None:
        boto3, TransferConfig, Config = _import_boto3()
        self.url = tier.url.rstrip("/")
        bucket, _, prefix = tier.url[len("s3://"):].partition("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        config = Config(connect_timeout=tier.connect_timeout_s, read_timeout=60,
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

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def check(self) -> None:
        self._probe.head_bucket(Bucket=self.bucket)

    def put_file(self, local_path: str, key: str) -> None:
        self.client.upload_file(local_path, self.bucket, self._key(key), Config=self.transfer)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def get_file(self, key: str, local_path: str) -> None:
        try:
            self.client.download_file(self.bucket, self._key(key), local_path, Config=self.transfer)
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

    def describe(self, key: str) -> str:
        return f"{self.url}/{key}"


def _missing(exc: Exception) -> bool:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")
