"""How the package installs: what a source distribution carries."""

import shutil
import subprocess
import sys
import tarfile

from conftest import REPO  # noqa: E402


def test_sdist_carries_the_pth_hook_so_a_wheel_builds_from_it(tmp_path):
    """setup.py's build_py copies deepspeed_async_ckpt.pth, but nothing put it in the sdist:
    a wheel built from the sdist (`python -m build`, `pip install x.tar.gz`) failed with
    "can't copy '.../deepspeed_async_ckpt.pth': doesn't exist or not a regular file"."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist",
                                                            "*.egg-info", "__pycache__"))
    r = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                       cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (sdist,) = (tmp_path / "dist").iterdir()
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    assert any(n.endswith("/deepspeed_async_ckpt.pth") for n in names), names
