"""Planning a save: :func:`plan_file` pickles a state object once, exactly as ``torch.save``
would, except that every tensor is replaced by a reference to a new, compact storage record.

That single pass, on the training thread, freezes all Python state (counters, configs,
scheduler state) at save time and lists the tensors to copy, in file order, as
:class:`~.item.TensorItem` s of a :class:`FilePlan`. A :class:`PlanCache` keeps a file's plan
from one save to the next: a steady-state save of an unchanged structure then makes little more
than its items (a training process whose saves allocate thousands of objects each meets the
cyclic GC's full collections sooner). :func:`tensor_ids` and :func:`storage_addresses` tell
the checkpointer which tensors may be copied lazily.
"""

from __future__ import annotations

import collections
import gc
import io
import pickle
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from ..errors import SnapshotError
from .item import TensorItem


#: Layouts whose tensors ``torch.save`` reduces into dense tensors, as nested ones (whose
#: layout is ``torch.strided``).
_SPARSE_LAYOUTS = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                             torch.sparse_bsc})
#: Layouts whose tensors have no storage to ask for: sparse ones, and torch.nested's jagged.
_STORAGELESS_LAYOUTS = _SPARSE_LAYOUTS | {torch.jagged}
_UNTYPED_DTYPES = torch.storage._new_dtypes()
_STORAGE_TYPES = {dtype: getattr(torch, name) for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


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


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _strided_span(t: torch.Tensor) -> int | None:
    """For a tensor that is not contiguous: how many storage elements its strides reach from its
    offset on, if it is worth recording those with its own strides rather than its values in
    order (as many or fewer elements): a transposed or ``channels_last`` tensor keeps its
    layout (``torch.save`` keeps it), an expanded one (stride 0) is not materialized (a
    4-byte ``ones(1).expand(4_000_000)`` would take 16 MB of staging and file). None for a view
    with gaps (a slice: its values alone are fewer), or one with the conjugate or negative
    bit (their values are resolved by the copy)."""
    if not t.numel() or t.is_conj() or t.is_neg():
        return None
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return span if span <= t.numel() else None


class _Replan(Exception):
    """A tensor did not match its cached record: plan the file afresh."""


class _Entry:
    """What one tensor position of a cached plan produced: the tensor's identity (``sig``:
    storage address, offset, shape, strides, dtype, device, conjugate and negative bits,
    requires_grad), its reduce value for the pickle, and its record (``index`` into the
    plan's items; ``new``: this position made the record, else it aliases an earlier one)."""

    __slots__ = ("sig", "reduced", "index", "new", "key", "nbytes", "span", "shape")

    def __init__(self, sig, reduced, index, new, key, nbytes, span, shape) -> None:
        self.sig, self.reduced, self.index, self.new = sig, reduced, index, new
        self.key, self.nbytes, self.span, self.shape = key, nbytes, span, shape


class _Planner(pickle.Pickler):
    """The pickler of :func:`plan_file`, kept from one save of a file to the next by a
    :class:`PlanCache`. While every tensor matches the record cached at its position, its
    reduce value (storage reference, shape, strides) is the cached one and only the save's
    :class:`TensorItem` is new; the first mismatch raises :class:`_Replan`."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        super().__init__(self._buf, protocol=2)
        self.entries: list[_Entry] = []
        self._reset(None, set(), "")

    def _reset(self, cached: list[_Entry] | None, lazy: set[int], what: str) -> None:
        self.cached = cached  # None: plan afresh, into self.entries
        self.lazy, self.what = lazy, what
        self.items: list[TensorItem] = []
        self.pos = 0
        self.by_view: dict[tuple, tuple[_StorageRef, TensorItem, int]] = {}
        self.strides: dict[tuple, tuple] = {}  # shape -> its contiguous stride (shapes repeat)
        self.lazy_parameter_data: dict[int, torch.Tensor] = {}  # id -> data of a lazy Parameter

    def plan(self, obj: Any, cached: list[_Entry] | None, lazy: set[int], what: str) -> FilePlan:
        self._reset(cached, lazy, what)
        if cached is None:
            self.entries = []
        try:
            self.dump(obj)
            if cached is not None and self.pos != len(cached):
                raise _Replan
            return FilePlan(pickle_bytes=self._buf.getvalue(), items=self.items)
        except BaseException:
            for item in self.items:  # never staged: nothing may wait for them
                item.cancel()
            raise
        finally:  # the save's objects are not kept beyond the plan (the memo holds them all)
            self.clear_memo()
            self._buf.seek(0)
            self._buf.truncate()
            self._reset(None, set(), "")

    def _item(self, t: torch.Tensor, key: str, nbytes: int, span: int | None, shape: tuple) -> TensorItem:
        src = t.detach() if span is None else t.detach().as_strided((span,), (1,), t.storage_offset())
        eager = id(t) not in self.lazy and id(t) not in self.lazy_parameter_data
        item = TensorItem(key, src, nbytes, eager, (self.what, shape, t.dtype))
        self.items.append(item)
        return item

    def _tensor_reduce(self, t: torch.Tensor) -> tuple:
        if t.layout != torch.strided or t.is_quantized:
            kind = "quantized" if t.is_quantized else str(t.layout)
            raise SnapshotError(f"{self.what}: cannot snapshot a {kind} tensor ({t.dtype}, "
                                f"{type(t).__name__}); only dense strided, sparse and nested "
                                "tensors are supported")
        ptr = t.untyped_storage().data_ptr()
        sig = (ptr, t.storage_offset(), t.shape, t.stride(), t.dtype, t.device, t.is_conj(), t.is_neg(),
               t.requires_grad)
        pos, self.pos = self.pos, self.pos + 1
        if self.cached is not None:
            if pos >= len(self.cached) or self.cached[pos].sig != sig:
                raise _Replan
            e = self.cached[pos]
            if e.new:
                self._item(t, e.key, e.nbytes, e.span, e.shape)
            else:
                item = self.items[e.index]
                item.eager = item.eager or (id(t) not in self.lazy and id(t) not in self.lazy_parameter_data)
            return e.reduced
        shape = tuple(t.shape)
        contiguous = self.strides.get(shape)
        if contiguous is None:
            contiguous = self.strides[shape] = _contiguous_stride(shape)
        span = None if t.stride() == contiguous else _strided_span(t)
        ref, index, new = self._storage_ref(t, ptr, span, shape)
        stride = contiguous if span is None else t.stride()
        hooks: collections.OrderedDict = collections.OrderedDict()
        if ref.storage_type is torch.UntypedStorage:
            reduced = (torch._utils._rebuild_tensor_v3, (ref, 0, shape, stride, t.requires_grad, hooks, t.dtype))
        else:
            reduced = (torch._utils._rebuild_tensor_v2, (ref, 0, shape, stride, t.requires_grad, hooks))
        self.entries.append(_Entry(sig, reduced, index, new, ref.key, self.items[index].nbytes, span, shape))
        return reduced

    def _storage_ref(self, t: torch.Tensor, ptr: int, span: int | None,
                     shape: tuple) -> tuple[_StorageRef, int, bool]:
        """The record of ``t``'s values: ``numel`` elements in ``t``'s logical order, or with
        ``span``, the ``span`` elements of its storage from its offset on (see
        :func:`_strided_span`), which ``t``'s own strides then index. Tensors that alias the
        same memory with the same view share one record. Returns it, its index among the
        plan's items, and whether ``t`` made it."""
        # a conjugate or negative view reads the same memory as other values: its own record
        view_key = (ptr, t.storage_offset(), t.shape, t.stride(), t.dtype, t.device,
                    t.is_conj(), t.is_neg()) if ptr else (id(t),)
        if view_key in self.by_view:
            ref, item, index = self.by_view[view_key]
            item.eager = item.eager or (id(t) not in self.lazy and id(t) not in self.lazy_parameter_data)
            return ref, index, False
        numel = t.numel() if span is None else span
        nbytes = numel * t.element_size()
        key = str(len(self.items))
        if t.dtype in _UNTYPED_DTYPES:
            ref = _StorageRef(key, torch.UntypedStorage, nbytes)
        elif t.dtype in _STORAGE_TYPES:
            ref = _StorageRef(key, _STORAGE_TYPES[t.dtype], numel)
        else:  # torch.save refuses these too (sub-byte integers: uint1-7, int1-7)
            raise SnapshotError(f"{self.what}: cannot snapshot a tensor of dtype {t.dtype} {tuple(t.shape)}: "
                                "torch.save has no storage type for it")
        index = len(self.items)
        item = self._item(t, key, nbytes, span, shape)
        self.by_view[view_key] = (ref, item, index)
        return ref, index, True

    def reducer_override(self, o: Any) -> Any:
        if not isinstance(o, torch.Tensor):  # first: Parameter's isinstance runs Python code
            return NotImplemented
        if isinstance(o, torch.nn.Parameter):
            # its data as a plain tensor sharing o's version counter (``o.data`` has one of
            # its own), copied lazily where o may be (held, so that its id stays its own)
            data = o.detach()
            if id(o) in self.lazy:
                self.lazy_parameter_data[id(data)] = data
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
                return self._tensor_reduce(o)
            # Python attributes (ZeRO-3 sets ds_id on its flat fp32 groups): kept, as
            # torch.save keeps them
            func, args = self._tensor_reduce(o)
            return (torch._tensor._rebuild_from_type_v2,
                    (func, torch.Tensor, args, torch._utils._get_obj_state(o)))
        if isinstance(o, torch.Tensor):
            if o.layout == torch.jagged:  # torch.nested's NestedTensor: reduced as above
                return o.__reduce_ex__(2)
            raise SnapshotError(f"{self.what}: cannot snapshot tensor subclass {type(o).__name__}")
        return NotImplemented

    def persistent_id(self, o: Any) -> Any:  # called for every object pickled
        if type(o) is _StorageRef:
            return ("storage", o.storage_type, o.key, "cpu", o.numel)
        return None


class PlanCache:
    """The plan of one file, kept from one save to the next, as torch DCP caches its save
    plans: while the state keeps its structure (the same tensors, by storage address,
    offset, shape, strides, dtype, device and requires_grad, in the same pickling order),
    a save re-pickles only its Python values and makes one :class:`TensorItem` per record,
    reusing every storage reference, shape and stride of the last plan. Any change (a tensor
    added, removed, reallocated, reshaped) plans the file afresh. The file's bytes are the
    same either way. One per file name, used by the training thread only."""

    def __init__(self) -> None:
        self._planner = _Planner()
        self._valid = False
        self.hits = 0
        """Saves planned from the cache (for tests and the benchmark)."""

    def plan(self, obj: Any, lazy_tensor_ids: set[int], what: str) -> FilePlan:
        if self._valid:
            try:
                plan = self._planner.plan(obj, self._planner.entries, lazy_tensor_ids, what)
                self.hits += 1
                return plan
            except _Replan:
                pass
        self._valid = False
        plan = self._planner.plan(obj, None, lazy_tensor_ids, what)
        self._valid = True
        return plan


def plan_file(obj: Any, lazy_tensor_ids: set[int], what: str, cache: PlanCache | None = None) -> FilePlan:
    """Pickle ``obj`` as ``torch.save`` would, with each tensor turned into a compact record.

    ``lazy_tensor_ids`` holds ``id()`` of tensors that may be copied lazily; every other tensor
    is marked eager. Tensors that alias the same memory with the same view share one record.
    ``cache``: the file's :class:`PlanCache`, to reuse the last save's plan of it.
    """
    # Planning allocates a few Python objects per tensor. With the cyclic GC on, those can tip
    # a full collection of the training process's heap into the save (170 ms, measured in a
    # DeepSpeed process with a 2 GB model); paused, the collection runs at its next turn.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if cache is None:
            return _Planner().plan(obj, None, lazy_tensor_ids, what)
        return cache.plan(obj, lazy_tensor_ids, what)
    finally:
        if gc_was_enabled:
            gc.enable()


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
