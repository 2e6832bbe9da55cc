"""The schema of the durable tiers: where committed checkpoints are drained to, how often, and
how many each keeps.

The checkpoint directory is the first tier, as without tiers (``keep_last`` is its retention).
``async_checkpoint.tiers`` lists the later ones, fastest first::

    "tiers": [{"url": "s3://bucket/run1", "every": 1, "keep_last": 5}]

A tier's URL is an absolute path (a shared filesystem) or ``s3://bucket[/prefix]``. Each entry
is parsed once into a frozen :class:`TierConfig`; a bad value raises :class:`ConfigError`
naming the key (``async_checkpoint.tiers[0].every``) and what is allowed. Tiers lie apart:
none is, contains or lies inside another (:func:`parse_tiers`) or the checkpoint directory
(:func:`refuse_overlap`, once that directory is known), since each tier's retention and
pointer would then act on the other's copies.

No credential is kept: a user name or password in ``endpoint_url`` is dropped at parse
(requests are signed with boto3's own credentials), and :func:`without_credentials` gives
the copy of a raw config that frameworks may save or log (DeepSpeed puts its whole config
into every model and optimizer state file, and logs it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

from ..errors import ConfigError, refuse_unknown_keys

_KEY = "async_checkpoint.tiers"
logger = logging.getLogger(__name__)

MAX_PART_SIZE_MB = 5120
"""S3's largest part (5 GiB); its smallest, 5 MiB, is the least ``part_size_mb``."""

MAX_CONCURRENCY = 256
"""Most parts (or files) in flight per drain: each holds a thread, a connection and up to a
part of memory; past a few hundred, a process runs out of those before a link gains bandwidth."""

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IP_ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+")


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
    server). None: boto3's own chain (``AWS_ENDPOINT_URL``, the config file, AWS). A user name
    or password in it is dropped at parse: requests are signed with boto3's credentials."""

    connect_timeout_s: float = 5.0
    """S3 only: seconds to wait for a connection; also bounds the reachability check at build."""

    max_attempts: int = 5
    """S3 only: attempts per request (botocore's ``standard`` retry mode: exponential backoff on
    throttling and transient network errors)."""

    part_size_mb: int = 64
    """S3 only: multipart part size in MiB (5 to 5120, S3's part limits); files larger than
    one part upload in parts."""

    concurrency: int = 8
    """Parallel parts (or files, on a path tier) in flight per drain (1 to 256)."""

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


def without_credentials(config: Any) -> Any:
    """``config`` as it may be saved or logged: a copy in which every tier's ``endpoint_url``
    has no user name or password, or ``config`` itself where none had one. ``config``: a
    framework's whole config (DeepSpeed's: the tiers under ``async_checkpoint``), the
    ``async_checkpoint`` block, or anything else (returned as is)."""
    if not isinstance(config, Mapping):
        return config
    block = config.get("async_checkpoint")
    if isinstance(block, Mapping):
        safe = without_credentials(block)
        return config if safe is block else {**config, "async_checkpoint": safe}
    tiers = config.get("tiers")
    if not isinstance(tiers, (list, tuple)):
        return config
    safe_tiers = [_tier_without_credentials(t) for t in tiers]
    if all(a is b for a, b in zip(safe_tiers, tiers)):
        return config
    return {**config, "tiers": type(tiers)(safe_tiers)}


def _tier_without_credentials(tier: Any) -> Any:
    if isinstance(tier, TierConfig):
        return tier if tier.endpoint_url == tier.safe_endpoint else \
            dataclasses.replace(tier, endpoint_url=tier.safe_endpoint)
    endpoint = tier.get("endpoint_url") if isinstance(tier, Mapping) else None
    if not isinstance(endpoint, str) or without_userinfo(endpoint) == endpoint:
        return tier
    return {**tier, "endpoint_url": without_userinfo(endpoint)}


