"""What the one-rank Megatron workers share; import it first. A gloo group of one rank (port
from ``sys.argv[1]``), then what :mod:`_megatron_rank` sets up."""

import os
import sys

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
import _megatron_rank  # noqa: E402,F401
