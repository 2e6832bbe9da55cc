"""The memory tier's keeper: a process per node and save directory that owns shared memory
in which ranks copy their checkpoint files, so the copy outlives the ranks (a crash of every
training process) and a restart reads it back verified. Saves reach it through :mod:`.saver`.

- :mod:`.config`: :class:`MemoryConfig`, the schema of ``async_checkpoint.memory``
- :mod:`.address`: the socket, segment and log names derived from the save directory
- :mod:`.segment`: shared memory segments in ``/dev/shm``, created and unlinked by the keeper
- :mod:`.messages`: the typed requests and replies between a rank and the keeper
- :mod:`.slots`: the keeper's slots and their rules (copied, committed, ``keep_last``, ``max_gb``)
- :mod:`.keeper`: the process, how it is started, its serving loop and lifecycle
- :mod:`.client`: :class:`KeeperClient`, a rank's side
- :mod:`.saver`: :class:`~.saver.MemoryWriter`, the writer that copies a save's files into its slot
- :mod:`.restore`: a load's restore from memory (which checkpoint, laid out on tmpfs)

Importing this package is cheap; the keeper process imports neither torch nor the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KeeperClient", "KeeperError", "KeeperUnavailable", "MemoryConfig", "MemoryCopy", "Reservation",
           "parse_memory"]

_LAZY = {
    "KeeperClient": "client", "KeeperError": "client", "KeeperUnavailable": "client", "MemoryCopy": "client",
    "Reservation": "client", "MemoryConfig": "config", "parse_memory": "config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