def parse_tiers(raw: Any) -> tuple[TierConfig, ...]:
    """The ``tiers`` list of the config (already-parsed entries pass through). Refuses a tier
    that is, contains or lies inside another (paths resolved, symlinks included; S3 prefixes
    on the same endpoint)."""
    if raw is None:
        return ()
    if isinstance(raw, (str, bytes)) or not isinstance(raw, (list, tuple)):
        raise ConfigError(f"{_KEY} must be a list of tier objects (after the checkpoint directory, "
                          f"fastest first), got {type(raw).__name__}")
    tiers = tuple(_tier_without_credentials(t) if isinstance(t, TierConfig) else _parse_one(i, t)
                  for i, t in enumerate(raw))
    places = [_place(t) for t in tiers]
    for i, place in enumerate(places):
        for j in range(i):
            how = _overlap(place, places[j])
            if how:
                how = "names the same place as" if how == "is" else how
                raise ConfigError(f"{_KEY}[{i}].url {_shown(tiers[i].url)!r}"
                                  f"{_resolved(tiers[i].url, place)} {how} {_KEY}[{j}].url "
                                  f"{_shown(tiers[j].url)!r}{_resolved(tiers[j].url, places[j])}: "
                                  "each tier must lie apart from the others (one's retention "
                                  "would remove the other's copies)")
    return tiers


def refuse_overlap(tiers: tuple[TierConfig, ...], directory: str | os.PathLike,
                   what: str = "the checkpoint directory") -> None:
    """Raise :class:`ConfigError` naming the key if a path tier is ``directory`` (the
    checkpoint directory: the first tier), contains it or lies inside it, both resolved
    (symlinks included). Called where the directory becomes known (a save's or a load's
    directory), before anything is written there."""
    if all(t.is_s3 for t in tiers):
        return
    place = _path_place(os.fspath(directory))
    for i, tier in enumerate(tiers):
        how = None if tier.is_s3 else _overlap(_place(tier), place)
        if how:
            shown = os.fspath(directory)
            raise ConfigError(f"{_KEY}[{i}].url {tier.url!r}{_resolved(tier.url, _place(tier))} "
                              f"{how} {what} {shown!r}{_resolved(shown, place)}: a tier must lie "
                              "apart from the checkpoint directory (its retention and the tier's "
                              "would remove each other's copies)")


def _place(tier: TierConfig) -> tuple:
    """Where a tier is, as comparable parts: ("s3", endpoint, bucket, *prefix) or ("path", *parts)."""
    if tier.is_s3:
        bucket, _, prefix = tier.url[len("s3://"):].partition("/")
        return ("s3", tier.safe_endpoint, bucket, *[p for p in prefix.split("/") if p])
    return _path_place(tier.url)


def _path_place(path: str) -> tuple:
    return ("path", *[p for p in os.path.realpath(path).split(os.sep) if p])


def _overlap(a: tuple, b: tuple) -> str | None:
    """How place ``a`` stands to place ``b``: "is", "contains", "lies inside", or None."""
    n = min(len(a), len(b))
    if a[:n] != b[:n]:  # another kind, endpoint or bucket, or a branch of its own
        return None
    return "is" if len(a) == len(b) else "contains" if len(a) < len(b) else "lies inside"


def _resolved(url: str, place: tuple) -> str:
    """`` (resolved: /real/path)`` where a path tier's URL resolves elsewhere (a symlink)."""
    if place[0] != "path":
        return ""
    real = os.path.realpath(url)
    return "" if real == os.path.abspath(url) else f" (resolved: {real})"


def _shown(url: str) -> str:
    """A tier URL as messages show it: an ``s3://`` URL without what precedes an ``@`` in it
    (a credential mistakenly put there)."""
    if not url.startswith("s3://"):
        return url
    netloc, slash, rest = url[len("s3://"):].partition("/")
    return f"s3://{netloc.rpartition('@')[2]}{slash}{rest}"


