"""AsyncCheckpointer end to end in one process: files that load as ``torch.save``'s
would, for every kind of tensor ``torch.save`` stores, and sync == async bytes."""

import os

import pytest
import torch

from deepspeed_async_ckpt.commit import Pointer, verify_checkpoint
from deepspeed_async_ckpt.errors import SnapshotError

from _compare import assert_same

from helpers import make, sample_state, save_one


def test_round_trip_matches_torch_save_and_loads_weights_only(tmp_path):
    state = sample_state()
    ck = make()
    save_one(ck, str(tmp_path), state)
    ck.fence()
    ck.wait()
    ours = torch.load(tmp_path / "t1" / "model.pt", weights_only=True)
    torch.save(state, tmp_path / "ref.pt")
    assert_same(ours, torch.load(tmp_path / "ref.pt", weights_only=True))
    # aliasing survives: one record, two tensors over it
    assert ours["module"]["w"].untyped_storage().data_ptr() == ours["module"]["tied"].untyped_storage().data_ptr()
    assert (tmp_path / "latest").read_text() == "t1"
    verify_checkpoint(str(tmp_path / "t1"))
    ck.close()


def test_conjugate_and_negative_views_and_tensor_attributes_load_as_torch_saves_them(tmp_path):
    """``c`` and ``c.conj()`` share memory but not values: each gets its own record (they shared
    one, so both loaded as ``c``). A tensor's Python attributes (ZeRO-3's ``ds_id`` on its flat
    fp32 groups) are kept, as ``torch.save`` keeps them (they were dropped)."""
    c = torch.tensor([1 + 2j, 3 - 4j])
    x = torch.tensor([1.0, 3.0])
    flat = torch.arange(6.0)
    flat.ds_id = "0_3"
    state = {"c": c, "c_conj": c.conj(), "x": x, "x_neg": torch._neg_view(x), "flat": [flat]}
    for mode in ("async", "sync"):
        ck = make(mode)
        save_one(ck, str(tmp_path / mode), state, eager=())
        ck.fence()
        ck.wait()
        ck.close()
        ours = torch.load(tmp_path / mode / "t1" / "model.pt", weights_only=True)
        assert_same({k: v.resolve_conj().resolve_neg() for k, v in ours.items() if k != "flat"},
                    {k: v.resolve_conj().resolve_neg() for k, v in state.items() if k != "flat"})
        assert torch.equal(ours["c_conj"], torch.tensor([1 - 2j, 3 + 4j]))
        assert torch.equal(ours["x_neg"], torch.tensor([-1.0, -3.0]))
        assert torch.equal(ours["flat"][0], flat) and vars(ours["flat"][0]) == {"ds_id": "0_3"}


def test_sync_and_async_modes_write_identical_files(tmp_path):
    state = sample_state()
    for mode in ("async", "sync"):
        ck = make(mode)
        save_one(ck, str(tmp_path / mode), state)
        ck.close()
    a = (tmp_path / "async" / "t1" / "model.pt").read_bytes()
    assert a == (tmp_path / "sync" / "t1" / "model.pt").read_bytes()


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("eager", [False, True])
def test_strided_tensors_keep_their_layout_and_an_expanded_one_is_not_materialized(tmp_path, mode, eager):
    """Records held a tensor's values in order, pickled with contiguous strides: a transposed
    or ``channels_last`` tensor loaded contiguous (``torch.save`` keeps the layout), and
    ``ones(1).expand(4_000_000)`` took 16 MB of staging and file for 4 bytes (``torch.save``:
    1.5 kB), failing a save with a small pool. Such tensors are now
    recorded as the storage their strides reach, with those strides; a slice with gaps keeps
    its values alone (fewer bytes than its storage)."""
    base = torch.arange(24, dtype=torch.float32)
    state = {
        "mask": torch.ones(1).expand(4_000_000),
        "rows": torch.arange(3.0).view(3, 1).expand(3, 5),
        "t": torch.randn(4, 6).t(),
        "cl": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "overlap": base.as_strided((4, 3), (2, 1), 1),  # windows overlapping by one element
        "gaps": base[::2],  # values alone: 12 elements, not the 23 its storage span holds
        "both": [base.view(4, 6).t(), base],  # one storage, two records
    }
    ck = make(mode, gb=2**-8)  # 4 MiB: the expanded tensor's 16 MB did not fit
    d = str(tmp_path / "t")
    ck.begin(d, tag="t")
    ck.save(state, os.path.join(d, "m.pt"), eager_keys=tuple(state) if eager else ())
    ck.end()
    ck.fence()
    ck.wait()
    ck.close()
    ours = torch.load(os.path.join(d, "m.pt"))
    assert_same(ours, state)
    torch.save(state, tmp_path / "theirs.pt")
    theirs = torch.load(tmp_path / "theirs.pt")
    for key in ("mask", "rows", "t", "cl", "overlap"):
        assert ours[key].stride() == theirs[key].stride() == state[key].stride(), key
    assert ours["gaps"].stride() == (1,) and ours["gaps"].untyped_storage().nbytes() == 12 * 4
    assert ours["cl"].is_contiguous(memory_format=torch.channels_last)
    assert ours["mask"].untyped_storage().nbytes() == 4
    assert os.path.getsize(os.path.join(d, "m.pt")) < 100_000


