"""Bitwise comparison of nested checkpoint objects, naming the first differing path."""

import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() and t.element_size() else t


def assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor) and a.layout == torch.sparse_coo:  # as saved: not coalesced
        assert isinstance(b, torch.Tensor) and b.layout == a.layout, f"{path}: sparse vs {b!r}"
        assert a.is_coalesced() == b.is_coalesced(), f"{path}: coalesced differs"
        assert_same([a.shape, a._indices(), a._values()], [b.shape, b._indices(), b._values()], path)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b).__name__}"
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), \
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(_bits(a), _bits(b)), f"{path}: values differ"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys differ: {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif a == b:
        pass
    elif hasattr(a, "__dict__") and type(a) is type(b):  # e.g. a LossScaler without __eq__
        assert_same(vars(a), vars(b), f"{path}.__dict__")
    else:
        raise AssertionError(f"{path}: {a!r} vs {b!r}")
