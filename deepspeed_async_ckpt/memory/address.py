"""Where a job's keeper is found: its socket, its segments' names and its log, all derived
from the real path of the job's save directory, the user id and the node's index in the job
(``rank // ranks per node``: each node runs its own keeper; the index keeps them apart where
two "nodes" share a host, and a restart that numbers the hosts otherwise finds no keeper and
loads from disk).

- the socket is in Linux's abstract namespace (``@deepspeed_async_ckpt.keeper.<uid>.<hash>``):
  binding it is the atomic "I am this save directory's keeper", and the kernel frees the name
  when the keeper dies, so a killed keeper leaves no stale socket behind;
- its shared memory segments are ``/dev/shm/dsack.<uid>.<hash>.<pid>.<n>``: the prefix names
  the save directory, so the next keeper of the same directory finds and removes what a
  killed one left; the pid keeps an exiting keeper's names apart from its successor's;
- its log is ``keeper.<uid>.<hash>.log`` in the user's runtime directory
  (``$XDG_RUNTIME_DIR/deepspeed_async_ckpt``, else ``/tmp/deepspeed_async_ckpt-<uid>``, mode 0700).

Two save directories give two keepers; the same directory reached through a symbolic link
gives the same one.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class KeeperAddress:
    """The names of one save directory's keeper on this node, for this user."""

    save_dir: str
    """The save directory's real path."""

    uid: int
    key: str
    """``<uid>.<hash of the real path and the node>``: shared by the socket, segment and log names."""

    @classmethod
    def of(cls, save_dir: str, uid: int | None = None, node: int = 0) -> "KeeperAddress":
        real = os.path.realpath(save_dir)
        uid = os.getuid() if uid is None else uid
        digest = hashlib.sha256(f"{uid}:{real}:{node}".encode()).hexdigest()[:16]
        return cls(save_dir=real, uid=uid, key=f"{uid}.{digest}")

    @property
    def socket_name(self) -> str:
        """The abstract socket's name as ``bind``/``connect`` take it (a leading NUL)."""
        return f"\0deepspeed_async_ckpt.keeper.{self.key}"

    @property
    def shown(self) -> str:
        """The socket's name as ``ss -x`` shows it (``@`` for the NUL)."""
        return "@" + self.socket_name[1:]

    @property
    def segment_prefix(self) -> str:
        """Every segment of this save directory's keepers starts with it (a name in ``/dev/shm``)."""
        return f"dsack.{self.key}."

    def segment_name(self, pid: int, serial: int) -> str:
        return f"{self.segment_prefix}{pid}.{serial}"

    def segments_on_node(self) -> list[str]:
        """Names in ``/dev/shm`` of this save directory's keepers, live or stale."""
        try:
            return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(self.segment_prefix))
        except FileNotFoundError:
            return []

    @property
    def log_path(self) -> str:
        return os.path.join(runtime_dir(self.uid), f"keeper.{self.key}.log")


def runtime_dir(uid: int | None = None) -> str:
    """The user's directory for keeper logs, made 0700 if missing; refused if another user
    owns it or it is a symbolic link (``/tmp`` is shared)."""
    uid = os.getuid() if uid is None else uid
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(base, "deepspeed_async_ckpt") if base else f"/tmp/deepspeed_async_ckpt-{uid}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        raise PermissionError(f"{path} is not a directory of user {uid}: the keeper's log cannot go there")
    return path
