"""The one typed configuration object, parsed once from the DeepSpeed JSON key
``"async_checkpoint"`` or Megatron's ``--async-ckpt-config`` file.

Unknown keys and bad values raise :class:`ConfigError` naming the key and what is allowed,
before training starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ConfigError, refuse_unknown_keys
from .memory.config import MemoryConfig, parse_memory
from .tiers.config import TierConfig, parse_tiers

#: The DeepSpeed config key this package reads.
CONFIG_KEY = "async_checkpoint"

MODES = ("async", "sync")
CHECKSUMS = ("xxh128", "crc32", "sha256", "none")
PERSIST_IN = ("thread", "process")

_GiB = 1024**3
MIN_HOST_BUFFER_BYTES = 4096
"""The smallest pool `host_buffer_gb` may give: one page (buffers are whole pages; below one,
no save could ever stage a tensor)."""


@dataclass(frozen=True, kw_only=True)
class AsyncCheckpointConfig:
    """Settings of the checkpoint engine. Every field has a safe default."""

    enabled: bool = False
    """Turn the engine on. When false, the framework's own checkpointing runs unchanged."""

    mode: str = "async"
    """``"async"``: save returns after enqueueing; copies, writes and commit run in the
    background. ``"sync"``: the same pipeline run inline (save returns once committed)."""

    host_buffer_gb: float = 8.0
    """Upper bound of the reused host staging pool, in GiB (pinned memory when CUDA is
    present). A rank whose state exceeds it streams: staging waits for writes to free space."""

    writer_threads: int = 4
    """Background writer threads per rank; each writes one file at a time."""

    persist_in: str = "thread"
    """Where files are written, checksummed and fsynced: ``"thread"``, by the writer threads
    in the training process; ``"process"``, by one worker process per checkpointer, which
    maps the host pool (then in shared memory) and writes from it, so the training
    interpreter only hands it each record's place in the pool. Files are byte for byte the
    same either way. The storage must then be picklable (it is sent to the worker)."""

    checksum: str = "xxh128"
    """Per-file checksum recorded in the manifest and verified on load: ``"xxh128"`` (XXH3
    128-bit, as ``xxh128sum`` prints it; hashes at memory speed), ``"crc32"`` (zlib's, about 5x
    slower), ``"sha256"`` (cryptographic, slowest) or ``"none"``."""

    zip_crc32: bool = False
    """Also store torch's own CRC-32 of every zip record, as ``torch.save`` does by default.
    Off by default: ``checksum`` already covers every byte, the second CRC costs about as much
    again, and ``torch.load`` reads files without it. Turn on for tools that check zip CRCs."""

    fsync: bool = True
    """fsync every file and directory before the checkpoint counts as persisted."""

    direct_io: bool = True
    """With ``fsync``, write files with ``O_DIRECT`` where the filesystem allows it: tensor
    bytes go from the host pool to the disk without a page-cache copy or kernel writeback work
    (falls back to buffered writes, with writeback started as the file is written, otherwise)."""

    verify_on_load: bool = True
    """Check each file's size and checksum against the committed manifest before loading."""

    commit_timeout_s: float = 600.0
    """How long rank 0 waits for every rank's persist record before the commit fails."""

    keep_last: int = 0
    """Retention: after each commit, rank 0 removes this engine's older committed checkpoints
    in the same save directory, keeping the ``keep_last`` most recently committed (the new one
    among them). ``0`` keeps every checkpoint. Its checkpoints that can never be loaded
    (partial saves a crash or failure cut short, Megatron checkpoints never finalized) are
    removed too once that commit is newer than their last change; saves in progress, damaged
    manifests and other engines' output are never removed."""

    split_replicated_files: bool = True
    """DeepSpeed without ZeRO-3: every data-parallel replica writes a share (about 1/N of the
    bytes) of the model-states file, which each holds alike, instead of the first replica
    writing all of it; the file is byte for byte the same. Needs the replicas to see one
    filesystem (as the commit already does). Off with ``zip_crc32``, MoE or node-local
    storage, and for a save whose file differs between replicas (rank-specific client state:
    found at the save, which then falls back to the first replica)."""

    node_local: bool = False
    """Each node saves into a directory of its own (node-local disks, the same path on every
    node), no directory being shared by all ranks: the ranks' records reach rank 0 through the
    process group's store instead of the checkpoint directory, the manifest says which node
    holds each file, and the lowest rank of every node writes the manifest and moves the
    pointer in its node's directory once rank 0 committed. DeepSpeed turns it on by itself
    with ``checkpoint.use_node_local_storage`` on several nodes."""

    tiers: tuple[TierConfig, ...] = ()
    """Durable tiers after the checkpoint directory, fastest first: each a JSON object with a
    ``url`` (an absolute path or ``s3://bucket/prefix``) and optionally ``every``, ``keep_last``,
    ``endpoint_url`` and the rest of :class:`~.tiers.config.TierConfig`. Committed checkpoints
    drain there in the background; a load restores from them what the checkpoint directory
    lacks. See ``docs/tiers.md``."""

    memory: MemoryConfig = MemoryConfig()
    """The memory tier (:class:`~.memory.config.MemoryConfig`): every save commits first in
    the host memory of the node's keeper process, which outlives the training processes, and
    every ``persist_every``-th is also written to the checkpoint directory. Async mode, the
    writer threads (``persist_in: "thread"``) and one node. See ``docs/tiers.md``."""

    pace_writes: bool = False
    """Async mode: spread each save's background writes (and their checksums) over the first
    half of the time until the next save is due, from the interval between the last two
    saves, instead of writing flat out right after the save; a write is never held past that
    point. The first save, and writes someone waits for (``wait``, ``close``, a load), go
    at once. See :mod:`~deepspeed_async_ckpt.persist.pacing`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", parse_tiers(self.tiers))
        object.__setattr__(self, "memory", parse_memory(self.memory))
        _check_type("enabled", self.enabled, bool)
        _check_choice("mode", self.mode, MODES)
        _check_choice("checksum", self.checksum, CHECKSUMS)
        _check_choice("persist_in", self.persist_in, PERSIST_IN)
        _check_type("fsync", self.fsync, bool)
        _check_type("zip_crc32", self.zip_crc32, bool)
        _check_type("direct_io", self.direct_io, bool)
        _check_type("verify_on_load", self.verify_on_load, bool)
        _check_type("split_replicated_files", self.split_replicated_files, bool)
        _check_type("node_local", self.node_local, bool)
        _check_type("pace_writes", self.pace_writes, bool)
        _check_positive_number("host_buffer_gb", self.host_buffer_gb)
        if not math.isfinite(self.host_buffer_gb):  # a bound: infinity is no bound
            raise ConfigError(f"{CONFIG_KEY}.host_buffer_gb must be a finite number > 0, "
                              f"got {self.host_buffer_gb!r}")
        if self.host_buffer_bytes < MIN_HOST_BUFFER_BYTES:  # every save would fail at its fence
            raise ConfigError(f"{CONFIG_KEY}.host_buffer_gb must allow at least one page of staging "
                              f"({MIN_HOST_BUFFER_BYTES} bytes: buffers are whole pages), got "
                              f"{self.host_buffer_gb!r} ({self.host_buffer_bytes} bytes)")
        _check_positive_number("commit_timeout_s", self.commit_timeout_s)
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ConfigError(f"{CONFIG_KEY}.keep_last must be an integer >= 0 (0 keeps every "
                              f"checkpoint), got {self.keep_last!r}")
        if isinstance(self.writer_threads, bool) or not isinstance(self.writer_threads, int) \
                or not 1 <= self.writer_threads <= 64:
            raise ConfigError(f"{CONFIG_KEY}.writer_threads must be an integer in [1, 64], "
                              f"got {self.writer_threads!r}")
        if self.memory.enabled:
            self._check_memory()

    def _check_memory(self) -> None:
        """Refuse what the memory tier cannot serve, naming both keys."""
        key = f"{CONFIG_KEY}.memory.enabled"
        if self.mode != "async":  # a memory save's writes and its commit run in the background
            raise ConfigError(f"{key} needs {CONFIG_KEY}.mode \"async\", got {self.mode!r}: a sync save "
                              "waits for its disk write, which the memory tier is there to skip")
        if self.persist_in != "thread":  # the worker process cannot reach the keeper's slot
            raise ConfigError(f"{key} needs {CONFIG_KEY}.persist_in \"thread\", got {self.persist_in!r}: "
                              "the files are copied into the keeper's memory by the writer threads")
        if self.node_local:
            raise ConfigError(f"{key} with {CONFIG_KEY}.node_local: the memory tier serves one node "
                              "(a checkpoint directory shared by the ranks); turn one of them off")

    @property
    def host_buffer_bytes(self) -> int:
        return int(self.host_buffer_gb * _GiB)

    @property
    def is_async(self) -> bool:
        return self.mode == "async"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "AsyncCheckpointConfig":
        """Build from the JSON block; rejects unknown keys, naming them and the allowed ones."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{CONFIG_KEY} must be a JSON object, got {type(raw).__name__}")
        refuse_unknown_keys(CONFIG_KEY, raw, [f.name for f in dataclasses.fields(cls)])
        return cls(**dict(raw))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "AsyncCheckpointConfig":
        """Read a JSON file holding either the block itself or ``{"async_checkpoint": {...}}``."""
        return cls.from_dict(read_block(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_block(path: str | os.PathLike) -> dict[str, Any]:
    """The ``async_checkpoint`` block of a JSON file that holds it bare or under that key."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read async checkpoint config {os.fspath(path)!r}: {exc}") from exc
    if isinstance(raw, Mapping) and CONFIG_KEY in raw:
        raw = raw[CONFIG_KEY]
    if not isinstance(raw, Mapping):
        raise ConfigError(f"async checkpoint config {os.fspath(path)!r} must hold a JSON object, "
                          f"got {type(raw).__name__}")
    return dict(raw)


def _check_type(key: str, value: Any, typ: type) -> None:
    if not isinstance(value, typ):
        raise ConfigError(f"{CONFIG_KEY}.{key} must be {typ.__name__} (true or false), got {value!r}")


def _check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{CONFIG_KEY}.{key} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _check_positive_number(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{CONFIG_KEY}.{key} must be a number > 0, got {value!r}")
