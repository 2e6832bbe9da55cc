"""The keeper's slots: one per checkpoint, holding each rank's files (a segment each), and the
rules that move a slot from *open* to *copied* to *committed* and free it.

Pure bookkeeping run by the keeper's one thread (no locks); the only side effects are
creating and unlinking segments (:mod:`.segment`).

- At most one slot is not committed at a time ("one being written"): a reservation for another
  save meanwhile gets :class:`~.messages.Busy`. A slot nobody can finish is dropped: when a
  connection closes holding a reservation it has not reported (its rank died mid-copy), and,
  at the next reservation for another save, when every connection that reserved in it is gone.
- A slot is *copied* when every rank in its ``node_ranks`` reported every file it reserved,
  with sizes within the reservation and checksums; each file's segment is then cut to the
  file's size, so that a restore can hard-link it as the file; *committed* only by an explicit
  :class:`~.messages.Commit` (the job's commit across nodes), which keeps the ``keep_last``
  newest committed slots and frees the others.
- Every byte held counts against ``max_bytes``; a reservation beyond it is refused, naming
  ``async_checkpoint.memory.max_gb``.
- The segments of a slot that ``keep_last`` retires are kept as spares and given to the next
  reservation's files of about their size: their pages are already allocated and the rank's
  copy is the only cost (allocating 512 MiB of fresh segment is a measurable part of a copy).
  Spares count as held; those no file fits are unlinked before a new segment is made. The
  segments of a slot a restore laid out (:class:`~.messages.Newest` with ``lend``) are
  never spares: the loaded training state may map them still.
"""

from __future__ import annotations

import errno
import itertools
import logging
from dataclasses import dataclass, field

from . import segment
from .address import KeeperAddress
from .config import KEY
from .messages import (Abandon, Busy, Commit, Done, FileDigest, FilePlace, KeeperState, Newest, NoSlot, RankFiles,
                       Refused, Report, Reserve, Reserved, SlotState, SlotView, StoredFile)

log = logging.getLogger("deepspeed_async_ckpt.memory.keeper")

OPEN, COPIED, COMMITTED = "open", "copied", "committed"


@dataclass
class _Part:
    """One rank's reservation in a slot: a segment per file, ``held`` bytes each (whole pages)."""
    places: tuple[FilePlace, ...]
    held: dict[str, int]
    conn: int
    digests: tuple[FileDigest, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(self.held.values())


@dataclass
class Slot:
    name: str
    save_id: str
    node_ranks: tuple[int, ...]
    parts: dict[int, _Part] = field(default_factory=dict)
    state: str = OPEN
    algorithm: str = ""
    committed_seq: int = 0
    manifest: dict | None = None
    late: tuple = ()
    stakes: set[int] = field(default_factory=set)
    """Connections that reserved in this slot and are still open."""
    lent: bool = False
    """A restore hard-linked its segments: they are unlinked when it goes, never spares."""

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())

    @property
    def missing(self) -> tuple[int, ...]:
        return tuple(r for r in self.node_ranks if r not in self.parts or self.parts[r].digests is None)

    def describe(self) -> SlotState:
        return SlotState(self.name, self.save_id, self.state, self.missing if self.state == OPEN else ())


