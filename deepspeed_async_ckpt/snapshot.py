"""Stage 1 of 3: snapshot (device or host tensors -> a bounded, reused host buffer pool).

A save is first *planned* on the training thread: the state object is pickled once, exactly as
``torch.save`` would pickle it, except that every tensor is replaced by a reference to a new,
compact storage record. That single pass freezes all Python state (counters, configs, scheduler
state) at save time and lists the tensors to copy, in file order.

Tensors are then staged:

- *eager* items are copied before ``save`` returns (state the training loop may mutate at any
  time: client state, scalar step counters, scheduler tensors);
- *lazy* items (model and optimizer tensors, which only the optimizer step mutates) are copied
  by a background copier into buffers from :class:`HostBufferPool` while the next
  forward/backward runs. With CUDA the copies run on a dedicated copy stream into pinned
  buffers and complete through CUDA events. The training loop calls :meth:`Stager.fence`
  before the optimizer step; it blocks only while copies are outstanding, and copies
  tensors in host memory (all of them without CUDA) alongside the copier meanwhile.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import gc
import io
import logging
import mmap
import pickle
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .errors import SnapshotError, describe
from .storage import DIRECT_ALIGN, aligned_size, host_buffer  # every buffer starts on a page: O_DIRECT can write it


log = logging.getLogger(__name__)


def _page_lock(address: int, nbytes: int, device: int) -> None:
    """Page-lock host memory for asynchronous copies from CUDA device ``device``
    (``cudaHostRegister``, portable to every context); raises ``RuntimeError`` on failure."""
    with torch.cuda.device(device):  # a thread without a device would make a context on GPU 0
        _checked(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1))


def _page_unlock(address: int, device: int) -> None:
    with torch.cuda.device(device):
        _checked(torch.cuda.cudart().cudaHostUnregister(address))


def _checked(code: Any) -> None:
    """Raise for a failed CUDA runtime call, first clearing the error it left as this
    thread's last error: handled here (the pool falls back to torch's pinned allocator),
    it would otherwise be raised again by the next kernel launch on this thread, which
    torch checks with ``cudaGetLastError``."""
    if code != torch.cuda.cudart().cudaError.success:
        library = _cuda_runtime()
        if library is not None:
            library.cudaGetLastError()
        torch.cuda.check_error(code)


@functools.lru_cache(maxsize=None)
def _cuda_runtime() -> Any:
    """The CUDA runtime library torch loaded (``ctypes``), for ``cudaGetLastError``, which
    ``torch.cuda.cudart()`` does not offer; None where none is loaded as a shared library."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libcudart.so" in line})
    except OSError:
        return None
    for path in paths:
        try:
            return ctypes.CDLL(path)  # already loaded: the same library, the same error state
        except OSError:
            continue
    return None


class _Mapping(mmap.mmap):
    """A :func:`~.storage.host_buffer` mapping that ends its CUDA registration, if it has one,
    before it is unmapped.

    Memory unmapped while still registered leaves the driver's record of the address range
    behind, and pageable memory mapped there later (a plain ``tensor.cpu()`` after a pool was
    dropped) then fails to copy with "CUDA error: invalid argument" (seen on an H100 with torch
    2.11). The mapping lives as long as any tensor viewing it, so this runs only once nothing
    can copy into it any more.
    """

    registration: tuple[int, int] | None = None
    """(address, CUDA device) while registered."""

    def unregister(self) -> None:
        """End the registration, if any (once; raises ``RuntimeError`` if CUDA refuses)."""
        if self.registration is not None:
            (address, device), self.registration = self.registration, None
            _page_unlock(address, device)

    def __del__(self) -> None:
        try:
            self.unregister()
        except Exception:  # interpreter shutdown, or a driver already gone: nothing to keep
            pass


def _torch_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # starts on a page


