"""Asynchronous, lazy, rank-aware checkpointing for DeepSpeed and Megatron-core.

Importing this package is cheap (it runs at interpreter start through a ``.pth`` hook); the
engine's modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "AsyncCheckpointConfig",
    "AsyncCheckpointer",
    "AsyncCheckpointError",
    "CommitError",
    "CommitInfo",
    "ConfigError",
    "IntegrityError",
    "PersistError",
    "SnapshotError",
    "Pointer",
    "fence_all",
    "install",
    "uninstall",
    "verify_checkpoint",
]

_LAZY = {
    "AsyncCheckpointConfig": "config",
    "AsyncCheckpointer": "core",
    "AsyncCheckpointError": "errors",
    "CommitError": "errors",
    "CommitInfo": "core",
    "ConfigError": "errors",
    "IntegrityError": "errors",
    "PersistError": "errors",
    "SnapshotError": "errors",
    "Pointer": "commit",
    "fence_all": "core",
    "verify_checkpoint": "commit",
    "install": "integrations.activation",
    "uninstall": "integrations.activation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
