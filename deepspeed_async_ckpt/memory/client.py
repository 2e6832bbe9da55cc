"""A rank's side of the keeper: :class:`KeeperClient` finds (or starts) its save directory's
keeper, reserves space for the rank's files of a save, and reads the newest committed slot
back, verified.

Which ranks make each call is in :mod:`.messages`. Writing a save::

    client = KeeperClient.connect(save_dir, config)           # starts the keeper if none runs
    res = client.reserve("global_step10", save_id, rank, node_ranks, {"model.pt": nbytes})
    res.write("model.pt", data)                                # one memcpy into shared memory
    res.report()                                               # sizes and checksums
    client.commit("global_step10", save_id)                    # after the job's commit

Reading it back after a restart::

    copy = client.newest()                                     # None: no committed slot
    data = copy.read(rank, "model.pt")                         # verified, or IntegrityError
"""

from __future__ import annotations

import base64
import os
import socket
import time
from typing import Mapping

from ..errors import AsyncCheckpointError, IntegrityError
from . import keeper
from .address import KeeperAddress
from .config import MemoryConfig
from .messages import (Abandon, Busy, Commit, FileDigest, FileSpace, Hello, InlineFile, KeeperState, Newest, NoSlot, Refused,
                       Report, Reserve, Reserved, Shutdown, SlotState, SlotView, Status, StoredFile, Welcome, decode, encode)
from .segment import Mapping as SegmentMapping
from .segment import path_of

ALGORITHM = "xxh128"
_CHUNK = 8 << 20


class KeeperError(AsyncCheckpointError):
    """The keeper refused a request (memory bound, a slot not copied, ...): the message says why."""


class KeeperUnavailable(KeeperError):
    """No keeper runs for the save directory, or it went away during a request."""


