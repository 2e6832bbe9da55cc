"""Run a rank script as if on a node of its own: ``on_node.py NODE_DIR COMMON SCRIPT ARGS...``
makes this process a mount namespace of its own (as ``unshare -m``: mounts private) with
``NODE_DIR`` bound at ``COMMON``, as node-local disks are mounted at the same path on every node,
then runs ``SCRIPT`` with ``ARGS`` as ``python SCRIPT ARGS`` would (see ``tests/nodes.py``)."""

import ctypes
import os
import runpy
import sys

CLONE_NEWNS, MS_BIND, MS_REC, MS_PRIVATE = 0x00020000, 4096, 16384, 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def enter_node(node_dir: str, common: str) -> None:
    """A mount namespace of this process's own, ``node_dir`` bound at ``common`` in it."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    _check(_libc.mount(os.fsencode(node_dir), os.fsencode(common), None, MS_BIND, None),
           f"mount --bind {node_dir} {common}")


if __name__ == "__main__":
    node_dir, common, script, *args = sys.argv[1:]
    enter_node(node_dir, common)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
