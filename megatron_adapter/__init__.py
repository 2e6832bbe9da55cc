"""Megatron-core adapter of the async checkpoint engine (see README.md, "Megatron-core").

Saves megatron-core sharded state dicts in megatron's own ``torch_dist`` format through the
engine's lazy snapshot, background persist and atomic commit, electing one writer per unique
shard from the replica ids. Submodules load on first use; importing this package is cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "MegatronCheckpointer",
    "ParallelLayout",
    "SaveRecord",
    "WRITER_MODES",
    "add_arguments",
    "checkpoint_dir",
    "config_from_args",
    "read_tracker",
    "verify_checkpoint_dir",
]

_LAZY = {
    "MegatronCheckpointer": "checkpointer",
    "SaveRecord": "checkpointer",
    "checkpoint_dir": "checkpointer",
    "read_tracker": "checkpointer",
    "verify_checkpoint_dir": "verify",
    "ParallelLayout": "layout",
    "WRITER_MODES": "election",
    "add_arguments": "arguments",
    "config_from_args": "arguments",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
