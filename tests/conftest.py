import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)  # helpers, fakes, _compare...: shared by tests/unit and tests/integration
sys.path.insert(0, REPO)

from helpers import held_copier  # noqa: E402,F401  (a fixture: every test may ask for it)
from deepspeed_async_ckpt.tools import warm_start  # noqa: E402

# Ranks started by scripts/launch.py (here and in the scripts the tests run) fork from an
# interpreter that imported these once, instead of each importing them again: a few CPU-seconds
# per rank, most of the suite's time on a small CPU host (deepspeed_async_ckpt.tools.warm_start).
# Not with NCCL: those ranks pick their accelerator at import. Set it empty to start ranks fresh.
if os.environ.get("ASYNC_CKPT_TEST_BACKEND", "gloo") == "gloo":
    os.environ.setdefault(warm_start.PRELOAD, "torch,deepspeed,megatron.core")


@pytest.fixture
def repo_env():
    """Environment for rank subprocesses: the working tree's code wins over any install."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["OMP_NUM_THREADS"] = "1"
    return env