class SlotTable:
    """Every slot of one keeper."""

    def __init__(self, address: KeeperAddress, pid: int, *, keep_last: int, max_bytes: int | None) -> None:
        self.address, self.pid = address, pid
        self.keep_last, self.max_bytes = keep_last, max_bytes
        self.slots: list[Slot] = []
        self.spares: list[tuple[str, int]] = []
        """(segment, bytes) of retired slots, for reuse."""
        self._serial = itertools.count()
        self._commits = itertools.count(1)

    @property
    def held_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots) + sum(n for _, n in self.spares)

    def configure(self, keep_last: int, max_bytes: int | None) -> None:
        """The job's settings (a restarted job may bring new ones): the latest wins."""
        if (keep_last, max_bytes) != (self.keep_last, self.max_bytes):
            log.info("settings: keep_last %d -> %d, max_bytes %s -> %s", self.keep_last, keep_last,
                     self.max_bytes, max_bytes)
        self.keep_last, self.max_bytes = keep_last, max_bytes
        self._retire()

    def reserve(self, conn: int, req: Reserve) -> Reserved | Busy | Refused:
        what = f"rank {req.rank} for {req.name} (save {req.save_id})"
        if req.rank not in req.node_ranks:
            return Refused(f"{what}: rank {req.rank} is not among the node's ranks {list(req.node_ranks)}")
        names = [f.name for f in req.files]
        if len(set(names)) != len(names) or any(f.capacity < 0 for f in req.files):
            return Refused(f"{what}: file names must be distinct and capacities >= 0: {names}")
        slot = self._find(req.name, req.save_id)
        if slot is None:
            for other in [s for s in self.slots if s.state != COMMITTED]:
                if not other.stakes:
                    self._drop(other, "every rank that wrote it is gone")
                else:
                    return Busy(f"{other.name} (save {other.save_id}) is {other.state}"
                                + (f", ranks {list(other.missing)} still copying" if other.state == OPEN
                                   else ", waiting for its commit"))
            slot = Slot(req.name, req.save_id, tuple(req.node_ranks))  # kept once its first part is made
        elif slot.state != OPEN:
            return Refused(f"{what}: the slot is already {slot.state}")
        elif tuple(req.node_ranks) != slot.node_ranks:
            return Refused(f"{what}: node ranks {list(req.node_ranks)} differ from {list(slot.node_ranks)} "
                           "that the slot was opened with")
        if req.rank in slot.parts:
            return Refused(f"{what}: the rank already reserved its files in this slot")
        sizes = [segment.size_for(f.capacity) for f in req.files]
        taken = [self._spare(n) for n in sizes]
        if None in taken:
            self._drop_spares()  # those no file took: their memory goes before new segments come
        if self.max_bytes is not None and self.held_bytes + sum(sizes) > self.max_bytes:
            for spare in taken:  # reuse only saves time: within the bound, count every byte afresh
                if spare is not None:
                    segment.unlink(spare[0])
            taken = [None] * len(sizes)
            self._drop_spares()
            if self.held_bytes + sum(sizes) > self.max_bytes:
                return Refused(f"{KEY}.max_gb is {self.max_bytes / 2**30:g} ({self.max_bytes} bytes): {what} "
                               f"asked {sum(sizes)} bytes while the keeper holds {self.held_bytes} bytes "
                               f"({self._count(COMMITTED)} committed checkpoint(s), keep_last={self.keep_last}, "
                               f"and the one being written); raise {KEY}.max_gb or lower {KEY}.keep_last")
        asked = sum(n for n, spare in zip(sizes, taken) if spare is None)
        made: list[str] = []
        held: dict[str, int] = {}
        places = []
        try:
            for f, n, spare in zip(req.files, sizes, taken):
                if spare is None:
                    name = self.address.segment_name(self.pid, next(self._serial))
                    made.append(name)
                    held[name] = segment.create(name, n)
                else:
                    name = spare[0]
                    held[name] = segment.resize(name, n)
                places.append(FilePlace(f.name, name, f.capacity))
        except OSError as exc:
            for name in made:
                segment.unlink(name)
            self.spares.extend(spare for spare in taken if spare is not None)
            if exc.errno != errno.ENOSPC:
                raise
            return Refused(f"{what}: /dev/shm has no room for {asked} bytes ({segment.free_bytes()} free) while "
                           f"the keeper holds {self.held_bytes} bytes; lower {KEY}.keep_last or {KEY}.max_gb, "
                           "or enlarge /dev/shm")
        if not slot.parts:
            self.slots.append(slot)
        slot.parts[req.rank] = _Part(tuple(places), held, conn)
        slot.stakes.add(conn)
        return Reserved(tuple(places))

    def _spare(self, nbytes: int) -> tuple[str, int] | None:
        """The spare closest in size to ``nbytes``, within an eighth (or 1 MiB) either way: a
        retired file of the same name and about the same size, where the model did not change."""
        slack = max(nbytes // 8, 1 << 20)
        fits = [s for s in self.spares if abs(s[1] - nbytes) <= slack]
        if not fits:
            return None
        best = min(fits, key=lambda s: abs(s[1] - nbytes))
        self.spares.remove(best)
        return best

    def _drop_spares(self) -> None:
        for name, _ in self.spares:
            segment.unlink(name)
        self.spares.clear()

    def report(self, req: Report) -> SlotState | Refused:
        what = f"rank {req.rank} for {req.name} (save {req.save_id})"
        slot = self._find(req.name, req.save_id)
        if slot is None or req.rank not in slot.parts:
            return Refused(f"{what}: no reservation of the rank in that slot (the slot was dropped, or never "
                           "reserved)")
        part = slot.parts[req.rank]
        if part.digests is not None or slot.state != OPEN:
            return Refused(f"{what}: the rank already reported its files")
        if slot.algorithm and req.algorithm != slot.algorithm:
            return Refused(f"{what}: checksums in {req.algorithm}, other ranks' in {slot.algorithm}")
        space = {p.name: p.capacity for p in part.places}
        if sorted(d.name for d in req.files) != sorted(space):
            return Refused(f"{what}: reported files {sorted(d.name for d in req.files)} are not the "
                           f"reserved ones {sorted(space)}")
        for d in req.files:
            if not 0 <= d.size <= space[d.name]:
                return Refused(f"{what}: {d.name} has {d.size} bytes, reserved {space[d.name]}")
        slot.algorithm = req.algorithm
        part.digests = tuple(req.files)
        for d in req.files:  # the segment is the file from now on
            seg = next(p.segment for p in part.places if p.name == d.name)
            part.held[seg] = segment.cut(seg, d.size)
        if not slot.missing:
            slot.state = COPIED
            log.info("%s (save %s) copied by every rank of the node %s", slot.name, slot.save_id,
                     list(slot.node_ranks))
        return slot.describe()

    def commit(self, req: Commit) -> SlotState | Refused:
        slots = [s for s in self.slots if s.name == req.name and req.save_id in (None, s.save_id)]
        if not slots:
            return Refused(f"no slot {req.name}" + (f" (save {req.save_id})" if req.save_id else "")
                           + " in the keeper's memory")
        slot = slots[-1]
        if slot.state == OPEN:
            return Refused(f"{slot.name} (save {slot.save_id}) cannot be committed: ranks {list(slot.missing)} "
                           "of the node have not copied their files")
        if slot.state == COPIED:
            slot.state, slot.committed_seq = COMMITTED, next(self._commits)
            slot.manifest, slot.late = req.manifest, req.late
            log.info("%s (save %s) committed", slot.name, slot.save_id)
            self._retire()
        return slot.describe()

    def abandon(self, req: Abandon) -> Done | Refused:
        slot = self._find(req.name, req.save_id)
        if slot is not None and slot.state != COMMITTED:
            self._drop(slot, "abandoned by the job")
        elif slot is not None:
            return Refused(f"{req.name} (save {req.save_id}) is committed; it is freed by keep_last only")
        return Done()

    def newest(self, req: Newest = Newest()) -> SlotView | NoSlot:
        committed = [s for s in self.slots if s.state == COMMITTED]
        if not committed:
            return NoSlot()
        s = max(committed, key=lambda s: s.committed_seq)
        if req.lend and not s.lent:
            s.lent = True
            log.info("%s (save %s) lent to a load: its segments will not be reused", s.name, s.save_id)
        ranks = tuple(RankFiles(r, tuple(
            StoredFile(d.name, place.segment, d.size, d.checksum)
            for place in p.places for d in p.digests if d.name == place.name))
            for r, p in sorted(s.parts.items()))
        return SlotView(s.name, s.save_id, s.algorithm, ranks, s.manifest, s.late)

    def state(self, clients: int) -> KeeperState:
        return KeeperState(self.pid, self.held_bytes, self.max_bytes, self.keep_last, clients,
                           tuple(s.describe() for s in self.slots))

    def connection_closed(self, conn: int) -> None:
        for slot in list(self.slots):
            slot.stakes.discard(conn)
            if slot.state == OPEN and any(p.conn == conn and p.digests is None for p in slot.parts.values()):
                self._drop(slot, "a rank's connection closed before it reported its files")

    def release_all(self) -> None:
        for slot in list(self.slots):
            self._drop(slot, "the keeper exits")
        self._drop_spares()

    def _find(self, name: str, save_id: str) -> Slot | None:
        return next((s for s in self.slots if s.name == name and s.save_id == save_id), None)

    def _count(self, state: str) -> int:
        return sum(s.state == state for s in self.slots)

    def _retire(self) -> None:
        committed = sorted((s for s in self.slots if s.state == COMMITTED), key=lambda s: s.committed_seq)
        for slot in committed[:max(0, len(committed) - self.keep_last)]:
            self._drop(slot, f"keep_last={self.keep_last}", spare=True)

    def _drop(self, slot: Slot, why: str, spare: bool = False) -> None:
        """Free ``slot``; its segments become spares (``spare``: a committed slot, written by no
        rank any more, that no load has mapped) or are unlinked."""
        for part in slot.parts.values():
            for seg, held in part.held.items():
                if spare and not slot.lent:
                    self.spares.append((seg, held))
                else:
                    segment.unlink(seg)
        self.slots.remove(slot)
        log.info("%s (save %s, %s) freed: %s", slot.name, slot.save_id, slot.state, why)
