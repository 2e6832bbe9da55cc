"""The schema of the memory tier: ``async_checkpoint.memory``.

::

    "memory": {"enabled": true, "persist_every": 10, "keep_last": 2, "max_gb": 64}

Every save commits first in host memory owned by the node's keeper process
(:mod:`.keeper`); every ``persist_every``-th is also written to the checkpoint directory.
The block is parsed once into a frozen :class:`MemoryConfig`; a bad value raises
:class:`ConfigError` naming the key (``async_checkpoint.memory.keep_last``) and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ConfigError, refuse_unknown_keys

KEY = "async_checkpoint.memory"

_GB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """The memory tier of one job: how often a save also goes to disk, what the keeper holds."""

    enabled: bool = False
    """Save to the keeper's memory first."""

    persist_every: int = 10
    """Every N-th save is also written to the checkpoint directory (and drained to the durable
    tiers), from the same host copies as the memory copy (never a second device-to-host copy);
    the others stay in memory only. Save 0 of a run, and every N-th after it, persists."""

    keep_last: int = 2
    """Committed memory checkpoints the keeper keeps (the newest); one more may be being
    written beside them."""

    max_gb: float | None = None
    """Bound on the keeper's shared memory, in GiB (2**30 bytes): a reservation beyond it is
    refused, naming this key. None: only the free space of ``/dev/shm`` bounds it."""

    idle_timeout_s: float = 900.0
    """Seconds the keeper stays with no client connected (the ranks crashed and have not come
    back yet) before it exits and frees its memory."""

    @property
    def max_bytes(self) -> int | None:
        """``max_gb`` in bytes (None: unbounded by the setting)."""
        return None if self.max_gb is None else int(self.max_gb * _GB)


def parse_memory(raw: Any) -> MemoryConfig:
    """The ``memory`` object of the config (a parsed :class:`MemoryConfig` passes through;
    None: the tier off)."""
    if raw is None:
        return MemoryConfig()
    if isinstance(raw, MemoryConfig):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{KEY} must be a JSON object such as {{\"enabled\": true, \"persist_every\": 10, "
                          f"\"keep_last\": 2}}, got {type(raw).__name__}")
    refuse_unknown_keys(KEY, raw, [f.name for f in dataclasses.fields(MemoryConfig)])
    enabled = raw.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{KEY}.enabled must be true or false, got {enabled!r}")
    for field in ("persist_every", "keep_last"):
        value = raw.get(field)
        if field in raw and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{KEY}.{field} must be an integer >= 1, got {value!r}")
    max_gb = raw.get("max_gb")
    if max_gb is not None and (isinstance(max_gb, bool) or not isinstance(max_gb, (int, float))
                               or not max_gb > 0 or not math.isfinite(max_gb)):
        raise ConfigError(f"{KEY}.max_gb must be a finite number of GiB > 0 (or null: bounded by "
                          f"/dev/shm alone), got {max_gb!r}")
    idle = raw.get("idle_timeout_s")
    if "idle_timeout_s" in raw and (isinstance(idle, bool) or not isinstance(idle, (int, float))
                                    or not idle > 0 or not math.isfinite(idle)):
        raise ConfigError(f"{KEY}.idle_timeout_s must be a finite number of seconds > 0, got {idle!r}")
    return MemoryConfig(**dict(raw))
