"""The manifest: reading it, the checks every reader applies, and the record of late files.

``<checkpoint>/.async_ckpt/manifest.json`` lists every file of a committed checkpoint with its
size and checksum (or the checksums of its segments). Rank 0's commit writes it
(:func:`.sequence.commit`) after :func:`manifest_problem` found nothing a reader would refuse;
any rank reads it with :func:`read_manifest` before a load, and retention and the command line
read it to tell committed checkpoints from the rest.

Files an adapter writes after the commit (megatron-core's ``.metadata``) are named in the
manifest's ``late_files``; rank 0 records their sizes and checksums in
:data:`.layout.LATE_FILES` once they are written (:func:`record_late_files`). Until then the
checkpoint is "committed but never finalized" and does not load.

With node-local storage (no directory all ranks share), ``nodes`` says which node's directory
holds each file: ``{"0": [rel, ...], "1": [...]}``, a file written on several nodes under each
(see :mod:`.exchange`). Without it, every file is in the one directory.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

from ..errors import IntegrityError
from ..persist import HASHERS, hash_ranges
from ..persist.checksum import new_hasher
from ..storage import Storage
from .atomic import write_text_atomic
from .layout import FORMAT, FORMAT_NAME, FORMAT_VERSION, LATE_FILES, MANIFEST, META_DIR

#: What every committed manifest holds (see :func:`.sequence.commit`), and of which type.
MANIFEST_FIELDS = {"format": str, "tag": str, "save_id": str, "world_size": int, "checksum": str,
                   "committed_at": (int, float), "files": dict}


def read_manifest(ckpt_dir: str) -> dict:
    """The committed manifest of ``ckpt_dir``; ``IntegrityError`` naming it if there is none
    or it is damaged (a truncated copy, say: not JSON, or without the fields a commit writes)."""
    path = os.path.join(ckpt_dir, META_DIR, MANIFEST)
    try:
        manifest = read_json(ckpt_dir, path, "its manifest")
    except FileNotFoundError:
        raise IntegrityError(f"checkpoint {ckpt_dir!r} was never committed (no {META_DIR}/{MANIFEST}): "
                             "it is partial; load the checkpoint its pointer names") from None
    problem = manifest_problem(manifest)
    if problem:
        raise IntegrityError(f"checkpoint {ckpt_dir!r}: its manifest {path} is damaged: {problem}")
    return manifest


def read_json(ckpt_dir: str, path: str, what: str) -> object:
    """The JSON at ``path`` (``FileNotFoundError`` if none); ``IntegrityError`` naming it and
    ``ckpt_dir`` if it is not UTF-8 JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, IsADirectoryError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise IntegrityError(f"checkpoint {ckpt_dir!r}: {what} {path} is damaged: {exc}") from None


def is_segment(seg: object) -> bool:
    """``[offset, length, checksum]``: where a part of a file lies, and its checksum."""
    return (isinstance(seg, list) and len(seg) == 3 and all(type(v) is int and v >= 0 for v in seg[:2])
            and isinstance(seg[2], str))