def _check_url(key: str, url: str) -> None:
    """An absolute path other than the root, or ``s3://bucket[/prefix]`` with a valid bucket
    name; no ``.``, ``..`` or empty segment in either (one trailing ``/`` is allowed)."""
    if url.startswith("s3://"):
        netloc, _, prefix = url[len("s3://"):].partition("/")
        if not netloc:
            raise ConfigError(f"{key}.url {url!r} names no bucket: s3://bucket[/prefix]")
        if "@" in netloc or ":" in netloc:  # shown without it: it may hold a credential
            raise ConfigError(f"{key}.url {_shown(url)!r}: an s3:// URL holds a bucket name only, no "
                              "user, password or port (credentials come from boto3's chain, the "
                              "server from endpoint_url)")
        if not _BUCKET.fullmatch(netloc) or ".." in netloc or _IP_ADDRESS.fullmatch(netloc):
            raise ConfigError(f"{key}.url {url!r}: bucket {netloc!r} is not a valid S3 bucket name "
                              "(3 to 63 characters: lowercase letters, digits, dots and hyphens, "
                              "starting and ending with a letter or digit, no '..', not an IP address)")
        segments, rule = prefix[:-1] if prefix.endswith("/") else prefix, "s3://bucket[/prefix]"
    elif "://" in url:
        raise ConfigError(f"{key}.url {url.split('://')[0]!r}:// is not a known scheme: an absolute "
                          "path or s3://bucket[/prefix]")
    elif not os.path.isabs(url):
        raise ConfigError(f"{key}.url must be an absolute path or s3://bucket[/prefix], got {url!r}")
    else:
        if os.path.realpath(url) == os.path.realpath(os.sep):
            raise ConfigError(f"{key}.url {url!r} is the filesystem root: a tier is a directory of "
                              "its own (its retention removes what else it holds)")
        body = url[1:]
        segments, rule = body[:-1] if body.endswith("/") else body, "an absolute path"
    if segments and any(p in ("", ".", "..") for p in segments.split("/")):
        raise ConfigError(f"{key}.url {url!r} has an empty, '.' or '..' segment: {rule} with plain "
                          "names between single slashes (one trailing '/' allowed)")


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
    _check_url(key, url)
    for field, least, most in (("every", 1, None), ("keep_last", 0, None), ("max_attempts", 1, None),
                               ("part_size_mb", 5, MAX_PART_SIZE_MB),
                               ("concurrency", 1, MAX_CONCURRENCY)):
        value = raw.get(field)
        if field in raw and (isinstance(value, bool) or not isinstance(value, int) or value < least
                             or (most is not None and value > most)):
            allowed = f"in [{least}, {most}]" if most is not None else f">= {least}"
            raise ConfigError(f"{key}.{field} must be an integer {allowed}, got {value!r}")
    for field in ("connect_timeout_s", "retry_delay_s", "marker_timeout_s", "close_timeout_s"):
        value = raw.get(field)
        if field in raw and (isinstance(value, bool) or not isinstance(value, (int, float))
                             or not value > 0 or not math.isfinite(value)):
            raise ConfigError(f"{key}.{field} must be a finite number of seconds > 0, got {value!r}")
    endpoint = raw.get("endpoint_url")
    fields = dict(raw)
    if endpoint is not None:
        if not url.startswith("s3://"):
            raise ConfigError(f"{key}.endpoint_url is for s3:// tiers only")
        if not isinstance(endpoint, str) or urlsplit(endpoint).scheme not in ("http", "https") \
                or not _has_valid_port(endpoint):
            shown = (type(endpoint).__name__ if not isinstance(endpoint, str)
                     else without_userinfo(endpoint) if _has_valid_port(endpoint)
                     else "a URL whose port is no number")  # without_userinfo would raise
            raise ConfigError(f"{key}.endpoint_url must be an http(s) URL, got {shown!r}")
        fields["endpoint_url"] = without_userinfo(endpoint)
        if fields["endpoint_url"] != endpoint:
            _warn_once(f"{key}.endpoint_url holds a user name or password, which is not used "
                       f"(requests are signed with boto3's credentials: AWS_ACCESS_KEY_ID and "
                       f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/): dropped, the endpoint is "
                       f"{fields['endpoint_url']}")
    return TierConfig(**fields)


def _has_valid_port(url: str) -> bool:
    try:
        urlsplit(url).port  # noqa: B018 - raises ValueError for a port that is no number
    except ValueError:
        return False
    return True


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """Once per process: every rank parses the config, some more than once."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("async checkpoint: %s", message)
