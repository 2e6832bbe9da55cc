"""Copying one committed checkpoint to one tier, and that tier's retention.

Commit order on a tier, for checkpoint ``name`` (the same as on the first tier: files, then the
manifest, then the pointer, so that the tier's pointer never names a partial copy)::

    (each draining node) every file it uploads (:func:`files_to_upload`), each checked against
                         the manifest just before it goes up; then, with a node-local first
                         tier, its marker
                         <name>/.async_ckpt/drained.<node>.json
    (global rank 0)      wait for every node's marker; the late files and their record;
                         <name>/.async_ckpt/manifest.json; then .async_ckpt/pointer.json and
                         a copy of the framework's pointer file (``latest``)
    (global rank 0)      retention on the tier (``keep_last``), and the partial copies no
                         live drain can be writing (:func:`retire_on_tier`)

The source is always the committed first-tier copy on disk, never training memory.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Iterable

from ..commit import LATE_FILES, MANIFEST, META_DIR, KeepLast, Pointer, read_manifest, verify_checkpoint, \
    verify_file
from ..commit.manifest import files_on_node
from ..commit.policy import CheckpointInfo
from ..commit.retire import step_in_name
from ..errors import IntegrityError
from ..progress import track
from .keys import POINTER_KEY, manifest_key, marker_key
from .remote import Remote

logger = logging.getLogger(__name__)

PARTIAL_GRACE_S = 3600.0
"""A partial copy on a tier (objects, no manifest) another process left is removed only once
its newest object is this many seconds older than the tier's pointer: longer than a live
drain goes without a new object (one file's upload: an S3 object appears when its upload
completes; a node's wait for the others' markers, ``marker_timeout_s``)."""


def files_of_node(manifest: dict, node: int) -> list[str]:
    """The files (paths in the checkpoint) a node's first-tier directory holds: those
    ``manifest["nodes"]`` lists for it (a node-local first tier), else every file."""
    here = files_on_node(manifest, node)
    return sorted(manifest["files"] if here is None else here)


def files_to_upload(manifest: dict, node: int) -> list[str]:
    """The files a node uploads: those it holds that no lower node holds. A file written on
    several nodes (DeepSpeed's model states, on each node's first rank) goes up once, from the
    lowest of them, whose entry global rank 0's manifest (the one the tier gets) carries: the
    copies may differ in their bytes (only rank 0's lists tied weights), and one key holds one."""
    nodes = manifest.get("nodes")
    if nodes is None:
        return sorted(manifest["files"])
    lower = {rel for n, rels in nodes.items() if int(n) < node for rel in rels}
    return sorted(set(nodes.get(str(node), ())) - lower)


def upload_node_files(remote: Remote, ckpt_dir: str, manifest: dict, node: int) -> int:
    """Upload this node's share of a committed checkpoint (:func:`files_to_upload`, each
    verified first); with a node-local first tier, then this node's marker. Returns the bytes
    uploaded."""
    name = os.path.basename(ckpt_dir)
    total = 0
    for rel in track(files_to_upload(manifest, node), lambda rel: manifest["files"][rel]["bytes"],
                     f"drain of {name} to {remote.url}"):
        path = os.path.join(ckpt_dir, rel)
        verify_file(path, manifest, ckpt_dir=ckpt_dir)  # a damaged local copy is never drained
        remote.put_file(path, f"{name}/{rel}")
        total += manifest["files"][rel]["bytes"]
    if "nodes" in manifest:
        remote.put_bytes(marker_key(name, node), json.dumps({"save_id": manifest["save_id"]}).encode())
    return total


def wait_for_markers(remote: Remote, name: str, manifest: dict, timeout_s: float) -> None:
    """Global rank 0: wait until every node the manifest lists has uploaded its files."""
    nodes = sorted(int(n) for n in manifest.get("nodes", {}))
    deadline = time.monotonic() + timeout_s
    for node in nodes:
        while True:
            try:
                marker = json.loads(remote.get_bytes(marker_key(name, node)))
                if marker.get("save_id") == manifest["save_id"]:
                    break
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node} did not upload its files of {name} to {remote.url} "
                                   f"within {timeout_s} s")
            time.sleep(0.5)


def commit_on_tier(remote: Remote, ckpt_dir: str, manifest: dict, pointer: Pointer | None) -> int:
    """Global rank 0, once every node's files are up: the late files (checked against their
    record), the manifest, then the tier's pointer. Returns the bytes uploaded."""
    name = os.path.basename(ckpt_dir)
    meta = os.path.join(ckpt_dir, META_DIR)
    total = 0
    if manifest.get("late_files"):
        verify_checkpoint(ckpt_dir, manifest=manifest, include=lambda rel: False)  # the late files only
        for rel in manifest["late_files"]:
            remote.put_file(os.path.join(ckpt_dir, rel), f"{name}/{rel}")
            total += os.path.getsize(os.path.join(ckpt_dir, rel))
        remote.put_file(os.path.join(meta, LATE_FILES), f"{name}/{META_DIR}/{LATE_FILES}")
    remote.put_file(os.path.join(meta, MANIFEST), manifest_key(name))
    record = {"checkpoint": name, "save_id": manifest["save_id"],
              "committed_at": manifest["committed_at"],
              "pointer": None if pointer is None else [os.path.basename(pointer.path), pointer.text]}
    remote.put_bytes(POINTER_KEY, json.dumps(record, sort_keys=True).encode())
    if pointer is not None:  # the framework's own pointer, so that a path tier is a save directory
        remote.put_bytes(os.path.basename(pointer.path), pointer.text.encode())
    return total


