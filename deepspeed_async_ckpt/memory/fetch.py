"""A restore across nodes: the files a node's ranks read that its keeper does not hold, sent by
the leader of a node whose keeper does.

Each node's keeper holds its own ranks' files, while a node's ranks may read every file of the
checkpoint (DeepSpeed's ZeRO-1/2 ranks read every rank's optimizer file; a Megatron load reads
the shards other ranks wrote). :func:`fetch_lacking` runs on every rank once each node's leader
linked what its own keeper holds (:mod:`.restore`):

1. one ``all_gather_object`` of each leader's offer: the files it holds (size, xxh128) and those
   it lacks; a leader that failed already fails the restore on every rank here;
2. the plan, computed alike on every rank: each lacking file from the lowest node that holds
   it, in (receiving rank, file) order; a file no node holds fails the restore, naming it;
3. the leaders send and receive each file as one uint8 tensor over gloo (the default group
   where it is gloo, else a gloo group made for this), in plan order: the same order of
   point-to-point pairs on every leader cannot deadlock. The receiver maps the file in its
   restore directory and receives into it, then checks it against the holder's xxh128. A
   failure is kept and the next transfer goes on, so that every pair stays matched; the
   restore's last exchange then falls back on every rank, naming it.
"""

from __future__ import annotations

import mmap
import os
import warnings
from typing import Any

from ..agreement import gather
from ..errors import AgreementError, IntegrityError

Offer = dict
"""``{"node": n, "held": {file: (size, checksum)}, "lacking": [file, ...]}``, or None (not a leader)."""


def fetch_lacking(layout: Any, own: BaseException | None, *, rank: int,
                  world_size: int) -> tuple[BaseException | None, AgreementError | None]:
    """Collective (every rank): fill each leader's ``layout`` (a ``restore._Layout``, None on
    the other ranks) with the files it lacks. Returns (this rank's failure, or ``own``; the
    error every rank shares where a leader failed before the transfers, else None)."""
    try:
        offers = gather("restore from memory", lambda: _offer(layout, own))
    except AgreementError as exc:
        return own, exc
    try:
        plan = transfers(offers)
    except IntegrityError as exc:  # the same on every rank: the last exchange shares it
        return exc, None
    if plan:
        own = _send_and_receive(plan, layout, rank)
    return own, None


def _offer(layout: Any, own: BaseException | None) -> Offer | None:
    if own is not None:
        raise own
    if layout is None:
        return None
    return {"node": layout.node, "held": {rel: (size, checksum) for rel, (_, size, checksum) in layout.held.items()},
            "lacking": list(layout.lacking)}


def transfers(offers: list[Offer | None]) -> list[tuple[str, int, int, int, str]]:
    """The plan, from every rank's offer (by rank): ``(file, from rank, to rank, size,
    checksum)``, each lacking file from the lowest-ranked leader holding it. IntegrityError
    naming the files no node holds."""
    holders: dict[str, tuple[int, int, str]] = {}
    for r, offer in enumerate(offers):
        for rel, (size, checksum) in sorted((offer or {}).get("held", {}).items()):
            holders.setdefault(rel, (r, size, checksum))
    plan, nowhere = [], []
    for r, offer in enumerate(offers):
        for rel in sorted((offer or {}).get("lacking", ())):
            if rel in holders:
                src, size, checksum = holders[rel]
                plan.append((rel, src, r, size, checksum))
            else:
                nowhere.append(f"{rel} (node {offer['node']} reads it)")
    if nowhere:
        raise IntegrityError(f"no node's keeper holds {', '.join(nowhere)}")
    return plan


def _send_and_receive(plan: list[tuple[str, int, int, int, str]], layout: Any, rank: int) -> BaseException | None:
    import torch
    import torch.distributed as dist

    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")  # every rank, alike
    failure: BaseException | None = None
    for rel, src, dst, size, checksum in plan:
        if rank not in (src, dst):
            continue
        if rank == src:
            failed = _send(layout, rel, size, dst, group, torch, dist)
        else:
            failed = _receive(layout, rel, size, checksum, src, group, torch, dist)
        failure = failure or failed  # the first one; every pair still runs
    return failure


def _send(layout: Any, rel: str, size: int, dst: int, group: Any, torch: Any, dist: Any) -> BaseException | None:
    """Send ``rel`` from this node's keeper, verified; zeros where it cannot be read (the
    receiver's check then fails too, and the pair stays matched)."""
    if size == 0:
        return None
    failure, view = None, None
    try:
        view = layout.copy.read(layout.held[rel][0], rel)
        with warnings.catch_warnings():  # read-only memory: the tensor is only sent
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(view, dtype=torch.uint8)
    except Exception as exc:  # noqa: BLE001 - kept, shared by the restore's last exchange
        failure, tensor = exc, torch.zeros(size, dtype=torch.uint8)
    try:
        dist.send(tensor, dst, group=group)
    finally:
        del tensor
        if view is not None:
            view.release()
    return failure


def _receive(layout: Any, rel: str, size: int, checksum: str, src: int, group: Any, torch: Any,
             dist: Any) -> BaseException | None:
    """Receive ``rel`` into its file in the restore directory, then check it. Where the file
    cannot be made (``/dev/shm`` full), the bytes are still received, into memory, and dropped:
    the pair stays matched and the failure goes to the restore's last exchange."""
    from ..persist.checksum import new_hasher

    try:
        space = _space(layout.target(rel), size)
    except OSError as exc:
        if size:  # a file of no bytes is not sent
            dist.recv(torch.empty(size, dtype=torch.uint8), src, group=group)
        return exc
    if space is None:
        return None
    try:
        tensor = torch.frombuffer(space, dtype=torch.uint8)
        dist.recv(tensor, src, group=group)
        del tensor
        hasher = new_hasher(layout.copy.algorithm)
        hasher.update(space)
        if hasher.hexdigest() != checksum:
            return IntegrityError(f"{rel} from rank {src}'s node: {layout.copy.algorithm} {hasher.hexdigest()} "
                                  f"does not match the {checksum} its rank reported")
        return None
    finally:
        space.close()


def _space(target: str, size: int) -> mmap.mmap | None:
    """``target`` made ``size`` bytes (allocated) and mapped writable; None for no bytes."""
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if size == 0:
            return None
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