class _Block:
    """One contiguous host allocation, carved into buffers in ring (FIFO) order.

    Records are staged in file order and written, then released, in the same order, so a ring
    reuses the block with no fragmentation: the oldest live buffer is the next to come back.
    Out-of-order releases (several writer threads) only delay the reuse of their space.

    The memory is always a :func:`~.storage.host_buffer` mapping (page-aligned, so O_DIRECT
    can write it; huge pages). With ``pin_device`` (a CUDA device index) it is page-locked in
    place with ``cudaHostRegister``, as torch's own DCP stager does, rather than taken from
    torch's pinned allocator, which rounds every block up to a power of two (a 5 GiB block
    would pin 8 GiB) and caches a freed block instead of unpinning it (so a replaced block
    would stay pinned beside its successor): the pool's bound would not bound pinned memory.
    """

    def __init__(self, nbytes: int, pin_device: int | None) -> None:
        self._mapping = host_buffer(nbytes, _Mapping)
        self.memory = torch.frombuffer(self._mapping, dtype=torch.uint8)
        if pin_device is not None:
            try:
                _page_lock(self.memory.data_ptr(), nbytes, pin_device)
                self._mapping.registration = (self.memory.data_ptr(), pin_device)
            except RuntimeError as exc:  # still pinned, as before, only less exactly
                log.warning("cudaHostRegister of %d bytes failed (%s); the staging block comes "
                            "from torch's pinned allocator instead (rounded up to a power of two)",
                            nbytes, exc)
                self.memory = _torch_pinned(nbytes)
                try:  # unused now: give back its address space and whatever the attempt faulted in
                    self._mapping.close()
                except BufferError:  # still viewed somewhere: it goes with its last view
                    pass
        self.size = nbytes
        self._live: collections.deque[list] = collections.deque()  # [start, end, released]
        self._head = 0  # where the next buffer starts

    @property
    def pinned_on(self) -> int | None:
        """The CUDA device the memory is registered with; None if not registered."""
        registration = self._mapping.registration
        return None if registration is None else registration[1]

    def free(self) -> None:
        """Unpin an idle block the pool drops at once (the mapping goes with its last
        reference; a block dropped otherwise, with its pool, is unpinned then)."""
        self._mapping.unregister()

    @property
    def idle(self) -> bool:
        return not self._live

    def carve(self, nbytes: int) -> tuple[int, list] | None:
        """Offset and bookkeeping entry of a free ``nbytes`` range, or None if none is free."""
        n = aligned_size(nbytes)
        if not self._live:
            start = 0 if n <= self.size else None
        else:
            tail = self._live[0][0]
            if self._head > tail:  # live range is [tail, head): free space on both sides
                start = self._head if self._head + n <= self.size else (0 if n <= tail else None)
            else:  # wrapped: free space is [head, tail)
                start = self._head if self._head + n <= tail else None
        if start is None:
            return None
        entry = [start, start + n, False]
        self._live.append(entry)
        self._head = start + n
        return start, entry

    def give_back(self, entry: list) -> None:
        entry[2] = True
        while self._live and self._live[0][2]:
            self._live.popleft()


