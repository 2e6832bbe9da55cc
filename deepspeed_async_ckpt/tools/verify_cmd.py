"""``ds-async-ckpt verify PATH``: every file of a committed checkpoint checked against its
manifest (size and checksum). Exit 0 if intact, 1 if not (damaged, partial, unfinalized), 2 if
there is no such directory or this engine did not write it. Its progress goes to standard error
(:mod:`...progress`): a bar on a terminal, a line at a bounded rate otherwise; the verdict to
standard output.
"""

from __future__ import annotations

import argparse
import os
import sys

from .errors import CliError
from .save_dir import POINTERS, checkpoints_in, is_dir, pointer_target, staged_replacement


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="check a committed checkpoint's files against its manifest",
                       description="Verify every file of a checkpoint directory (size and checksum "
                                   "from .async_ckpt/manifest.json). Exit 0 if intact, 1 if not "
                                   "(damaged, partial, unfinalized), 2 if there is no such "
                                   "directory or this engine did not write it (no .async_ckpt/: "
                                   "no checksums to verify against).")
    p.add_argument("path", help="a checkpoint directory (e.g. ckpt/global_step100), or a save dir "
                                "with a `latest` or `latest_checkpointed_iteration.txt` pointer")
    p.add_argument("--node", type=int, default=None,
                   help="node-local storage: the node whose copy PATH is (default: the node whose "
                        "files the manifest lists are all there, else the one with the most)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..commit import META_DIR, read_manifest, verify_checkpoint
    from ..errors import IntegrityError
    from ..progress import Progress

    path = args.path
    target = pointer_target(path) if os.path.isdir(path) else None
    if target is not None:
        path = os.path.join(path, target)
    note = ""
    if not os.path.isdir(path):
        staged = staged_replacement(path)
        if staged is None:
            raise CliError(f"no checkpoint directory at {path!r}")
        note = (f" (committed at {staged!r}: a save of it stopped between its two renames; the "
                "next load_checkpoint or save_checkpoint renames it into place)")
        path = staged
    if not is_dir(os.path.join(path, META_DIR), path):  # DeepSpeed's own engine, megatron-core
        ours = checkpoints_in(path) if target is None else []
        if ours:  # a save directory whose pointer is gone (deleted, or never written)
            raise CliError(f"{path!r} is a save directory without a pointer (no "
                           f"{' or '.join(p for p, _ in POINTERS)}): verify one of its "
                           f"{len(ours)} checkpoint(s), e.g. {os.path.join(path, ours[-1])!r}; "
                           f"`ds-async-ckpt list {path}` shows them")
        raise CliError(f"{path!r} was not written by this engine (no {META_DIR}/): it holds no "
                       "checksums to verify against")
    progress = None
    try:
        manifest = read_manifest(path)
        node = _node_of_copy(path, manifest, args.node)
        here = manifest["files"] if node is None else manifest["nodes"][str(node)]  # what is checked
        # on standard error only: a bar on a terminal, else a line at a bounded rate
        progress = Progress(f"verify {path}", sum(manifest["files"][rel]["bytes"] for rel in here),
                            stream=sys.stderr)
        verify_checkpoint(path, manifest=manifest, node=node, progress=progress.add)
        progress.done()
    except IntegrityError as e:
        if progress is not None:
            progress.stop()
        if isinstance(e.__cause__, PermissionError):  # a file the user may not read: not a
            # verdict on the checkpoint, which may well be intact
            raise CliError(f"cannot read checkpoint {path!r}: {e}") from None
        print(f"CORRUPT: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # its manifest unreadable (permissions): nothing verified
        if progress is not None:
            progress.stop()
        raise CliError(f"cannot read checkpoint {path!r}: {e}") from None
    total = sum(manifest["files"][rel]["bytes"] for rel in here)
    checked = ("sizes verified (checksum none: no checksums recorded)" if manifest["checksum"] == "none"
               else f"{manifest['checksum']} verified")
    carried = len(manifest.get("carried", ()))
    files = f"{len(manifest['files'])} files" + (
        f" ({carried} carried over from the checkpoint it replaced)" if carried else "")
    if node is not None:  # node-local: this directory holds this node's part
        files = f"node {node}'s copy: {len(here)} of the {files}"
    print(f"OK: {path}: tag {manifest['tag']}, {files}, {total} bytes, "
          f"{manifest['world_size']} ranks, {checked}{note}")
    unlisted = _unlisted_files(path, manifest)
    if unlisted:  # not an error (a file the training script put there), but not checked either
        shown = ", ".join(unlisted[:8]) + (f" and {len(unlisted) - 8} more" if len(unlisted) > 8 else "")
        print(f"note: {len(unlisted)} file(s) there not in the manifest, not verified (a load "
              f"through the engine refuses them): {shown}")
    return 0


def _node_of_copy(ckpt_dir: str, manifest: dict, node: int | None) -> int | None:
    """The node whose copy ``ckpt_dir`` is, for a node-local manifest (with ``nodes``; None
    otherwise): ``node`` if given (refused if the manifest lists no such node), else the
    lowest node whose listed files are all there, else the one with the most of them there."""
    nodes = manifest.get("nodes")
    if nodes is None:
        return None
    if node is not None:
        if str(node) not in nodes:
            raise CliError(f"--node {node}: the manifest of {ckpt_dir!r} lists node(s) "
                           f"{', '.join(sorted(nodes, key=int))}")
        return node
    present = {int(n): sum(os.path.isfile(os.path.join(ckpt_dir, rel)) for rel in files)
               for n, files in nodes.items()}
    complete = [n for n in sorted(present) if present[n] == len(nodes[str(n)])]
    return complete[0] if complete else max(sorted(present), key=lambda n: present[n])


def _unlisted_files(ckpt_dir: str, manifest: dict) -> list[str]:
    """Files under ``ckpt_dir`` its manifest does not list (its own records left out)."""
    from ..commit import META_DIR

    listed = {*manifest["files"], *manifest.get("late_files", ())}
    found = []
    for top, dirs, names in os.walk(ckpt_dir):
        rel = os.path.relpath(top, ckpt_dir)
        if rel == ".":
            dirs[:] = [d for d in dirs if d != META_DIR]
        found += [n if rel == "." else f"{rel}/{n}" for n in names]
    return sorted(n for n in found if n not in listed)