def drain_checkpoint(remote: Remote, ckpt_dir: str, pointer: Pointer | None, *, node: int,
                     coordinator: bool, marker_timeout_s: float) -> int:
    """One drain of a committed checkpoint to one tier by one node (see the module's order);
    returns the bytes this call uploaded. Raises (the tier's pointer unmoved) on any failure."""
    manifest = read_manifest(ckpt_dir)
    total = upload_node_files(remote, ckpt_dir, manifest, node)
    if coordinator:
        if "nodes" in manifest:
            wait_for_markers(remote, os.path.basename(ckpt_dir), manifest, marker_timeout_s)
        total += commit_on_tier(remote, ckpt_dir, manifest, pointer)
    return total


def read_tier_pointer(remote: Remote) -> dict | None:
    """The tier's pointer record, or None if the tier holds no checkpoint yet; IntegrityError
    naming it if it is damaged."""
    try:
        raw = remote.get_bytes(POINTER_KEY)
    except FileNotFoundError:
        return None
    try:
        record = json.loads(raw)
        if not isinstance(record, dict) or not isinstance(record.get("checkpoint"), str):
            raise ValueError("no 'checkpoint' name")
    except ValueError as exc:
        raise IntegrityError(f"{remote.describe(POINTER_KEY)} is damaged: {exc}") from None
    return record


def read_tier_manifest(remote: Remote, name: str) -> dict | None:
    """The manifest of checkpoint ``name`` on the tier, or None where it has none."""
    try:
        return json.loads(remote.get_bytes(manifest_key(name)))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise IntegrityError(f"{remote.describe(manifest_key(name))} is damaged: {exc}") from None


def tier_lacks(remote: Remote, ckpt_dir: str) -> bool:
    """Whether the tier lacks the committed first-tier checkpoint ``ckpt_dir``: its pointer
    names neither that save nor one committed after it (a tier with the save's manifest and an
    older pointer lacks it too: the drain stopped between the two). False where ``ckpt_dir``
    is not committed (nothing to drain)."""
    try:
        manifest = read_manifest(ckpt_dir)
    except (IntegrityError, OSError):
        return False
    record = read_tier_pointer(remote)
    if record is None:
        return True
    if record["checkpoint"] == os.path.basename(ckpt_dir) and record.get("save_id") == manifest["save_id"]:
        return False
    at = record.get("committed_at")
    newer = isinstance(at, (int, float)) and not isinstance(at, bool) and at > manifest["committed_at"]
    return not newer


def retire_on_tier(remote: Remote, keep_last: int, current: str, tried: Iterable[str]) -> list[str]:
    """Global rank 0, after a drain of ``current`` moved the tier's pointer: remove the tier's
    committed checkpoints (those with a manifest) beyond the ``keep_last`` newest, never the
    one its pointer names, and the partial copies (objects under a name, no manifest) that no
    live drain is writing:

    - those this process drained before (``tried``): its drains run one at a time, so none of
      them is in flight now;
    - those another process left (a crashed job, a drain close gave up): older than the
      tier's pointer, both by step (the step in the name below ``current``'s) and by time
      (the newest object written at least :data:`PARTIAL_GRACE_S` before the pointer, both
      times by the store's clock). A live drain to the same tier writes a newer checkpoint,
      or writes objects within the grace. A name without a step (or a pointer naming one
      without) is never removed as such: it may be no checkpoint at all.

    A damaged manifest is never removed. Returns the names removed."""
    removed = []
    tried = set(tried) - {current}
    committed: list[tuple[float, str]] = []
    pointer_at = remote.last_modified(META_DIR)  # the pointer, just written
    for name in remote.list_names():
        if name.startswith(META_DIR) or name == current:
            continue
        try:
            manifest = read_tier_manifest(remote, name)
        except IntegrityError:
            continue  # someone should look at it: never removed
        if manifest is not None:
            committed.append((float(manifest.get("committed_at", 0.0)), name))
        elif name in tried or _abandoned(remote, name, current, pointer_at):
            remote.delete_tree(name)
            removed.append(name)
    if keep_last > 0:
        committed.sort(reverse=True)
        names = [current] + [name for _, name in committed]
        keep = KeepLast(keep_last).should_keep([CheckpointInfo(n, step_in_name(n)) for n in names])
        for name, kept in zip(names[1:], keep[1:]):
            if not kept:
                remote.delete_tree(name)
                removed.append(name)
    return removed


def _abandoned(remote: Remote, name: str, current: str, pointer_at: float | None) -> bool:
    """Whether the partial copy ``name`` is older than the tier's pointer (naming ``current``,
    written at ``pointer_at``) by step and by :data:`PARTIAL_GRACE_S` (see
    :func:`retire_on_tier`)."""
    step, pointer_step = step_in_name(name), step_in_name(current)
    if pointer_at is None or step is None or pointer_step is None or step >= pointer_step:
        return False
    newest = remote.last_modified(name)  # None: a plain object (``latest``), not a copy
    return newest is not None and newest <= pointer_at - PARTIAL_GRACE_S
