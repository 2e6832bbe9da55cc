"""Start N local ranks of a Python script: ``python scripts/launch.py --nproc 2 SCRIPT ARGS...``.

The launcher itself is :mod:`deepspeed_async_ckpt.tools.launch`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
from deepspeed_async_ckpt.tools.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
