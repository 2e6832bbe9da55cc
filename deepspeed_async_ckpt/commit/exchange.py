"""The records of a save through the process group's key-value store: the commit where the
ranks share no directory (node-local storage).

With node-local storage each node writes its files into a directory of its own, at the same
path on every node, which no other node sees; rank 0 cannot list the other nodes' records
(:class:`.records.DirectoryExchange`). They travel through the store of the default process
group instead (a ``TCPStore``, under :data:`.nodes.STORE_PREFIX`), whose requests are safe
from any thread, where a collective on the committer thread would interleave with the
training thread's. Keys, per save (``<id>``: its save id)::

    <id>/rank/<r>       (every rank)   its record, the JSON a record file holds, with its node
    <id>/failed/<r>     (a rank)       why its part failed
    <id>/count          (every rank)   +1 once its record is set; +(world size + 1) on failure
    <id>/commit/<n>     (rank 0)       node n's manifest and the late files (Megatron's markers)
                                       once committed, or why it was not

Rank 0 polls the one counter (``add(key, 0)``): the world size means every record is there,
more means a rank failed (the commit stops at once, as with a failure record). It reads the
records in one ``multi_get``, deletes them, commits, and sets each other node's ``commit``
key; the leader of that node (its lowest rank, :func:`.nodes.node_leader`) polls it, deletes
it, and commits the same checkpoint on its node (:func:`.sequence.commit_on_node`). A rank
polls with short requests, never a blocking ``wait``, which would hold the store's client
for its whole duration.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any, Callable

from ..errors import CommitError
from .nodes import node_count
from .records import parse_rank_record

#: How long a node's leader waits for rank 0's commit, in ``commit_timeout_s``: rank 0 waits
#: that long for the last record, then runs the finalize steps and moves its pointer.
LEADER_WAIT_FACTOR = 2


class StoreExchange:
    """The records of every save of one checkpointer, through ``store`` (a
    ``torch.distributed.Store``: ``PrefixStore``, ``TCPStore``, ``HashStore``), among
    ``world_size`` ranks: a :class:`.records.RecordExchange` whose outcome also reaches the
    other nodes (:meth:`tell_nodes`), and whose leaders wait for it (:meth:`await_commit`)."""

    #: Every node commits the checkpoint in its own directory.
    node_local = True

    def __init__(self, store: Any, world_size: int) -> None:
        self.store, self.world_size = store, world_size

    # every rank ------------------------------------------------------------------------
    def publish(self, ckpt_dir: str, record: dict) -> None:
        """Every rank: its record, then the count (rank 0 reads no record before it counts)."""
        sid = record["save_id"]
        self.store.set(f"{sid}/rank/{record['rank']}", json.dumps(record))
        self.store.add(f"{sid}/count", 1)

    def fail(self, ckpt_dir: str, *, rank: int, save_id: str, message: str) -> None:
        """A rank whose part failed: its reason, then a count past the world size, so that rank
        0 abandons the commit at once."""
        self.store.set(f"{save_id}/failed/{rank}", message)
        self.store.add(f"{save_id}/count", self.world_size + 1)

    # rank 0 ---------------------------------------------------------------------------
    def look(self, ckpt_dir: str, *, save_id: str, world_size: int) -> tuple[bool, list[int]]:
        """Rank 0: whether every rank's record is there, and which ranks reported a failure
        (looked for only once the count says one did). One request, whatever the world size."""
        arrived = self.store.add(f"{save_id}/count", 0)
        if arrived <= world_size:
            return arrived == world_size, []
        return False, [r for r in range(world_size) if self.store.check([f"{save_id}/failed/{r}"])]

    def reason(self, ckpt_dir: str, *, save_id: str, rank: int) -> str:
        """Rank 0: why rank ``rank``'s part failed, as it reported."""
        return self.store.get(f"{save_id}/failed/{rank}").decode("utf-8", "replace")

    def missing(self, ckpt_dir: str, *, save_id: str, world_size: int) -> list[int]:
        """Rank 0: the ranks whose record is not there."""
        return [r for r in range(world_size) if not self.store.check([f"{save_id}/rank/{r}"])]

    def read(self, ckpt_dir: str, *, tag: str, save_id: str, world_size: int,
             checksum: str) -> dict[int, dict]:
        """Rank 0, once :meth:`look` found them all: every rank's record, checked, in one
        request; their keys are deleted."""
        keys = [f"{save_id}/rank/{r}" for r in range(world_size)]
        values = self.store.multi_get(keys)
        self.discard(save_id=save_id, world_size=world_size)
        return {r: parse_rank_record(v, f"(store key {keys[r]})", r, save_id=save_id,
                                     checksum=checksum, ckpt_dir=ckpt_dir, tag=tag)
                for r, v in enumerate(values)}

    def discard(self, *, save_id: str, world_size: int) -> None:
        """Rank 0, once the records are read or the commit failed: delete the save's keys
        (a rank that reports after that leaves its own behind)."""
        for key in [f"{save_id}/count", *(f"{save_id}/{kind}/{r}" for kind in ("rank", "failed")
                                           for r in range(world_size))]:
            self.store.delete_key(key)

    def tell_nodes(self, save_id: str, manifests: dict[int, dict], late: dict[str, bytes]) -> None:
        """Rank 0, once its pointer moved: each other node's manifest (node -> manifest), and
        the late files its finalize steps wrote (path -> bytes), which every node's copy needs."""
        files = {rel: base64.b64encode(data).decode("ascii") for rel, data in late.items()}
        for node, manifest in manifests.items():
            if node:
                self.store.set(f"{save_id}/commit/{node}", json.dumps({"manifest": manifest, "late": files}))

    def tell_nodes_failed(self, save_id: str, message: str) -> None:
        """Rank 0, once the save failed: why, to the leaders of the other nodes."""
        for node in range(1, node_count(self.world_size)):
            self.store.set(f"{save_id}/commit/{node}", json.dumps({"failed": message}))

    # a node's leader ------------------------------------------------------------------
    def await_commit(self, ckpt_dir: str, *, tag: str, save_id: str, node: int, timeout_s: float,
                     poll_delay: Callable[[float], float]) -> tuple[dict, dict[str, bytes]]:
        """A node's leader: the manifest rank 0 committed for ``node`` and the late files (its
        key then deleted); ``CommitError`` if rank 0 says the save failed, or says nothing
        within ``timeout_s``."""
        start = time.monotonic()
        key = f"{save_id}/commit/{node}"
        while not self.store.check([key]):
            if time.monotonic() - start > timeout_s:
                raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed on node "
                                  f"{node}: rank 0 did not say it committed within {timeout_s:.0f} s "
                                  "(async_checkpoint.commit_timeout_s, twice)")
            time.sleep(poll_delay(time.monotonic() - start))
        text = self.store.get(key)
        self.store.delete_key(key)
        try:
            said = json.loads(text)
            manifest, failed = said.get("manifest"), said.get("failed")
            late = {rel: base64.b64decode(data) for rel, data in said.get("late", {}).items()}
        except (ValueError, AttributeError, TypeError) as exc:
            raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed on node {node}: "
                              f"rank 0's word (store key {key}) is damaged: {exc}") from None
        if not isinstance(manifest, dict):
            raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed on node {node}: "
                              f"rank 0 did not commit it ({failed})")
        return manifest, late
