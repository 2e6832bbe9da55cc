"""The collectives a save and a load make on the training thread, and what their answers mean.

:func:`exchange_across_ranks` is the one collective ``begin`` makes (every rank): rank 0's
value, and every rank's error so that one rank's failure is raised on all of them.
:class:`Replicas` is the group of ranks that write one file together (``save(replicas=...)``),
and :func:`layout_digest` what they must agree on to do so. :func:`by_rank` and
:func:`only_durability` read the per-rank errors an exchange returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import xxhash

from ..errors import DurabilityError
from ..snapshot import FilePlan

_EXCHANGE_VALUE_BYTES = 64
#: How an exchange's error for a rank whose ``key`` differs from rank 0's begins.
ELSEWHERE = "works in "


def by_rank(errors: dict[int, str]) -> str:
    """``"1: msg; 3: msg"``: the per-rank errors an exchange returned, in rank order."""
    return "; ".join(f"{r}: {m}" for r, m in sorted(errors.items()))


def only_durability(errors: dict[int, str]) -> bool:
    """Whether every per-rank error an exchange returned is a :class:`DurabilityError` (the
    checkpoint is in place, a later step failed): then that is what every rank raises."""
    return all(m.startswith(f"{DurabilityError.__name__}:") for m in errors.values())


def _collective_device(group: Any = None) -> torch.device:
    """Where a collective's tensors go: the current CUDA device under NCCL, else the CPU."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def without_key(exchange: Callable[[str, str | None], tuple[str, dict[int, str]]], value: str,
                 error: str | None, key: str = "") -> tuple[str, dict[int, str]]:
    """``exchange``, which takes no ``key`` (a test's, say), called as one that does: the key
    is not checked."""
    return exchange(value, error)



def exchange_across_ranks(value: str, error: str | None, key: str = "") -> tuple[str, dict[int, str]]:
    """Collective: rank 0's ``value``, and every rank's error message (rank -> message) so that
    a failure on one rank is raised on all of them instead of leaving the others waiting in the
    next collective. A no-op without an initialized process group. ``key``: what every rank
    must agree on (``begin``'s checkpoint directory); a rank whose key differs from rank 0's
    gets an error naming both (it would persist elsewhere, and rank 0 wait for its record
    until ``commit_timeout_s`` and then blame it for not finishing).

    One all-reduce of a fixed-size tensor (how many ranks failed, rank 0's value in up to
    64 bytes, the sum of a 20-bit hash of ``key`` and of its square, which are n * h and
    n * h^2 only if every rank's hash is h) on the training thread of every save: O(log
    ranks) and no pickling, where an ``all_gather_object`` moves every rank's object to every
    rank (two collectives). Only when a rank failed, the keys differ (or rank 0's value is
    longer) do the messages follow, gathered as objects."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value, ({0: error} if error else {})
    device = _collective_device()
    # [ranks that failed, length of rank 0's value (-1: too long), sum of key hashes, sum of
    # their squares, rank 0's value's bytes...]: a sum over ranks in which only rank 0
    # contributes the value
    msg = torch.zeros(4 + _EXCHANGE_VALUE_BYTES, dtype=torch.int64)
    msg[0] = error is not None
    h = xxhash.xxh3_64_intdigest(key.encode()) & 0xFFFFF
    msg[2], msg[3] = h, h * h
    if dist.get_rank() == 0:
        encoded = value.encode()
        if len(encoded) <= _EXCHANGE_VALUE_BYTES:
            msg[1] = len(encoded)
            msg[4:4 + len(encoded)] = torch.tensor(list(encoded), dtype=torch.int64)
        else:
            msg[1] = -1
    msg = msg.to(device)
    dist.all_reduce(msg)
    failed, length, hashes, squares, *data = msg.tolist()
    if not failed and length >= 0 and hashes * hashes == dist.get_world_size() * squares:
        return bytes(data[:length]).decode(), {}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (value, error, key))
    errors = {r: e for r, (_, e, _) in enumerate(gathered) if e}
    first = gathered[0][2]
    for r, (_, _, other) in enumerate(gathered):
        if other != first and r not in errors:
            errors[r] = f"{ELSEWHERE}{other!r}, rank 0 in {first!r}"
    return gathered[0][0], errors


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

        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(_collective_device(self.group))
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

