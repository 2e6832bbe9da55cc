"""The ranks that write one file together: :class:`Replicas` (``save(replicas=...)``) and
:func:`layout_digest`, what they must agree on to do so. Agreement on a step's outcome is
:mod:`..agreement`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ..agreement import collective_device
from ..snapshot import FilePlan


@dataclass(frozen=True)
class Replicas:
    """Ranks that all save the same file from the same state (DeepSpeed's model states, on
    every data-parallel replica) and can write it together: ``rank`` is this rank's index
    among them, ``size`` their number, ``group`` their ``torch.distributed`` process group
    (None: the default group). See :meth:`AsyncCheckpointer.save`."""

    rank: int
    size: int
    group: Any = None

    def gather(self, digest: bytes) -> list[bytes]:
        """Collective over the group: every replica's ``digest`` (all of one length), in
        replica order. One all-gather of a few bytes per replica, on the training thread."""
        import torch.distributed as dist

        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(collective_device(self.group))
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        return [bytes(t.cpu().tolist()) for t in every]


def layout_digest(plan: FilePlan) -> bytes:
    """What replicas must agree on to write a file in shares (xxh128): what its archive is
    laid out from (the pickle, the record sizes) and the values of its eager records. Those
    hold what the loop changes outside the optimizer step, which data-parallel replicas need
    not agree on (BatchNorm's running statistics follow each replica's own batches); the
    other records are weights and optimizer state, the same on every replica."""
    h = xxhash.xxh3_128(plan.pickle_bytes)
    h.update(b"".join(i.nbytes.to_bytes(8, "little") for i in plan.items))
    for item in plan.items:
        if item.eager and item.nbytes:
            src = item.src.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
            h.update(src.view(torch.uint8).cpu().numpy())
    return h.digest()

