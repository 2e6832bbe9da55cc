"""Helpers for the memory tier's load tests: a committed checkpoint on disk copied into its
save directory's keeper with the contract's names (each rank's files in its part of the slot,
the files no rank owns in the first rank's, the disk manifest given at the commit), the
keepers of a save directory found and killed, the restore directories counted."""

import os
import re
import signal
import time

from deepspeed_async_ckpt.commit.manifest import read_manifest
from deepspeed_async_ckpt.memory import segment
from deepspeed_async_ckpt.memory.address import SHM_DIR, KeeperAddress
from deepspeed_async_ckpt.memory.client import KeeperClient
from deepspeed_async_ckpt.memory.config import MemoryConfig
from deepspeed_async_ckpt.memory.restore import RESTORE_PREFIX

CONFIG = MemoryConfig(enabled=True, keep_last=2, idle_timeout_s=120)


def owner(rel: str, ranks) -> int:
    """The rank whose part of the slot holds ``rel``: DeepSpeed's ``zero_pp_rank_<r>_`` files
    their rank's, every other file the first rank's."""
    match = re.match(r"(?:bf16_)?zero_pp_rank_(\d+)_", os.path.basename(rel))
    rank = int(match.group(1)) if match else ranks[0]
    return rank if rank in ranks else ranks[0]


def fill_keeper(save_dir: str, ckpt_dir: str, ranks=(0,), config: MemoryConfig = CONFIG,
                late=()) -> KeeperClient:
    """Copy the committed ``ckpt_dir`` (of ``save_dir``) into ``save_dir``'s keeper, started if
    none runs, and commit it there with its manifest; the client, connected. ``late``: files
    of ``ckpt_dir`` copied too and listed as the manifest's ``late_files`` (written after the
    commit, as megatron-core's markers are)."""
    manifest = read_manifest(ckpt_dir)
    if late:
        manifest = dict(manifest, late_files=sorted(late))
    name = os.path.basename(ckpt_dir)
    client = KeeperClient.connect(save_dir, config)
    parts = {r: [rel for rel in [*manifest["files"], *late] if owner(rel, ranks) == r] for r in ranks}
    for rank, files in parts.items():
        sizes = {rel: os.path.getsize(os.path.join(ckpt_dir, rel)) for rel in files}
        res = client.reserve(name, manifest["save_id"], rank, tuple(ranks), sizes)
        for rel in files:
            with open(os.path.join(ckpt_dir, rel), "rb") as f:
                res.write(rel, f.read())
        res.report()
    client.commit(name, manifest["save_id"], manifest)
    return client


def corrupt_in_memory(client: KeeperClient, rel: str) -> None:
    """Flip one byte of ``rel`` in the keeper's newest slot, in its segment in /dev/shm."""
    copy = client.newest()
    for part in copy.ranks.values():
        for f in part.files:
            if f.name == rel:
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
    for name in KeeperAddress.of(save_dir).segments_on_node():
        segment.unlink(name)