class HostBufferPool:
    """A bounded host staging area, reused across saves.

    Memory is held in large blocks, allocated on demand, each as big as the bytes then queued
    for staging (a whole save is queued at once, so a save that fits the pool gets one block),
    and kept: from the second save of the same state on, nothing is allocated and no page is
    faulted in while training runs. :meth:`reserve` does the same for the first save, ahead of
    it, in a background thread. ``acquire`` blocks while the pool is full (backpressure).
    An idle block too small for a new buffer is freed and replaced. Pinned when ``pin`` is
    true (CUDA present), for copies from ``device`` (default: the current CUDA device), and
    pinned exactly: at most ``capacity_bytes`` are page-locked at any time (see :class:`_Block`).
    """

    def __init__(self, capacity_bytes: int, pin: bool, device: int | None = None) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.pin = pin
        # Blocks may be made on a background thread, whose CUDA device is not the trainer's.
        self._pin_device = (torch.cuda.current_device() if device is None else device) if pin else None
        self._cond = threading.Condition()
        self._blocks: list[_Block] = []
        self._live: dict[int, tuple[_Block, list]] = {}  # buffer data_ptr -> its block entry
        self.allocations = 0
        """Number of blocks ever allocated (stays flat once saves repeat)."""
        self.peak_bytes = 0
        """Largest number of bytes held in blocks at any time."""
        self._reserving = False  # a reserve() thread is allocating: acquire waits for its block
        self.reserve_error: BaseException | None = None
        """Why the last :meth:`reserve` failed, if it did (the first save then allocates)."""

    @property
    def held_bytes(self) -> int:
        return sum(b.size for b in self._blocks)

    def acquire(self, nbytes: int, what: str, expected_bytes: int = 0, *,
                wait: bool = True) -> torch.Tensor | None:
        """A uint8 tensor of exactly ``nbytes``; blocks until the pool has room, or returns
        None at once if it has none and ``wait`` is false.

        ``expected_bytes`` (the bytes queued for staging, this buffer included) sizes a new
        block when one is needed, so that the rest of the queue fits in it.
        """
        n = aligned_size(nbytes)
        if n > self.capacity_bytes:
            raise SnapshotError(
                f"{what} needs {n} bytes of host staging ({nbytes} rounded up to whole pages) but "
                f"host_buffer_gb allows only {self.capacity_bytes} bytes; raise "
                "async_checkpoint.host_buffer_gb")
        with self._cond:
            while True:
                while self._reserving:  # its block is about to arrive: allocate nothing twice
                    self._cond.wait()
                for block in self._blocks:
                    got = block.carve(n)
                    if got is not None:
                        start, entry = got
                        buf = block.memory[start:start + nbytes]
                        self._live[buf.data_ptr()] = (block, entry)
                        return buf
                # An idle block that could not take the buffer is too small for it: free it.
                for block in self._blocks:
                    if block.idle:
                        block.free()
                self._blocks = [b for b in self._blocks if not b.idle]
                room = self.capacity_bytes - self.held_bytes
                if room >= n:
                    self._add_block(_Block(min(room, max(n, aligned_size(expected_bytes))),
                                           self._pin_device))
                    continue
                if not wait:
                    return None
                self._cond.wait()

    def reserve(self, nbytes: int) -> threading.Thread | None:
        """Allocate one block for a save of about ``nbytes`` (at most the capacity) and fault
        its pages in, in a background thread, so the first save finds its memory ready.

        A first save otherwise faults its staging memory in while the copier fills it, and
        the fence before the next optimizer step waits for that (0.4 s/GB here, up to 3.6 s/GB
        when the hypervisor has taken the free memory back). Does nothing, and returns None,
        if the pool already holds memory or ``nbytes`` is 0; otherwise returns the thread.
        """
        n = min(aligned_size(nbytes), self.capacity_bytes // DIRECT_ALIGN * DIRECT_ALIGN)
        with self._cond:
            if n <= 0 or self._blocks or self._reserving:
                return None
            self._reserving = True
        thread = threading.Thread(target=self._fault_in, args=(n,), name="async-ckpt-reserve",
                                  daemon=True)
        try:
            thread.start()
        except BaseException as exc:  # "can't start new thread": no block will come
            with self._cond:
                self.reserve_error, self._reserving = exc, False
                self._cond.notify_all()
            raise
        return thread

    def _fault_in(self, nbytes: int) -> None:
        block = None
        try:
            block = _Block(nbytes, self._pin_device)  # pinning faults the pages in
            if not self.pin:
                block.memory[::DIRECT_ALIGN].zero_()  # one write per page; drops the GIL
        except BaseException as exc:  # e.g. out of memory: the first save allocates as before
            self.reserve_error, block = exc, None
        with self._cond:
            if block is not None:
                self._add_block(block)
            self._reserving = False
            self._cond.notify_all()

    def _add_block(self, block: _Block) -> None:  # with self._cond held
        self._blocks.append(block)
        self.allocations += 1
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            block, entry = self._live.pop(buf.data_ptr())
            block.give_back(entry)
            self._cond.notify_all()


def _version_of(t: torch.Tensor | None) -> int | None:
    """``t``'s version counter, which every in-place change moves; None where it has none (an
    inference-mode tensor)."""
    try:
        return None if t is None else t._version
    except RuntimeError:
        return None


def _storage_of(t: torch.Tensor | None) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of ``t``'s storage; None where it has none to ask."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


class _Job:
    """What a submit's items share when the caller names no save (weakly referenced)."""

    __slots__ = ("__weakref__",)


class TensorItem:
    """One storage record of a file: a source tensor and, once staged, its host copy.

    A save plans one per tensor on the training thread (hundreds per file), so it is kept
    light: slots, a lock as its "issued" latch rather than a ``threading.Event`` (a condition
    and a lock each), and its description formatted only when a message needs it.
    """

    __slots__ = ("key", "src", "nbytes", "eager", "_label", "host", "error", "_pool",
                 "_cuda_event", "_issued", "_latch", "_claimed", "_version", "_job", "_storage")

    def __init__(self, key: str, src: torch.Tensor | None, nbytes: int, eager: bool,
                 what: str | tuple = "") -> None:
        self.key, self.src, self.nbytes, self.eager = key, src, nbytes, eager
        self._version = _version_of(src)  # in-place changes before the copy are refused
        self._storage = _storage_of(src) if nbytes else None  # and a storage freed or resized
        self._label = what  # a string, or (file, shape, dtype) formatted by ``what``
        self.host: torch.Tensor | None = None
        self.error: BaseException | None = None
        self._pool: HostBufferPool | None = None
        self._cuda_event: Any = None
        self._issued = False
        self._latch = threading.Lock()  # held until the copy is issued; waiters pass through
        self._latch.acquire()
        self._claimed = False  # a thread took it to copy (the copier, or the fence helping)
        self._job: object = None  # the save's items submitted together (Stager.submit)

    @property
    def what(self) -> str:
        if isinstance(self._label, tuple):
            file, shape, dtype = self._label
            return f"{file}: tensor record {self.key} {tuple(shape)} {dtype}"
        return self._label

    def check_unchanged(self, src: torch.Tensor) -> None:
        """Raise if ``src`` was changed in place since the save planned it (its version
        counter moved): its copy would hold values of after the save, or a mix. Changes
        through ``.data``, which has a counter of its own, are not seen."""
        now = _version_of(src)
        if self._storage is not None and _storage_of(src) != self._storage:
            # resize_(0) (FSDP-style freeing) moves no version counter, and copying from the
            # freed memory crashed the process (a review, session 29)
            where = _storage_of(src)
            raise SnapshotError(
                f"its storage was freed, resized or replaced after the save and before its copy "
                f"(then {self._storage[1]} bytes, now {where[1] if where else 'none'}): the "
                "checkpoint would hold other memory. Code that frees or swaps storages outside "
                "the optimizer step must call deepspeed_async_ckpt.fence_all() first")
        if now != self._version:
            raise SnapshotError(
                f"changed in place after the save and before its copy (its version went from "
                f"{self._version} to {now}): the checkpoint would hold values "
                "of after the save. Code that changes weights or optimizer state outside the "
                "optimizer step must call deepspeed_async_ckpt.fence_all() first")

    def _set_issued(self) -> None:
        """The copy was issued (or failed, or will never happen)."""
        if not self._issued:
            self._issued = True
            self._latch.release()

    def _wait_issued(self) -> None:
        if not self._issued:
            with self._latch:
                pass

    def wait_copied(self) -> None:
        """Block until the host copy has finished or failed (never raises)."""
        self._wait_issued()
        if self._cuda_event is not None:
            self._cuda_event.synchronize()

    def wait_staged(self) -> torch.Tensor:
        """Block until the host copy is complete; returns it (flat uint8)."""
        self.wait_copied()
        if self.error is not None:
            raise SnapshotError(f"staging {self.what} failed: {describe(self.error)}") from self.error
        return self.host

    def cancel(self) -> None:
        """Mark an item that no copier will ever stage (the synchronous mode, after a failure)
        as done, so :meth:`release` does not wait for it. No effect once it was staged."""
        if not self._issued:
            self.src = None
            self._set_issued()

    def release(self) -> None:
        """Return the host buffer to the pool (after it was written, or on failure)."""
        self.wait_copied()
        if self._pool is not None and self.host is not None:
            self._pool.release(self.host)
        self.host = None
        self.src = None


@dataclass(eq=False)
class FilePlan:
    """What one file will contain: the pickled skeleton and its storage records, in order."""

    pickle_bytes: bytes
    items: list[TensorItem]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


class _StorageRef:
    __slots__ = ("key", "storage_type", "numel")

    def __init__(self, key: str, storage_type: Any, numel: int) -> None:
        self.key, self.storage_type, self.numel = key, storage_type, numel


def _strided_span(t: torch.Tensor) -> int | None:
    """For a tensor that is not contiguous: how many storage elements its strides reach from its
    offset on, if it is worth recording those with its own strides rather than its values in
    order (as many or fewer elements): a transposed or ``channels_last`` tensor keeps its
    layout (``torch.save`` keeps it), an expanded one (stride 0) is not materialized (a
    4-byte ``ones(1).expand(4_000_000)`` took 16 MB of staging and file). None for a view
    with gaps (a slice: its values alone are fewer), or one with the conjugate or negative
    bit (their values are resolved by the copy)."""
    if not t.numel() or t.is_conj() or t.is_neg():
        return None
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return span if span <= t.numel() else None


def plan_file(obj: Any, lazy_tensor_ids: set[int], what: str) -> FilePlan:
    """Pickle ``obj`` as ``torch.save`` would, with each tensor turned into a compact record.

    ``lazy_tensor_ids`` holds ``id()`` of tensors that may be copied lazily; every other tensor
    is marked eager. Tensors that alias the same memory with the same view share one record.
    """
    items: list[TensorItem] = []
    by_view: dict[tuple, tuple[_StorageRef, TensorItem]] = {}

    untyped_dtypes = torch.storage._new_dtypes()
    storage_types = {dtype: getattr(torch, name)
                     for dtype, name in torch.storage._dtype_to_storage_type_map().items()}
    strides: dict[tuple, tuple] = {}  # shape -> its contiguous stride (shapes repeat: m, v, w)
    lazy_parameter_data: dict[int, torch.Tensor] = {}  # id -> the data of a lazy nn.Parameter

    def storage_ref(t: torch.Tensor, span: int | None) -> _StorageRef:
        """The record of ``t``'s values: ``numel`` elements in ``t``'s logical order, or with
        ``span``, the ``span`` elements of its storage from its offset on (see
        :func:`_strided_span`), which ``t``'s own strides then index."""
        ptr = t.untyped_storage().data_ptr()
        # a conjugate or negative view reads the same memory as other values: its own record
        view_key = (ptr, t.storage_offset(), t.shape, t.stride(), t.dtype, t.device,
                    t.is_conj(), t.is_neg()) if ptr else (id(t),)
        eager = id(t) not in lazy_tensor_ids and id(t) not in lazy_parameter_data
        if view_key in by_view:
            ref, item = by_view[view_key]
            item.eager = item.eager or eager
            return ref
        numel = t.numel() if span is None else span
        nbytes = numel * t.element_size()
        key = str(len(items))
        if t.dtype in untyped_dtypes:
            ref = _StorageRef(key, torch.UntypedStorage, nbytes)
        elif t.dtype in storage_types:
            ref = _StorageRef(key, storage_types[t.dtype], numel)
        else:  # torch.save refuses these too (sub-byte integers: uint1-7, int1-7)
            raise SnapshotError(f"{what}: cannot snapshot a tensor of dtype {t.dtype} {tuple(t.shape)}: "
                                "torch.save has no storage type for it")
        src = t.detach() if span is None else t.detach().as_strided((span,), (1,), t.storage_offset())
        item = TensorItem(key, src, nbytes, eager, (what, t.shape, t.dtype))
        items.append(item)
        by_view[view_key] = (ref, item)
        return ref

    def tensor_reduce(t: torch.Tensor) -> tuple:
        if t.layout != torch.strided or t.is_quantized:
            kind = "quantized" if t.is_quantized else str(t.layout)
            raise SnapshotError(f"{what}: cannot snapshot a {kind} tensor ({t.dtype}, "
                                f"{type(t).__name__}); only dense strided, sparse and nested "
                                "tensors are supported")
        shape = tuple(t.shape)
        contiguous = strides.get(shape)
        if contiguous is None:
            contiguous = strides[shape] = _contiguous_stride(shape)
        span = None if t.stride() == contiguous else _strided_span(t)
        ref = storage_ref(t, span)
        stride = contiguous if span is None else t.stride()
        hooks: collections.OrderedDict = collections.OrderedDict()
        if ref.storage_type is torch.UntypedStorage:
            return (torch._utils._rebuild_tensor_v3,
                    (ref, 0, shape, stride, t.requires_grad, hooks, t.dtype))
        return (torch._utils._rebuild_tensor_v2,
                (ref, 0, shape, stride, t.requires_grad, hooks))

    class _Pickler(pickle.Pickler):
        def reducer_override(self, o: Any) -> Any:
            if not isinstance(o, torch.Tensor):  # first: Parameter's isinstance runs Python code
                return NotImplemented
            if isinstance(o, torch.nn.Parameter):
                # its data as a plain tensor sharing o's version counter (``o.data`` has one of
                # its own), copied lazily where o may be (held, so that its id stays its own)
                data = o.detach()
                if id(o) in lazy_tensor_ids:
                    lazy_parameter_data[id(data)] = data
                state = torch._utils._get_obj_state(o)
                hooks: collections.OrderedDict = collections.OrderedDict()
                if state:
                    return (torch._utils._rebuild_parameter_with_state,
                            (data, o.requires_grad, hooks, state))
                return (torch._utils._rebuild_parameter, (data, o.requires_grad, hooks))
            if type(o) is torch.Tensor:
                if o.layout in _SPARSE_LAYOUTS or o.is_nested:
                    # as torch.save reduces them: into dense tensors (indices, values, sizes),
                    # pickled here in turn, each its own record; not the caller's tensors, so
                    # copied now, never lazily
                    return o.__reduce_ex__(2)
                if not o.__dict__:
                    return tensor_reduce(o)
                # Python attributes (ZeRO-3 sets ds_id on its flat fp32 groups): kept, as
                # torch.save keeps them
                func, args = tensor_reduce(o)
                return (torch._tensor._rebuild_from_type_v2,
                        (func, torch.Tensor, args, torch._utils._get_obj_state(o)))
            if isinstance(o, torch.Tensor):
                if o.layout == torch.jagged:  # torch.nested's NestedTensor: reduced as above
                    return o.__reduce_ex__(2)
                raise SnapshotError(f"{what}: cannot snapshot tensor subclass {type(o).__name__}")
            return NotImplemented

        def persistent_id(self, o: Any) -> Any:  # called for every object pickled
            if type(o) is _StorageRef:
                return ("storage", o.storage_type, o.key, "cpu", o.numel)
            return None

    buf = io.BytesIO()
    # Planning allocates a few Python objects per tensor. With the cyclic GC on, those can tip
    # a full collection of the training process's heap into the save (170 ms, measured in a
    # DeepSpeed process with a 2 GB model); paused, the collection runs at its next turn.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        _Pickler(buf, protocol=2).dump(obj)
    finally:
        if gc_was_enabled:
            gc.enable()
    return FilePlan(pickle_bytes=buf.getvalue(), items=items)


#: Layouts whose tensors ``torch.save`` reduces into dense tensors, as nested ones (whose
#: layout is ``torch.strided``).
_SPARSE_LAYOUTS = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                             torch.sparse_bsc})
#: Layouts whose tensors have no storage to ask for: sparse ones, and torch.nested's jagged.
_STORAGELESS_LAYOUTS = _SPARSE_LAYOUTS | {torch.jagged}


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def tensor_ids(obj: Any, *, except_storages: set[int] = frozenset()) -> set[int]:
    """``id()`` of every tensor reachable through dicts, lists and tuples of ``obj``, except
    tensors whose memory is in ``except_storages`` (storage addresses, see
    :func:`storage_addresses`)."""
    found: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.layout in _STORAGELESS_LAYOUTS:
                continue  # its parts are copied at once anyway
            if not except_storages or o.untyped_storage().data_ptr() not in except_storages:
                found.add(id(o))
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return found