class KeeperClient:
    """One connection to the keeper of a save directory (one per rank; not shared by threads)."""

    def __init__(self, address: KeeperAddress, sock: socket.socket, welcome: Welcome) -> None:
        self.address, self._sock = address, sock
        self._reader = sock.makefile("rb")
        self.keeper_pid, self.log_path = welcome.pid, welcome.log_path

    @classmethod
    def connect(cls, save_dir: str, config: MemoryConfig, *, start: bool = True,
                timeout_s: float = 30.0, node: int = 0) -> "KeeperClient":
        """Connect to ``save_dir``'s keeper on this node (``node``: its index in the job),
        starting it first (``start``) if none runs; the job's settings (``keep_last``,
        ``max_gb``, ``idle_timeout_s``) go to it. :class:`KeeperUnavailable` if none runs and
        ``start`` is False."""
        address = KeeperAddress.of(save_dir, node=node)
        hello = Hello(os.getpid(), config.keep_last, config.max_bytes, config.idle_timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return cls._open(address, hello, timeout_s)
            except KeeperUnavailable:
                # None listens, or one was exiting (idle) as we came: start one, once per pass.
                if not start or time.monotonic() > deadline:
                    raise
            try:
                keeper.start(save_dir, keep_last=config.keep_last, max_bytes=config.max_bytes,
                             idle_timeout_s=config.idle_timeout_s, timeout_s=max(1.0, deadline - time.monotonic()),
                             node=node)
            except keeper.KeeperStartError as exc:
                raise KeeperUnavailable(str(exc)) from exc

    @classmethod
    def find(cls, save_dir: str, config: MemoryConfig | None = None, *, node: int = 0) -> "KeeperClient | None":
        """The running keeper of ``save_dir`` on node ``node``, or None (a restarting rank asks
        this: no keeper means no memory copy, not an error)."""
        try:
            return cls.connect(save_dir, config or MemoryConfig(), start=False, node=node)
        except KeeperUnavailable:
            return None

    @classmethod
    def newest_name(cls, save_dir: str, *, node: int = 0) -> str | None:
        """The name of the newest checkpoint committed in ``save_dir``'s keeper of node
        ``node``; None where no keeper runs or it holds none (what a script waiting for a memory
        commit polls)."""
        client = cls.find(save_dir, node=node)
        if client is None:
            return None
        try:
            copy = client.newest()
        finally:
            client.close()
        if copy is None:
            return None
        copy.close()
        return copy.name

    @classmethod
    def _open(cls, address: KeeperAddress, hello: Hello, timeout_s: float) -> "KeeperClient":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(address.socket_name)
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            sock.close()
            raise KeeperUnavailable(f"no memory keeper runs for {address.save_dir} ({address.shown})") from exc
        client = cls(address, sock, Welcome(0, address.log_path))
        try:
            welcome = client._call(hello)
        except BaseException:
            client.close()
            raise
        client.keeper_pid = welcome.pid
        return client

    def _call(self, request):
        try:
            self._sock.sendall(encode(request))
            line = self._reader.readline()
        except OSError as exc:
            raise self._gone(exc) from exc
        if not line:
            raise self._gone(None)
        reply = decode(line)
        if isinstance(reply, Refused):
            raise KeeperError(f"memory keeper of {self.address.save_dir}: {reply.reason}")
        return reply

    def _gone(self, exc: BaseException | None) -> KeeperUnavailable:
        why = f"{type(exc).__name__}: {exc}" if exc else "connection closed"
        return KeeperUnavailable(f"the memory keeper of {self.address.save_dir} ({self.address.shown}, pid "
                                 f"{self.keeper_pid}) is gone ({why}); its log: {self.log_path}")

    def reserve(self, name: str, save_id: str, rank: int, node_ranks: tuple[int, ...] | list[int],
                files: Mapping[str, int], *, wait_s: float = 60.0) -> "Reservation":
        """Space for this rank's ``files`` (name -> capacity in bytes) in the slot of save
        ``name``/``save_id``. Waits up to ``wait_s`` while another save's slot is still being
        written or waits for its commit; :class:`KeeperError` if it still is, or if the
        memory bound refuses it."""
        request = Reserve(name, save_id, rank, tuple(node_ranks), tuple(FileSpace(n, c) for n, c in files.items()))
        deadline, pause = time.monotonic() + wait_s, 0.001
        while True:
            reply = self._call(request)
            if isinstance(reply, Reserved):
                return Reservation(self, request, reply)
            if not isinstance(reply, Busy):
                raise KeeperError(f"memory keeper of {self.address.save_dir}: unexpected reply {reply!r} "
                                  f"to {request!r}")
            if time.monotonic() + pause > deadline:
                raise KeeperError(f"memory keeper of {self.address.save_dir}: rank {rank} could not reserve "
                                  f"{name} (save {save_id}) in {wait_s:g} s: {reply.reason}")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def commit(self, name: str, save_id: str | None = None, manifest: dict | None = None,
               late: Mapping[str, bytes] | None = None) -> SlotState:
        """Mark the copied slot ``name`` committed (call after the job's commit across nodes),
        keeping ``manifest`` (the checkpoint's, as JSON) and ``late`` (the small files its
        finalize steps wrote: path in the checkpoint -> bytes) with it: the keeper's pointer
        names it and ``keep_last`` frees older ones."""
        inline = tuple(InlineFile(n, base64.b64encode(bytes(d)).decode("ascii")) for n, d in (late or {}).items())
        return self._call(Commit(name, save_id, manifest, inline))

    def abandon(self, name: str, save_id: str) -> None:
        """Drop the uncommitted slot of a save that failed, freeing its memory."""
        self._call(Abandon(name, save_id))

    def newest(self, *, lend: bool = False) -> "MemoryCopy | None":
        """The newest committed slot, or None when the keeper holds none. ``lend``: the caller
        hard-links its files (:meth:`MemoryCopy.link`), so the keeper never reuses their memory."""
        reply = self._call(Newest(lend))
        return None if isinstance(reply, NoSlot) else MemoryCopy(reply)

    def status(self) -> KeeperState:
        return self._call(Status())

    def shutdown(self) -> None:
        """End the keeper (the job's last save is on disk): it unlinks every segment and exits."""
        self._call(Shutdown())
        self.close()

    def close(self) -> None:
        self._reader.close()
        self._sock.close()


class Reservation:
    """One rank's space in a slot, each file's segment mapped writable: write the files, then
    :meth:`report`."""

    def __init__(self, client: KeeperClient, request: Reserve, reply: Reserved) -> None:
        self._client, self._request = client, request
        self.places = {p.name: p for p in reply.files}
        self.sizes: dict[str, int] = {}
        self._maps: dict[str, SegmentMapping] = {}
        try:
            for p in reply.files:
                self._maps[p.name] = SegmentMapping(p.segment, writable=True)
        except BaseException:
            self.close()
            raise

    def buffer(self, file: str) -> memoryview:
        """The file's space (its capacity), to write into in place; say its size at
        :meth:`report`. Release the view before :meth:`report` (which unmaps the segments)."""
        return self._maps[file].view[:self.places[file].capacity]

    def write(self, file: str, data) -> None:
        """Copy ``data`` (any bytes-like object) into the file's space: one memcpy."""
        view = memoryview(data).cast("B")
        p = self.places[file]
        if view.nbytes > p.capacity:
            raise KeeperError(f"{file}: {view.nbytes} bytes do not fit the {p.capacity} reserved for it in "
                              f"{self._request.name}")
        self._maps[file].view[:view.nbytes] = view
        self.sizes[file] = view.nbytes

    def report(self, sizes: Mapping[str, int] | None = None) -> SlotState:
        """Tell the keeper this rank's files are copied: their sizes (written ones, else
        ``sizes``, else the capacity) and checksums, hashed here from the shared memory."""
        from ..persist.checksum import new_hasher

        digests = []
        for name, p in self.places.items():
            size = self.sizes.get(name, (sizes or {}).get(name, p.capacity))
            hasher = new_hasher(ALGORITHM)
            hasher.update(self._maps[name].view[:size])
            digests.append(FileDigest(name, size, hasher.hexdigest()))
        self.close()
        r = self._request
        return self._client._call(Report(r.name, r.save_id, r.rank, ALGORITHM, tuple(digests)))

    def close(self) -> None:
        """Unmap the segments without reporting (a save that failed: :meth:`KeeperClient.abandon` it)."""
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()


class MemoryCopy:
    """A committed slot as a reader sees it: every rank's files, each read verified."""

    def __init__(self, view: SlotView) -> None:
        self.name, self.save_id, self.algorithm = view.name, view.save_id, view.algorithm
        self.manifest = view.manifest
        """The checkpoint's manifest given at the commit (None if the commit gave none)."""
        self.late = {f.name: base64.b64decode(f.data) for f in view.late}
        """The files its finalize steps wrote, given at the commit: path -> bytes."""
        self.ranks = {r.rank: r for r in view.ranks}
        self._maps: list[SegmentMapping] = []

    def files(self, rank: int) -> list[str]:
        return [f.name for f in self.ranks[rank].files]

    def read(self, rank: int, file: str) -> memoryview:
        """Rank ``rank``'s ``file``, a read-only view of the keeper's memory, after its size and
        checksum matched the rank's report; :class:`IntegrityError` naming the file and slot if
        not, or if its segment is gone."""
        stored, where = self._stored(rank, file)
        try:
            mapping = SegmentMapping(stored.segment, writable=False)
        except OSError as exc:
            raise IntegrityError(f"{where}: cannot be mapped ({exc})") from exc
        try:
            self._verify(mapping.view, stored, where)
        except BaseException:
            mapping.close()
            raise
        self._maps.append(mapping)
        return mapping.view[:]

    def link(self, rank: int, file: str, target: str) -> None:
        """Make ``target`` a hard link to rank ``rank``'s ``file`` in the keeper's memory (same
        tmpfs: no byte copied), after its size and checksum matched the rank's report;
        :class:`IntegrityError` as :meth:`read`, with nothing left at ``target``. Ask for the
        copy with ``newest(lend=True)``: the keeper then never reuses that memory."""
        stored, where = self._stored(rank, file)
        try:
            os.link(path_of(stored.segment), target)
        except FileNotFoundError as exc:
            raise IntegrityError(f"{where}: the segment is gone") from exc
        try:
            self._verify_file(target, stored, where)
        except BaseException:
            os.unlink(target)
            raise

    def _stored(self, rank: int, file: str) -> tuple[StoredFile, str]:
        stored = next((f for f in self.ranks[rank].files if f.name == file), None)
        where = f"{file} of rank {rank} in memory checkpoint {self.name} (save {self.save_id}"
        if stored is None:
            raise IntegrityError(f"{where}): no such file in the slot")
        return stored, f"{where}, segment {stored.segment})"

    def _verify_file(self, path: str, stored: StoredFile, where: str) -> None:
        """Hash ``path`` read in chunks into one buffer: on a loaded host, cheaper than mapping
        a large file (its page tables made, then torn down) only to hash it once."""
        from ..persist.checksum import new_hasher

        hasher, size = new_hasher(self.algorithm), 0
        buf = bytearray(min(_CHUNK, max(stored.size, 1)))
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                hasher.update(view[:n])
                size += n
        self._check(size, hasher.hexdigest(), stored, where)

    def _verify(self, data: memoryview, stored: StoredFile, where: str) -> None:
        from ..persist.checksum import new_hasher

        hasher = new_hasher(self.algorithm)
        hasher.update(data)
        self._check(len(data), hasher.hexdigest(), stored, where)

    def _check(self, size: int, digest: str, stored: StoredFile, where: str) -> None:
        if size != stored.size:
            raise IntegrityError(f"{where}: the segment has {size} bytes, the file {stored.size}")
        if digest != stored.checksum:
            raise IntegrityError(f"{where}: {self.algorithm} {digest} does not match the "
                                 f"{stored.checksum} its rank reported: corrupted")

    def close(self) -> None:
        """Unmap the segments (views from :meth:`read` must be released first)."""
        for mapping in self._maps:
            mapping.close()
        self._maps.clear()
