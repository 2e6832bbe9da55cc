"""The targets the checkpoint benchmark is held to, and whether a run met them."""

from __future__ import annotations

import math

STALL_RATIO_TARGET = 20.0
"""DS TorchCheckpointEngine's stall over this engine's, at least."""
PERSIST_FRACTION_TARGET = 0.80
"""Persist throughput as a fraction of the storage's measured write bandwidth, at least."""
OVERHEAD_TARGET = 0.05
"""End-to-end training overhead of a save every K steps, at most."""


def targets(cell: dict, storage: dict) -> dict:
    """The three targets for this engine (async) in one (setting, size)."""
    e = cell["engines"]
    a, t = e.get("async", {}), e.get("ds_torch", {})
    out = {}
    if a.get("ok") and t.get("ok"):
        ratio = t["stall_s"] / a["stall_s"] if a["stall_s"] > 0 else math.inf
        floor = cell["steps"]["ds_floor_s"]
        out["stall_ratio_vs_torch"] = {"value": ratio, "target": STALL_RATIO_TARGET, "met": ratio >= STALL_RATIO_TARGET,
                                       "ds_floor_ratio": t["stall_s"] / floor if floor > 0 else math.inf}
    if a.get("ok"):
        frac = a["persist_gbps"] / storage["fsync_gbps"]
        out["persist_fraction_of_storage"] = {"value": frac, "target": PERSIST_FRACTION_TARGET,
                                              "met": frac >= PERSIST_FRACTION_TARGET}
        repeats = [r["overhead"] for r in a.get("runs", [])] or [a["overhead"]]
        out["overhead_every_k"] = {"value": a["overhead"], "target": OVERHEAD_TARGET,
                                   "met": a["overhead"] < OVERHEAD_TARGET,
                                   # the spread of this engine's own paired overheads; the
                                   # spread of every quiet window of the cell, minutes and
                                   # engines apart, beside it
                                   "repeat_spread": max(repeats) - min(repeats), "repeats": len(repeats),
                                   "noise": cell["steps"]["baseline_spread"]}
        bare = cell["steps"].get("bare_write")
        if bare and bare.get("gbps"):
            out["persist_fraction_of_storage"]["of_bare_write"] = a["persist_gbps"] / bare["gbps"]
            out["overhead_every_k"]["bare_write"] = bare["overhead"]
    return out


def targets_text(result: dict) -> str:
    lines = ["\nTargets (this engine, async mode):"]
    for setting, cells in result["cells"].items():
        for size, cell in cells.items():
            for key, t in cell.get("targets", {}).items():
                v = t["value"]
                shown = f"{v:.1f}x" if key == "stall_ratio_vs_torch" else f"{100 * v:.1f}%"
                goal = {"stall_ratio_vs_torch": f">= {STALL_RATIO_TARGET:.0f}x",
                        "persist_fraction_of_storage": f">= {100 * PERSIST_FRACTION_TARGET:.0f}%",
                        "overhead_every_k": f"< {100 * OVERHEAD_TARGET:.0f}%"}[key]
                extra = f" (baseline noise {100 * t['noise']:.1f}%)" if "noise" in t else ""
                if "repeat_spread" in t and t.get("repeats", 0) > 1:
                    extra += f" (its repeats {100 * t['repeat_spread']:.1f} points apart)"
                if "of_bare_write" in t:
                    extra += (f" (of the same bytes written alone by a thread during training: "
                              f"{100 * t['of_bare_write']:.0f}%)")
                if "bare_write" in t:
                    extra += (f" (that bare write alone, no copy or checksum: "
                              f"{100 * t['bare_write']:+.1f}%)")
                if "ds_floor_ratio" in t:
                    extra += (f" (DeepSpeed's own save_checkpoint work alone, with an engine that "
                             f"writes nothing: {t['ds_floor_ratio']:.1f}x)")
                lines.append(f"  {setting} {cell['size_gb']:.2f} GB {key}: {shown} ({goal}) "
                             f"{'MET' if t['met'] else 'MISSED'}{extra}")
    return "\n".join(lines)
