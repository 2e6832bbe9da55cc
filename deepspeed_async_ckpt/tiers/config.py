"""The schema of the durable tiers: where committed checkpoints are drained to, how often, and
how many each keeps.

The checkpoint directory is the first tier, as without tiers (``keep_last`` is its retention).
``async_checkpoint.tiers`` lists the later ones, fastest first::

    "tiers": [{"url": "s3://bucket/run1", "every": 1, "keep_last": 5}]

A tier's URL is an absolute path (a shared filesystem) or ``s3://bucket[/prefix]``. Each entry
is parsed once into a frozen :class:`TierConfig`; a bad value raises :class:`ConfigError`
naming the key (``async_checkpoint.tiers[0].every``) and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

from ..errors import ConfigError, refuse_unknown_keys

_KEY = "async_checkpoint.tiers"


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """One durable tier, drained in the background from the committed first-tier copy."""

    url: str
    """Where the tier is: an absolute path (a directory on a shared filesystem) or
    ``s3://bucket[/prefix]`` (an object store reached with boto3)."""

    every: int = 1
    """Drain every N-th checkpoint this process commits (1: every one). Counted over the
    checkpoints that move the pointer; those saved aside are not drained."""

    keep_last: int = 0
    """Retention on this tier: after each drain, keep the ``keep_last`` newest checkpoints there
    (the one the tier's pointer names among them); 0 keeps every one."""

    endpoint_url: str | None = None
    """S3 only: the endpoint (``http://127.0.0.1:9000``, a MinIO or another S3-compatible
    server). None: boto3's own chain (``AWS_ENDPOINT_URL``, the config file, AWS)."""

    connect_timeout_s: float = 5.0
    """S3 only: seconds to wait for a connection; also bounds the reachability check at build."""

    max_attempts: int = 5
    """S3 only: attempts per request (botocore's ``standard`` retry mode: exponential backoff on
    throttling and transient network errors)."""

    part_size_mb: int = 64
    """S3 only: multipart part size in MiB; files larger than one part upload in parts."""

    concurrency: int = 8
    """Parallel parts (or files, on a path tier) in flight per drain."""

    retry_delay_s: float = 2.0
    """After a failed drain: first wait before retrying it (doubling, at most 60 s), unless a
    newer checkpoint is committed meanwhile, which is drained instead."""

    marker_timeout_s: float = 600.0
    """Node-local first tiers: how long global rank 0 waits for every node's upload marker
    before it gives the drain up (and retries it later)."""

    close_timeout_s: float = 30.0
    """How long ``close`` waits, in seconds from when it began, for the drain running and the
    one waiting, each given one last try (no retry once close began; every tier's wait at
    once): a tier that does not answer holds the exit this long at most. What is not drained
    by then is logged by name and stays on the first tier only, until the next start drains
    the newest committed checkpoint the tier lacks."""

    @property
    def is_s3(self) -> bool:
        return self.url.startswith("s3://")

    @property
    def safe_endpoint(self) -> str | None:
        """The endpoint as logs and errors show it (without a user name or password)."""
        return None if self.endpoint_url is None else without_userinfo(self.endpoint_url)


def without_userinfo(url: str) -> str:
    """``url`` without ``user:password@`` (never logged)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def parse_tiers(raw: Any) -> tuple[TierConfig, ...]:
    """The ``tiers`` list of the config (already-parsed entries pass through)."""
    if raw is None:
        return ()
    if isinstance(raw, (str, bytes)) or not isinstance(raw, (list, tuple)):
        raise ConfigError(f"{_KEY} must be a list of tier objects (after the checkpoint directory, "
                          f"fastest first), got {type(raw).__name__}")
    tiers = tuple(t if isinstance(t, TierConfig) else _parse_one(i, t) for i, t in enumerate(raw))
    urls = [t.url.rstrip("/") for t in tiers]
    for i, url in enumerate(urls):
        if url in urls[:i]:
            raise ConfigError(f"{_KEY}[{i}].url {url!r} names the same place as an earlier tier")
    return tiers


def _parse_one(i: int, raw: Any) -> TierConfig:
    key = f"{_KEY}[{i}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key} must be a JSON object with a 'url', got {type(raw).__name__}")
    refuse_unknown_keys(key, raw, [f.name for f in dataclasses.fields(TierConfig)])
    if "url" not in raw:
        raise ConfigError(f"{key}.url is required: an absolute path or s3://bucket[/prefix]")
    url = raw["url"]
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{key}.url must be a non-empty string, got {url!r}")
    if url.startswith("s3://"):
        bucket = url[len("s3://"):].split("/", 1)[0]
        if not bucket:
            raise ConfigError(f"{key}.url {url!r} names no bucket: s3://bucket[/prefix]")
    elif "://" in url:
        raise ConfigError(f"{key}.url {url.split('://')[0]!r}:// is not a known scheme: an absolute "
                          "path or s3://bucket[/prefix]")
    elif not os.path.isabs(url):
        raise ConfigError(f"{key}.url must be an absolute path or s3://bucket[/prefix], got {url!r}")
    for field, least in (("every", 1), ("keep_last", 0), ("max_attempts", 1), ("part_size_mb", 5),
                         ("concurrency", 1)):
        value = raw.get(field)
        if field in raw and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ConfigError(f"{key}.{field} must be an integer >= {least}, got {value!r}")
    for field in ("connect_timeout_s", "retry_delay_s", "marker_timeout_s", "close_timeout_s"):
        value = raw.get(field)
        if field in raw and (isinstance(value, bool) or not isinstance(value, (int, float))
                             or not value > 0 or not math.isfinite(value)):
            raise ConfigError(f"{key}.{field} must be a finite number of seconds > 0, got {value!r}")
    endpoint = raw.get("endpoint_url")
    if endpoint is not None:
        if not url.startswith("s3://"):
            raise ConfigError(f"{key}.endpoint_url is for s3:// tiers only")
        if not isinstance(endpoint, str) or urlsplit(endpoint).scheme not in ("http", "https"):
            shown = without_userinfo(endpoint) if isinstance(endpoint, str) else type(endpoint).__name__
            raise ConfigError(f"{key}.endpoint_url must be an http(s) URL, got {shown!r}")
    return TierConfig(**dict(raw))
