"""``ds-async-ckpt list SAVE_DIR``: the checkpoint directories of a save dir and their state
(committed, unfinalized, damaged, partial, staged, being removed, link, other), newest commit
first, as a table or ``--json``. Reads manifests only; ``verify`` checks the bytes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

from .errors import CliError
from .save_dir import is_dir, pointer_target


def add_parser(sub) -> None:
    p = sub.add_parser("list", help="the checkpoints in a save dir: committed, unfinalized, damaged, "
                                    "partial, staged, being removed, other",
                       description="List the checkpoint directories of a save dir, newest commit "
                                   "first: this engine's committed checkpoints (commit time, files, "
                                   "bytes, ranks; the one the pointer names marked), its "
                                   "unfinalized ones (committed, markers never written), damaged "
                                   "ones (an unreadable manifest), its partial "
                                   "ones (a save in progress, or one a crash or failure cut "
                                   "short: never loaded; keep_last removes it once a later checkpoint "
                                   "commits), staged ones "
                                   "(a checkpoint saved again, written beside it until its commit "
                                   "swaps it in), those being removed, and other directories. Reads "
                                   "manifests only; "
                                   "`verify` checks the bytes.")
    p.add_argument("save_dir", help="e.g. ckpt (holding global_step*/ or iter_*/ directories)")
    p.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..commit import (MANIFEST, META_DIR, REMOVING_PREFIX, STAGING_PREFIX, is_finalized,
                         linked_checkpoints, read_manifest)
    from ..errors import IntegrityError
    from ..storage import is_temporary

    save_dir = args.save_dir
    if not os.path.isdir(save_dir):
        raise CliError(f"no save directory at {save_dir!r}")
    pointed = pointer_target(save_dir)
    try:
        names = sorted(os.listdir(save_dir))
    except OSError as exc:
        raise CliError(f"cannot list the save directory {save_dir!r}: {exc.strerror or exc}") from None
    rows = []
    linked = linked_checkpoints(save_dir)
    for name in names:
        path = os.path.join(save_dir, name)
        if os.path.islink(path) and os.path.isdir(path):  # best -> global_step900, say
            rows.append({"name": name, "state": "link", "pointer": name == pointed,
                         "target": os.readlink(path)})
            continue
        if not os.path.isdir(path):
            continue
        row = {"name": name, "state": "other", "pointer": name == pointed}
        if name in linked:  # retention keeps it
            row["linked_from"] = sorted(linked[name])
        if name.startswith(REMOVING_PREFIX):
            row["state"] = "being removed"
        elif name.startswith(STAGING_PREFIX):
            row.update(state="staged", replaces=name[len(STAGING_PREFIX):].partition(".")[2])
        elif _listed_as_ours(path, row):
            try:
                manifest = read_manifest(path)
            except (IntegrityError, OSError) as exc:  # no manifest, or a damaged one
                if os.path.exists(os.path.join(path, META_DIR, MANIFEST)):
                    row.update(state="damaged", problem=str(exc))
                else:
                    try:
                        records = [n for n in os.listdir(os.path.join(path, META_DIR))
                                   if n.startswith("rank_") and not is_temporary(n)]
                    except OSError as err:  # not ours to read: say so, as for a manifest
                        row.update(state="damaged", problem=str(err))
                    else:
                        row.update(state="partial",
                                   rank_records=sum(n.endswith(".json") for n in records),
                                   failed_ranks=sum(n.endswith(".failed") for n in records))
            else:
                row.update(state="committed" if is_finalized(path, manifest) else "unfinalized",
                           committed_at=manifest["committed_at"],
                           files=len(manifest["files"]), world_size=manifest["world_size"],
                           bytes=sum(e["bytes"] for e in manifest["files"].values()))
                if manifest.get("rotation") is False:  # saved aside: keep_last never removes it
                    row["rotation"] = False
        rows.append(row)
    order = {"committed": 0, "unfinalized": 1, "damaged": 2, "partial": 3, "staged": 4,
             "being removed": 5, "link": 6, "other": 7}
    rows.sort(key=lambda r: (order[r["state"]], -r.get("committed_at", 0), r["name"]))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = [("checkpoint", "state", "committed (UTC)", "files", "bytes", "ranks", "")]
    for r in rows:
        when = datetime.datetime.fromtimestamp(r["committed_at"], datetime.timezone.utc) \
            .strftime("%Y-%m-%d %H:%M:%S") if "committed_at" in r else "-"
        detail = f"{r['rank_records']} rank record(s)" + (
            f", {r['failed_ranks']} rank(s) failed" if r.get("failed_ranks") else "") \
            if r["state"] == "partial" else \
            f"replaces {r['replaces']}" if r["state"] == "staged" else \
            "manifest unreadable: see `verify`" if r["state"] == "damaged" else \
            "committed, markers never written" if r["state"] == "unfinalized" else \
            "kept aside (save_latest=False): keep_last never removes it" if r.get("rotation") is False else \
            f"-> {r['target']}" if r["state"] == "link" else \
            f"linked from {', '.join(r['linked_from'])}: keep_last keeps it" if r.get("linked_from") else ""
        table.append((r["name"], r["state"], when, str(r.get("files", "-")),
                      _bytes_text(r["bytes"]) if "bytes" in r else "-",
                      str(r.get("world_size", "-")), "<- pointer" if r["pointer"] else detail))
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _bytes_text(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _listed_as_ours(path: str, row: dict) -> bool:
    """Whether ``list`` should read ``path`` as this engine's checkpoint; one the user may not
    enter is marked damaged on ``row`` (its problem: the permission), not passed over."""
    from ..commit import META_DIR

    try:
        return is_dir(os.path.join(path, META_DIR), path)
    except CliError as exc:
        row.update(state="damaged", problem=str(exc))
        return False