def storage_addresses(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The addresses of the storages behind ``tensors`` (any view of one has the same)."""
    return {p for t in tensors if t.layout not in _STORAGELESS_LAYOUTS and (p := t.untyped_storage().data_ptr())}


def _on_host(item: TensorItem) -> bool:
    """Whether ``item`` is still to be copied from host memory (a CPU copy, which the fence
    can help with), not from a CUDA device."""
    return item.src is not None and not item.src.is_cuda


class Stager:
    """Copies tensor items to host. One background copier thread serves lazy items in FIFO
    order; eager items and the synchronous mode call :meth:`stage` inline; a fence that would
    block copies items in host memory from the back of the queue (:meth:`fence`)."""

    def __init__(self, pool: HostBufferPool, use_cuda: bool) -> None:
        self.pool = pool
        self.use_cuda = use_cuda
        self._copy_stream = torch.cuda.Stream() if use_cuda else None
        self._queue: queue.SimpleQueue[tuple[list[TensorItem], Any] | None] = queue.SimpleQueue()
        self._pending: collections.deque[TensorItem] = collections.deque()
        self._failed_jobs: weakref.WeakSet = weakref.WeakSet()
        """Jobs (saves) whose staging error a fence raised: raised once, the rest dropped."""
        self._lock = threading.Lock()
        self._queued_bytes = 0  # pool bytes submitted and not yet acquired: sizes new blocks
        self.staged_bytes = 0
        """Bytes copied to host by this rank since start (pool and eager)."""
        self.pooled_bytes = 0
        """Pool bytes those copies took (whole pages per record), since start: what a save
        needs from the pool, for sizing ``host_buffer_gb`` and :meth:`HostBufferPool.reserve`."""
        self.fence_copied_bytes = 0
        """Bytes the training thread copied itself while blocked at the fence, since start."""
        self._helpable: collections.deque[TensorItem] = collections.deque()
        """Items of the copier's current job that have their buffers: the fence takes from
        the back."""
        self._jobs = [0, 0]  # jobs submitted, and jobs whose buffers the copier has taken
        self._prepared = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="async-ckpt-copier", daemon=True)
        self._thread.start()

    def ready_event(self) -> Any:
        """With CUDA, an event recorded on the current (training) stream: copies on the copy
        stream wait for it, so they see the values as of now, with every kernel queued before
        it done, not as of when the copy stream gets to them. None without CUDA."""
        if not self.use_cuda:
            return None
        ready = torch.cuda.Event()
        ready.record()
        return ready

    def submit(self, items: Iterable[TensorItem], job: Any = None) -> None:
        """Queue lazy items for the background copier (called on the training thread).
        ``job``: what they belong to (a save, which may submit several times; its own by
        default): once a fence raised a staging error of a job, its other items are dropped,
        and those submitted later fail at once, uncopied (the save is failed already)."""
        ready = self.ready_event()
        items, job = list(items), _Job() if job is None else job
        with self._lock:
            failed = job in self._failed_jobs
        if failed:
            for item in items:
                item.error = SnapshotError("not copied: an earlier record of its save failed to stage")
                item.src = None
                item._set_issued()
            return
        for item in items:
            item._job = job
        with self._lock:
            self._pending.extend(items)
            self._queued_bytes += sum(aligned_size(item.nbytes) for item in items)
            self._jobs[0] += 1
        self._queue.put((items, ready))  # one wake-up of the copier, after the lock is free

    def stage_eager(self, items: Iterable[TensorItem]) -> None:
        """Copy items now, outside the pool (small state the loop may mutate at any time)."""
        for item in items:
            src = item.src
            try:
                item.host = src.detach().to("cpu", copy=True).contiguous().view(-1).view(torch.uint8) \
                    if item.nbytes else torch.empty(0, dtype=torch.uint8)
            except Exception as exc:  # named as the copier's failures are
                raise SnapshotError(f"staging {item.what} failed: {describe(exc)}") from exc
            item.src = None
            self._count(item.nbytes)
            item._set_issued()

    def stage(self, item: TensorItem, ready: Any = None, expected_bytes: int = 0) -> None:
        """Copy one item into a pool buffer; with CUDA the copy is only issued here.

        ``expected_bytes`` sizes a new pool block when one is needed (the synchronous mode
        passes its largest record); queued background items are counted automatically.
        """
        if self._acquire(item, expected_bytes, wait=True):
            self._copy(item, ready)

    def _acquire(self, item: TensorItem, expected_bytes: int = 0, *, wait: bool) -> bool:
        """Give ``item`` its pool buffer, unless it has one. Returns False, having taken
        nothing, if ``wait`` is false and the pool has no room now. A failure (a tensor larger
        than the pool) is recorded on the item, which then counts as issued."""
        if item.host is not None or item._issued:
            return True
        try:
            if item.nbytes:
                with self._lock:
                    expected = max(expected_bytes, self._queued_bytes)
                buf = self.pool.acquire(item.nbytes, item.what, expected, wait=wait)
                if buf is None:
                    return False
                item._pool = self.pool
            else:
                buf = torch.empty(0, dtype=torch.uint8)
            item.host = buf
        except BaseException as exc:  # surfaced by wait_staged / fence
            item.error = exc
            item.src = None
            item._set_issued()
            if not isinstance(exc, Exception):  # Ctrl-C on the training thread: still Ctrl-C
                raise
        return True

    def _copy(self, item: TensorItem, ready: Any = None) -> None:
        """Copy ``item``'s source into its buffer (with CUDA: issue the copy on the copy
        stream), then mark it issued."""
        try:
            if item._issued:  # its buffer could not be had: the error is on the item
                return
            src = item.src
            if item.nbytes:
                item.check_unchanged(src)
                dst = item.host.view(src.dtype).view(src.shape)
                if src.is_cuda and self._copy_stream is not None:
                    with torch.cuda.stream(self._copy_stream):
                        if ready is not None:
                            self._copy_stream.wait_event(ready)
                        dst.copy_(src, non_blocking=True)
                        src.record_stream(self._copy_stream)
                        event = torch.cuda.Event()
                        event.record(self._copy_stream)
                    item._cuda_event = event
                else:
                    dst.copy_(src)
                    item.check_unchanged(src)  # not even while it was being copied
            self._count(item.nbytes, pooled=aligned_size(item.nbytes))
        except BaseException as exc:  # surfaced by wait_staged / fence
            item.error = exc
            if not isinstance(exc, Exception):  # Ctrl-C on the training thread: still Ctrl-C
                raise
        finally:
            item.src = None
            item._set_issued()

    def fence(self) -> None:
        """Block until every queued copy is issued; with CUDA, make the current stream wait for
        the copies instead of blocking the host. Called before the optimizer step.

        Where sources are in host memory (no CUDA, or ZeRO-Offload's optimizer state beside
        CUDA weights), a training thread that would block here copies too: it takes such
        items from the back of the queue that already have their buffers (the copier takes a
        buffer for every item it can when such a save arrives) while the copier works from
        the front, so a copy that outlasts forward and backward finishes with two threads
        copying."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                item = self._pending[0]
            if not item._issued and self._copy_one_from_the_back():
                continue
            item._wait_issued()
            with self._lock:  # done with it, failed or not: an error is raised once
                if self._pending and self._pending[0] is item:
                    self._pending.popleft()
                if item.error is not None:  # and once per save: the rest of it failed with it
                    self._pending = collections.deque(i for i in self._pending if i._job is not item._job)
                    self._failed_jobs.add(item._job)
            if item.error is not None:
                raise SnapshotError(f"staging {item.what} failed: {describe(item.error)}") from item.error
            if item._cuda_event is not None:
                torch.cuda.current_stream().wait_event(item._cuda_event)

    def forget_issued(self) -> None:
        """Drop the queued items already copied or failed, once their saves are over (the
        checkpointer's ``wait``): a loop that never fences does not keep them for good, and a
        later fence does not raise again a staging error the save's failure reported."""
        with self._lock:
            self._pending = collections.deque(item for item in self._pending if not item._issued)

    def _copy_one_from_the_back(self) -> bool:
        """Copy the last queued item from host memory that has its buffer and that no thread
        has taken; False if there is none (a save of CUDA tensors has none: the fence does not
        block the host there)."""
        claimed = None
        try:
            with self._lock:
                while self._jobs[1] < self._jobs[0]:  # the copier is taking buffers: in a moment
                    self._prepared.wait()
                while self._helpable:
                    item = self._helpable.pop()
                    if not item._claimed and not item._issued:
                        item._claimed, claimed = True, item
                        break
                else:
                    return False
            self._copy(claimed)
        except BaseException as exc:
            # Cut short (Ctrl-C) between the claim and _copy's own handling: the copier skips a
            # claimed item, so it must end issued here, failed, or its writer and the next
            # fence wait for it for good.
            if claimed is not None and not claimed._issued:
                claimed.error = claimed.error or exc
                claimed.src = None
                claimed._set_issued()
            raise
        self.fence_copied_bytes += claimed.nbytes
        return True

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _count(self, n: int, pooled: int = 0) -> None:
        with self._lock:
            self.staged_bytes += n
            self.pooled_bytes += pooled

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            items, ready = job
            if any(_on_host(item) for item in items):  # every buffer now: the fence can copy too
                for item in items:
                    if not self._acquire(item, wait=False):
                        break
                    if _on_host(item):  # (a CUDA source's copy is the copy stream's DMA)
                        with self._lock:
                            self._helpable.append(item)
            with self._lock:
                self._jobs[1] += 1
                self._prepared.notify_all()
            for item in items:
                with self._lock:
                    mine, item._claimed = not item._claimed, True
                if mine:
                    self.stage(item, ready)
                with self._lock:
                    self._queued_bytes -= aligned_size(item.nbytes)
            with self._lock:
                self._helpable.clear()  # all taken by now