@pytest.mark.skipif(not hasattr(torch, "uint1"), reason="this torch has no sub-byte integer dtypes")
def test_a_tensor_of_a_dtype_torch_save_cannot_store_is_refused_by_name(tmp_path):
    """``torch.uint1`` .. ``int7`` raised a bare ``KeyError: torch.uint1`` from save()."""
    ck = make()
    ck.begin(str(tmp_path / "t"), tag="t")
    with pytest.raises(SnapshotError, match=r"m.pt.*dtype torch.uint1"):
        ck.save({"x": torch.empty(8, dtype=torch.uint1)}, str(tmp_path / "t" / "m.pt"))
    ck.end(commit=False)
    ck.close()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated")
def test_a_quantized_tensor_is_refused_by_name(tmp_path):
    """A quantized tensor's layout is ``torch.strided``: the message said "cannot snapshot a
    torch.strided tensor", which only dense strided tensors are supposed to be."""
    t = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    ck = make()
    ck.begin(str(tmp_path / "t"), tag="t")
    with pytest.raises(SnapshotError, match="model.pt: cannot snapshot a quantized tensor"):
        ck.save({"x": t}, str(tmp_path / "t" / "model.pt"))
    ck.end(commit=False)
    ck.close()


def _sparse_and_nested():
    coo = torch.sparse_coo_tensor([[0, 2, 0], [1, 0, 1]], torch.tensor([1.0, 2.0, 3.0]), (3, 2))
    return {
        "coo": coo,  # uncoalesced: saved as it is, as torch.save does
        "coalesced": torch.eye(5).to_sparse(),
        "csr": torch.arange(12.0).reshape(3, 4).relu().to_sparse_csr(),
        "csc": torch.eye(4, dtype=torch.bfloat16).to_sparse_csc(),
        "bsr": torch.eye(4).to_sparse_bsr((2, 2)),
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)]),
        "jagged": torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)], layout=torch.jagged),
        "param": torch.nn.Parameter(torch.eye(3).to_sparse(), requires_grad=False),
    }


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sparse_and_nested_tensors_are_saved_as_torch_save_saves_them(tmp_path, mode):
    """DeepSpeed's own engine saves sparse and nested tensors (a ``client_state`` mask, say)
    with ``torch.save``; this engine refused them with ``SnapshotError``, so switching engines
    broke such a save. They are now reduced as ``torch.save`` reduces them, into dense
    tensors (indices, values, sizes), each a record copied when ``save`` is called: changed
    afterwards, the file still holds the values of the save. Loaded with ``weights_only``."""
    state = {"client": _sparse_and_nested(), "module": {"w": torch.ones(8)}}
    expected = _sparse_and_nested()
    ck = make(mode)
    d = tmp_path / "t"
    ck.begin(str(d), tag="t", pointer=Pointer(str(tmp_path / "latest"), "t"))
    ck.save(state, str(d / "model.pt"), eager_keys=())  # not even in the eager keys
    state["client"]["coo"]._values().mul_(100)  # after the save: not in the file
    state["client"]["nested"].values().mul_(100)
    state["client"]["jagged"].values().mul_(100)
    state["client"]["csr"].values().mul_(100)
    ck.end()
    ck.close()
    verify_checkpoint(str(d))
    got = torch.load(d / "model.pt", weights_only=True)
    for name, want in expected.items():
        have = got["client"][name]
        assert type(have) is type(want) and have.layout == want.layout, name
        if want.is_nested:
            assert all(torch.equal(a, b) for a, b in zip(have.unbind(), want.unbind())), name
            continue
        assert have.dtype == want.dtype and torch.equal(have.to_dense(), want.to_dense()), name
    assert got["client"]["coo"].is_coalesced() is False
    assert torch.equal(got["client"]["coo"]._indices(), expected["coo"]._indices())
    assert torch.equal(got["module"]["w"], torch.ones(8))
    # among the tensors named eager (what the Megatron adapter passes), where their storage
    # was asked for: NotImplementedError("Cannot access storage of SparseTensorImpl")
    ck = make(mode)
    state = _sparse_and_nested()
    ck.begin(str(tmp_path / "e"), tag="e")
    ck.save(state, str(tmp_path / "e" / "model.pt"), eager_tensors=list(state.values()))
    ck.save_packed(str(tmp_path / "e" / "packed.distcp"), [("a", state)], eager_tensors=[state["coo"]])
    ck.end()
    ck.close()
    got = torch.load(tmp_path / "e" / "model.pt", weights_only=True)
    assert all(torch.equal(got[k].to_dense(), v.to_dense()) for k, v in expected.items() if not v.is_nested)
