"""What the Megatron workers share; import it first. This rank joins a gloo group from the
environment (``scripts/launch.py`` sets it; :mod:`_one_megatron_rank` for one rank), with
``tests/`` on the path, the CPU shim applied, and megatron-core's model parallel state
initialized (TP = PP = 1)."""

import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "tests"))
from megatron_cpu_shim import apply as apply_cpu_shim  # noqa: E402

apply_cpu_shim()
from megatron.core import parallel_state  # noqa: E402

parallel_state.initialize_model_parallel(1, 1)
