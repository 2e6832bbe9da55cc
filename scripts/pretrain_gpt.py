"""GPT pretraining with megatron-core on mock tokens, checkpointing through ``megatron_adapter``:
``torchrun --nproc_per_node 4 scripts/pretrain_gpt.py --train-iters 100 ... --async-ckpt``
(``--help`` lists the flags, Megatron-LM's names).

The loop itself is :mod:`megatron_adapter.mock_gpt`. Without CUDA (CI) this script first
applies ``tests/megatron_cpu_shim.py``, which redirects the few ``torch.cuda`` calls
megatron-core makes unconditionally.
"""

import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # this checkout's package, before an installed one

import torch  # noqa: E402

from megatron_adapter.mock_gpt import main  # noqa: E402

CPU_SHIM = os.path.join(REPO, "tests", "megatron_cpu_shim.py")


def apply_cpu_shim() -> None:
    """CPU-only CI: redirect megatron-core's unconditional torch.cuda calls (see the shim)."""
    if torch.cuda.is_available():
        return
    if not os.path.exists(CPU_SHIM):
        raise SystemExit(f"no CUDA device and no CPU shim at {CPU_SHIM}: run from a checkout")
    spec = importlib.util.spec_from_file_location("megatron_cpu_shim", CPU_SHIM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.apply()


if __name__ == "__main__":
    apply_cpu_shim()
    sys.exit(main())
