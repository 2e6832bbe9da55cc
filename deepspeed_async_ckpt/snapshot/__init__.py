"""Stage 1 of 3: snapshot (device or host tensors -> a bounded, reused host buffer pool).

A save is first *planned* on the training thread, then its tensors are *staged*: eager ones
before ``save`` returns, lazy ones by a background copier while the next forward/backward runs,
until the fence before the optimizer step. In the order a tensor travels:

- :mod:`.planner`: :func:`plan_file` pickles the state once, as ``torch.save`` would, and lists
  its tensor records (:class:`FilePlan`), reusing the last save's plan of the file while its
  structure stays the same (:class:`PlanCache`); :func:`tensor_ids` and
  :func:`storage_addresses` pick which may be copied lazily.
- :mod:`.item`: :class:`TensorItem`, one record from its source tensor to its host copy.
- :mod:`.stager`: :class:`Stager`, the copier thread, the CUDA copy stream and the fence.
- :mod:`.pool`: :class:`HostBufferPool`, the bounded staging memory, reused across saves.
- :mod:`.pinned`: the pool's blocks of host memory, page-locked for CUDA copies.

The persist stage (:mod:`..persist`) writes each item's host copy and releases its buffer.
"""

from .item import TensorItem
from .planner import FilePlan, PlanCache, plan_file, storage_addresses, tensor_ids
from .pool import HostBufferPool
from .stager import Stager

__all__ = [
    "FilePlan",
    "HostBufferPool",
    "PlanCache",
    "Stager",
    "TensorItem",
    "plan_file",
    "storage_addresses",
    "tensor_ids",
]
