"""Durable tiers: committed checkpoints drained in the background from the checkpoint
directory (the first tier: node-local NVMe, say) to a shared path or an object store, and
restored from there before a load.

- :mod:`.config`: the schema of ``async_checkpoint.tiers``
- :mod:`.keys`: the tier's key names; :mod:`.remote`: the :class:`Remote` protocol, :class:`PathRemote`;
  :mod:`.s3`: :class:`S3Remote` (boto3)
- :mod:`.mirror`: copying one checkpoint to one tier in commit order; the tier's retention
- :mod:`.drain`: the :class:`Drainer` thread and its backlog rule
- :mod:`.choose`: which checkpoint a load takes; :mod:`.restore`: restore before load
  (:func:`.restore.restore`)
- :mod:`.durable`: :class:`DurableTiers`, the above wired to one checkpointer

Importing this package is cheap: :mod:`..config` reads :mod:`.config` at parse time, and
boto3 is imported only for an ``s3://`` tier.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Drainer", "DurableTiers", "PathRemote", "Remote", "S3Remote", "TierConfig", "open_remote",
           "parse_tiers"]

_LAZY = {
    "Drainer": "drain", "DurableTiers": "durable", "PathRemote": "remote", "Remote": "remote",
    "S3Remote": "s3", "TierConfig": "config", "open_remote": "remote",
    "parse_tiers": "config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