def manifest_problem(manifest: object) -> str | None:
    """What makes ``manifest`` one no reader accepts (a missing field, a format newer than this
    version, a file outside the checkpoint), or None."""
    if not isinstance(manifest, dict):
        return f"a {type(manifest).__name__}, not an object"
    for key, kind in MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            return f"{key!r} missing or of the wrong type"
    name, _, version = manifest["format"].rpartition("/")
    if name != FORMAT_NAME or not version.isdigit():
        return f"format {manifest['format']!r} is not this engine's"
    if int(version) > FORMAT_VERSION:
        return (f"format {manifest['format']!r} is newer than this version of deepspeed_async_ckpt "
                f"reads ({FORMAT!r}): upgrade it")
    if manifest["checksum"] not in HASHERS:
        return f"checksum {manifest['checksum']!r} unknown to this version"
    if not 0 <= manifest["committed_at"] < 253402300800:  # a time (before year 10000), not NaN
        return f"'committed_at' {manifest['committed_at']!r} is not a time"
    late = manifest.get("late_files", [])
    if not isinstance(late, list) or not all(isinstance(rel, str) for rel in late):
        return "'late_files' of the wrong type"
    for rel in [*manifest["files"], *late]:
        if os.path.isabs(rel) or os.pardir in rel.split("/"):
            return f"file {rel!r} is outside the checkpoint"
    problem = _nodes_problem(manifest)
    if problem:
        return problem
    for rel, entry in manifest["files"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
            return f"file {rel!r} has no size"
        segments = entry.get("segments", [])
        if not isinstance(segments, list) or not all(is_segment(seg) for seg in segments):
            return f"file {rel!r} has malformed segments"
        if "segments" not in entry and not isinstance(entry.get(manifest["checksum"]), str):
            return f"file {rel!r} has no {manifest['checksum']} checksum"
    return None


def _nodes_problem(manifest: dict) -> str | None:
    """What is wrong with ``manifest``'s ``nodes`` (node index -> the files on that node), if
    it has one: a key that is no node index, a file it does not list, a file on no node."""
    if "nodes" not in manifest:
        return None
    nodes = manifest["nodes"]
    if not isinstance(nodes, dict) or not all(isinstance(n, str) and n.isdecimal() and
                                              isinstance(rels, list) for n, rels in nodes.items()):
        return "'nodes' is not an object of node index -> list of files"
    placed: set[str] = set()
    for n, rels in sorted(nodes.items()):
        for rel in rels:
            if not isinstance(rel, str) or rel not in manifest["files"]:
                return f"'nodes' places {rel!r} on node {n}, which 'files' does not list"
        placed.update(rels)
    unplaced = sorted(set(manifest["files"]) - placed)
    if unplaced:
        return f"'nodes' places {unplaced[0]!r} on no node"
    return None


def files_on_node(manifest: dict, node: int) -> set[str] | None:
    """The files of ``manifest`` in node ``node``'s directory; None where every file is in
    the one directory all ranks share (no ``nodes``)."""
    if "nodes" not in manifest:
        return None
    return set(manifest["nodes"].get(str(node), ()))


def holds_save(ckpt_dir: str, save_id: str) -> bool:
    """Whether ``ckpt_dir`` holds the committed manifest of save ``save_id``."""
    try:
        return read_manifest(ckpt_dir).get("save_id") == save_id
    except (IntegrityError, OSError):
        return False


def is_committed(ckpt_dir: str) -> bool:
    """Whether ``ckpt_dir`` holds a committed manifest that reads."""
    try:
        read_manifest(ckpt_dir)
    except (IntegrityError, OSError, ValueError):
        return False
    return True


def record_late_files(storage: Storage, ckpt_dir: str, manifest: dict | None = None,
                      data: Mapping[str, bytes] | None = None) -> None:
    """Rank 0, once the files its manifest lists under ``late_files`` are written (what an
    adapter writes after the commit, from what the commit recorded: megatron-core's
    ``.metadata`` and ``metadata.json``): record their sizes and checksums, durably, so that
    verification covers them as it covers the rest. Until then, the checkpoint does not
    verify ("committed but never finalized").

    ``manifest``: the committed one (default: read from ``ckpt_dir``); ``data``: the files'
    bytes where the caller has them (what the finalize steps wrote), hashed without reading them
    back (a memory-only save's never reach a disk)."""
    manifest = manifest if manifest is not None else read_manifest(ckpt_dir)
    algorithm = manifest["checksum"]
    files = {}
    for rel in manifest.get("late_files", ()):
        if data is not None and rel in data:
            hasher = new_hasher(algorithm)
            hasher.update(data[rel])
            files[rel] = {"bytes": len(data[rel]), algorithm: hasher.hexdigest()}
            continue
        ((size, digest),) = hash_ranges(os.path.join(ckpt_dir, rel), algorithm, [(0, None)])
        files[rel] = {"bytes": size, algorithm: digest}
    write_text_atomic(storage, os.path.join(ckpt_dir, META_DIR, LATE_FILES),
                      json.dumps(files, indent=1, sort_keys=True))


def is_finalized(ckpt_dir: str, manifest: dict) -> bool:
    """Whether a committed checkpoint's ``late_files`` are recorded (always, without any)."""
    return not manifest.get("late_files") or os.path.exists(os.path.join(ckpt_dir, META_DIR, LATE_FILES))
