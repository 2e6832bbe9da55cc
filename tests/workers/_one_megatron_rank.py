"""What the one-rank Megatron workers share; import it first. A gloo group of one rank (port
from ``sys.argv[1]``), ``tests/`` on the path, the CPU shim applied, and megatron-core's model
parallel state initialized (TP = PP = 1)."""

import os
import sys

import torch.distributed as dist

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests"))
from megatron_cpu_shim import apply as apply_cpu_shim  # noqa: E402

apply_cpu_shim()
from megatron.core import parallel_state  # noqa: E402

parallel_state.initialize_model_parallel(1, 1)
