"""Load-time verification: a checkpoint's files against its manifest's sizes and checksums.

Any rank calls these before a load. :func:`verify_checkpoint` splits the work among the ranks
(each checks its share of the files and segments, together every byte once), and rank 0 also
checks the late files (:data:`.layout.LATE_FILES`). With node-local storage (a manifest with
``nodes``), the ranks of each node split the files in that node's directory. :func:`verify_file` checks one file, as a
load of just that file does.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Sequence

from ..errors import IntegrityError
from ..persist import HASHERS, hash_ranges
from .layout import LATE_FILES, META_DIR, find_checkpoint_dir
from .manifest import files_on_node, manifest_problem, read_json, read_manifest
from .nodes import local_world_size, node_of


def verify_file(path: str, manifest: dict | None = None, segment: int | Sequence[int] | None = None,
                *, ckpt_dir: str | None = None) -> None:
    """Check one file against the committed manifest of its checkpoint; raises IntegrityError
    naming the file. Files outside any checkpoint of ours are not checked. ``segment``: check
    only that segment, or those, of a file checksummed in segments (a file the replicas wrote
    in shares, a packed file's archives), and the file's size."""
    ckpt_dir = ckpt_dir or find_checkpoint_dir(path)
    if ckpt_dir is None:
        return
    manifest = manifest or read_manifest(ckpt_dir)
    rel = os.path.relpath(os.path.abspath(path), ckpt_dir)
    entry = manifest["files"].get(rel)
    if entry is None:
        raise IntegrityError(f"{path} is not listed in the manifest of checkpoint {ckpt_dir!r}")
    algorithm = manifest["checksum"]
    if algorithm not in HASHERS:
        raise IntegrityError(f"manifest of checkpoint {ckpt_dir!r} uses checksum {algorithm!r}, "
                             f"which this version cannot compute (it knows {', '.join(HASHERS)})")
    # [offset, length, checksum] of each part checksummed on its own: the whole file, each
    # share of a file the replicas wrote in shares, or each archive of a packed file
    segments = entry.get("segments") or [[0, None, entry.get(algorithm)]]
    if segment is not None:
        segments = [segments[i] for i in ([segment] if isinstance(segment, int) else segment)]
    try:
        problem = file_problem(path, entry, algorithm, segments)
    except OSError as exc:  # missing, unreadable: as bad as a wrong checksum
        raise IntegrityError(f"{path}: listed in the manifest of checkpoint {ckpt_dir!r} but "
                             f"cannot be read: {exc}") from exc
    if problem is not None:
        raise IntegrityError(f"{path}: {problem}")


def file_problem(path: str, entry: dict, algorithm: str,
                 segments: Sequence[Sequence] | None = None) -> str | None:
    """What is wrong with the file at ``path`` as the manifest ``entry`` describes it (checked
    with ``algorithm``), or None: its size, then each segment's length and checksum (all of
    the entry's segments, or ``segments``). The message does not name the file. Raises
    ``OSError`` where the file cannot be read (missing too)."""
    if segments is None:
        segments = entry.get("segments") or [[0, None, entry.get(algorithm)]]
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        return f"size {size} bytes, manifest says {entry['bytes']}: file truncated or replaced"
    hashed = hash_ranges(path, algorithm, [(offset, length) for offset, length, _ in segments])
    for (offset, length, expected), (n, digest) in zip(segments, hashed):
        where = "" if length is None else f" (bytes {offset}-{offset + length})"
        if n != (size if length is None else length):  # changed while it was read
            return f"read {n} bytes{where}, expected {length or size}: file truncated"
        if algorithm != "none" and digest != expected:
            return f"{algorithm} {digest}{where} does not match manifest {expected}: file corrupted"
    return None


def verify_checkpoint(ckpt_dir: str, *, rank: int = 0, world_size: int = 1,
                      manifest: dict | None = None, node: int | None = None,
                      include: Callable[[str], bool] | None = None,
                      reads: Callable[[str], Iterable[tuple[int, int]] | None] | None = None,
                      progress: Callable[[int], None] | None = None) -> dict:
    """Verify the files of a committed checkpoint (against ``manifest`` if already read);
    returns its manifest. With ``world_size`` ranks each verifying its share, rank ``r``
    checks the units ``r, r + world_size, ...`` of the manifest, a unit being a file or one
    share of a file the replicas wrote in shares (so the largest file, which every replica
    loads, is read by as many ranks as wrote it), and together they read every byte once.
    ``include``: check only the files (by path within the checkpoint) it accepts, those a
    partial load reads. ``reads``: the (offset, length) ranges a load reads in a file, None
    for all of it; of a packed file, only the archives holding those are checked.

    A manifest with ``nodes`` (node-local storage): the ranks of each node (see
    :mod:`.nodes`) split the files its directory holds, the others are not there to check;
    each node's first rank checks the late files (every node's leader writes them). ``node``:
    the node whose directory ``ckpt_dir`` is (default: ``rank``'s). ``progress(nbytes)``:
    called after each file, share or set of archives this rank checked, with its bytes (see
    :mod:`..progress`)."""
    manifest = manifest or read_manifest(ckpt_dir)
    here = files_on_node(manifest, node_of(rank, world_size) if node is None else node)
    if here is not None:  # this node's ranks, over this node's files
        per_node = local_world_size(world_size)
        first = rank - rank % per_node
        rank, world_size = rank - first, min(per_node, world_size - first)
    units: list[tuple[str, int | list[int] | None]] = []
    for rel, entry in sorted(manifest["files"].items()):
        if (include is not None and not include(rel)) or (here is not None and rel not in here):
            continue
        if "parts" in entry and "segments" in entry:  # packed: one unit, the archives read
            # (a packed file listed with one checksum for the whole file is checked whole below)
            wanted = None if reads is None else reads(rel)
            chosen = [i for i, (offset, length, _) in enumerate(entry["segments"])
                      if wanted is None or any(o < offset + length and offset < o + n for o, n in wanted)]
            if chosen:
                units.append((rel, chosen))
        else:
            units += [(rel, i if "segments" in entry else None)
                      for i in range(len(entry.get("segments", [None])))]
    for rel, segment in units[rank::world_size]:
        verify_file(os.path.join(ckpt_dir, rel), manifest, segment, ckpt_dir=ckpt_dir)
        if progress is not None:
            entry = manifest["files"][rel]
            chosen = [] if segment is None else [segment] if isinstance(segment, int) else segment
            progress(sum(entry["segments"][i][1] for i in chosen) if chosen else entry["bytes"])
    if rank == 0:  # a few small files, which every load reads (each node has them)
        _verify_late_files(ckpt_dir, manifest)
    return manifest


def _verify_late_files(ckpt_dir: str, manifest: dict) -> None:
    names = manifest.get("late_files")
    if not names:
        return
    path = os.path.join(ckpt_dir, META_DIR, LATE_FILES)
    try:
        files = read_json(ckpt_dir, path, "the record of its late files")
    except FileNotFoundError:
        raise IntegrityError(f"checkpoint {ckpt_dir!r} was committed but never finalized "
                             f"({', '.join(names)} not recorded): load the one the pointer "
                             "names") from None
    # the manifest's checks, over the late files (which no node list places: every node has them)
    with_late = {**{k: v for k, v in manifest.items() if k != "nodes"}, "files": files}
    problem = manifest_problem(with_late)
    if problem or sorted(files) != sorted(names):
        raise IntegrityError(f"checkpoint {ckpt_dir!r}: {path} is damaged: "
                             f"{problem or f'it records {sorted(files)}, not {sorted(names)}'}")
    for rel in names:
        verify_file(os.path.join(ckpt_dir, rel), with_late, ckpt_dir=ckpt_dir)
