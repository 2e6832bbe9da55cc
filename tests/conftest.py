import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)  # helpers, fakes, _compare...: shared by tests/unit and tests/integration
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

from helpers import held_copier  # noqa: E402,F401  (a fixture: every test may ask for it)


@pytest.fixture
def repo_env():
    """Environment for rank subprocesses: the working tree's code wins over any install."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["OMP_NUM_THREADS"] = "1"
    return env
