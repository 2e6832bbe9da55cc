"""Helpers for the memory tier's load tests: a committed checkpoint on disk copied into its
save directory's keeper (:func:`deepspeed_async_ckpt.bench.one_rank.fill_keeper`), a byte of it
corrupted, the keepers of a save directory found and killed, the restore directories counted."""

import os
import signal
import time

from deepspeed_async_ckpt.bench import one_rank
from deepspeed_async_ckpt.memory import segment
from deepspeed_async_ckpt.memory.address import SHM_DIR, KeeperAddress
from deepspeed_async_ckpt.memory.client import KeeperClient
from deepspeed_async_ckpt.memory.config import MemoryConfig
from deepspeed_async_ckpt.memory.restore import RESTORE_PREFIX

CONFIG = MemoryConfig(enabled=True, keep_last=2, idle_timeout_s=120)


def fill_keeper(save_dir: str, ckpt_dir: str, ranks=(0,), config: MemoryConfig = CONFIG,
                late=()) -> KeeperClient:
    """:func:`deepspeed_async_ckpt.bench.one_rank.fill_keeper` with the tests' keeper settings."""
    return one_rank.fill_keeper(save_dir, ckpt_dir, config, ranks=ranks, late=late)


def corrupt_in_memory(client: KeeperClient, rel: str) -> None:
    """Flip one byte of ``rel`` in the keeper's newest slot, in its segment in /dev/shm."""
    copy = client.newest()
    for part in copy.ranks.values():
        for f in part.files:
            if f.name == rel:
                os.chmod(segment.path_of(f.segment), 0o600)  # the keeper made it read-only
                with open(segment.path_of(f.segment), "r+b") as seg:
                    seg.seek(f.size // 2)
                    byte = seg.read(1)
                    seg.seek(-1, os.SEEK_CUR)
                    seg.write(bytes([byte[0] ^ 1]))
                return
    raise KeyError(rel)


def restore_dirs(save_dir: str) -> list[str]:
    """The restore directories of ``save_dir``'s loads in /dev/shm."""
    prefix = f"{RESTORE_PREFIX}{KeeperAddress.of(save_dir).key}."
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def keeper_pids(save_dir: str) -> list[int]:
    """Live keepers of ``save_dir`` on this machine, by their command line."""
    want = f"--save-dir\0{os.path.realpath(save_dir)}\0".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"deepspeed_async_ckpt.memory.keeper" in cmd and want in cmd and state not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def kill_keepers(save_dir: str) -> None:
    """SIGKILL ``save_dir``'s keepers, wait until they are gone, remove their segments."""
    for pid in keeper_pids(save_dir):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while keeper_pids(save_dir) and time.monotonic() < deadline:
        time.sleep(0.02)
    for node in range(4):  # the tests' jobs span at most four nodes on this host
        for name in KeeperAddress.of(save_dir, node=node).segments_on_node():
            segment.unlink(name)
