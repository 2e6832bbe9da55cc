"""Let megatron-core 0.16 run its CPU-capable paths on a CUDA-less machine (CI only).

Some megatron-core code calls ``torch.cuda`` unconditionally even when every tensor is on the
CPU: the global memory buffer and pipeline p2p shape exchange allocate on
``torch.cuda.current_device()``, the RNG tracker reads and writes CUDA RNG states, and
checkpoint finalization calls ``torch.cuda.synchronize()``. :func:`apply` redirects exactly those
calls, and only when no CUDA device is visible:

==============================================  =============================================
``torch.cuda.current_device()``                 ``"cpu"`` (so ``device=current_device()`` is CPU)
``torch.cuda.synchronize()``                    no-op (CPU ops are synchronous)
``torch.cuda.manual_seed`` / ``manual_seed_all`` no-op (seed every rank with ``torch.manual_seed``)
``torch.cuda.get_rng_state()``                  the CPU generator's state
``torch.cuda.set_rng_state()``                  no-op
megatron's ``_get/_set_cuda_rng_state``         the two rows above
``torch.cuda.device_count()``                   0
``Tensor.cuda()``                               the tensor itself (tied embeddings on PP>1)
``Tensor.type()`` (no argument)                 ``"torch.cuda.FloatTensor"``-style names, which
                                                the distributed optimizer checks params against
``torch.tensor/zeros/ones/empty/full(...,       the same on the CPU (optimizer flags, grad-norm
device="cuda")``                                scratch tensors)
==============================================  =============================================

``torch.cuda.is_available()`` is left False, so the checkpoint engine itself takes its CPU path
(no pinned memory, no copy stream). The shim is process-local: it must be applied in every rank
process (spawned workers do not inherit it). It changes nothing when CUDA is present.

``scripts/pretrain_gpt.py`` imports this module (by path) only when
``torch.cuda.is_available()`` is false, and the tests' Megatron ranks (by name, with ``tests/``
on the path); nothing in ``megatron_adapter`` depends on it (``megatron_adapter.mock_gpt``, the
script's loop, leaves it to its callers).
"""

from __future__ import annotations

import torch

_applied = False


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda"))


def _cpu_factory(factory):
    def factory_on_cpu(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    factory_on_cpu.__name__ = factory_on_cpu.__qualname__ = factory.__name__
    return factory_on_cpu


def apply() -> bool:
    """Patch ``torch.cuda`` as described above; idempotent. Returns True if patched."""
    global _applied
    if _applied or torch.cuda.is_available():
        return False

    # Distinct function objects per name: torch._dynamo maps each torch.cuda name to a rule by
    # object identity and rejects one object registered under two names with different rules.
    def _noop_factory():
        def _noop(*args, **kwargs):
            return None
        return _noop

    def _cpu_rng_state_factory():
        def _cpu_rng_state(device=None):
            return torch.get_rng_state()
        return _cpu_rng_state

    def _current_device():
        return "cpu"

    def _device_count():
        return 0

    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _noop_factory()
    torch.cuda.manual_seed = _noop_factory()
    torch.cuda.manual_seed_all = _noop_factory()
    cpu_rng_state = _cpu_rng_state_factory()
    torch.cuda.get_rng_state = cpu_rng_state
    torch.cuda.random.get_rng_state = cpu_rng_state
    set_rng_state = _noop_factory()
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.random.set_rng_state = set_rng_state
    torch.cuda.device_count = _device_count

    def _tensor_cuda(self, *args, **kwargs):
        return self

    torch.Tensor.cuda = _tensor_cuda

    orig_type = torch.Tensor.type

    def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = orig_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _tensor_type

    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, _cpu_factory(getattr(torch, name)))

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = \
        lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = _noop_factory()
    _applied = True
    return True
