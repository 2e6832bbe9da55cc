"""``ds-async-ckpt`` command line.

Subcommands are registered in :func:`build_parser`; each one adds its own
subparser and sets ``func`` (``args -> exit code``): ``plan``, ``verify`` and
``list``; add another with an ``_add_<name>_parser`` function.

Exit codes: 0 success, 1 ``verify`` found a checkpoint damaged, partial or unfinalized, 2
invalid input (message on stderr as ``error: ...``): no such directory, not this engine's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional, Sequence

from .plan import (
    OPTIMIZERS,
    PCIE_D2H_GBPS,
    PRECISIONS,
    ModelShape,
    Plan,
    PlanInputError,
    PlanInputs,
    make_plan,
)

PROG = "ds-async-ckpt"


class CliError(Exception):
    """Bad command-line or config-file input (reported as exit code 2)."""


class _Parser(argparse.ArgumentParser):
    # Report usage errors through main() instead of exiting from inside argparse.
    def error(self, message):
        raise CliError(message)


# --------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Async checkpointing tools for DeepSpeed/Megatron.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_plan_parser(sub)
    _add_verify_parser(sub)
    _add_list_parser(sub)
    return parser


_POINTERS = (("latest", "{}"), ("latest_checkpointed_iteration.txt", "iter_{:0>7}"))


def _pointer_target(save_dir: str) -> str | None:
    """The checkpoint directory name ``save_dir``'s pointer (DeepSpeed's ``latest`` or
    Megatron's tracker) names, if it has one."""
    import os

    for pointer, fmt in _POINTERS:
        path = os.path.join(save_dir, pointer)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read().strip()
            except (OSError, ValueError) as exc:
                raise CliError(f"cannot read the pointer {path!r}: {exc}") from None
            if not text:  # it named save_dir itself: "not written by this engine" said nothing
                raise CliError(f"the pointer {path!r} is empty: it names no checkpoint")
            return fmt.format(text)
    return None


def _add_list_parser(sub) -> None:
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
    p.set_defaults(func=_cmd_list)


def _cmd_list(args: argparse.Namespace) -> int:
    import datetime
    import os

    from .commit import (MANIFEST, META_DIR, REMOVING_PREFIX, STAGING_PREFIX, is_finalized,
                         linked_checkpoints, read_manifest)
    from .errors import IntegrityError
    from .storage import is_temporary

    save_dir = args.save_dir
    if not os.path.isdir(save_dir):
        raise CliError(f"no save directory at {save_dir!r}")
    pointed = _pointer_target(save_dir)
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


def _add_verify_parser(sub) -> None:
    p = sub.add_parser("verify", help="check a committed checkpoint's files against its manifest",
                       description="Verify every file of a checkpoint directory (size and checksum "
                                   "from .async_ckpt/manifest.json). Exit 0 if intact, 1 if not "
                                   "(damaged, partial, unfinalized), 2 if there is no such "
                                   "directory or this engine did not write it (no .async_ckpt/: "
                                   "no checksums to verify against).")
    p.add_argument("path", help="a checkpoint directory (e.g. ckpt/global_step100), or a save dir "
                                "with a `latest` or `latest_checkpointed_iteration.txt` pointer")
    p.set_defaults(func=_cmd_verify)


def _cmd_verify(args: argparse.Namespace) -> int:
    import os

    from .commit import META_DIR, verify_checkpoint
    from .errors import IntegrityError

    path = args.path
    target = _pointer_target(path) if os.path.isdir(path) else None
    if target is not None:
        path = os.path.join(path, target)
    note = ""
    if not os.path.isdir(path):
        staged = _staged_replacement(path)
        if staged is None:
            raise CliError(f"no checkpoint directory at {path!r}")
        note = (f" (committed at {staged!r}: a save of it stopped between its two renames; the "
                "next load_checkpoint or save_checkpoint renames it into place)")
        path = staged
    if not _is_dir(os.path.join(path, META_DIR), path):  # DeepSpeed's own engine, megatron-core
        ours = _checkpoints_in(path) if target is None else []
        if ours:  # a save directory whose pointer is gone (deleted, or never written)
            raise CliError(f"{path!r} is a save directory without a pointer (no "
                           f"{' or '.join(p for p, _ in _POINTERS)}): verify one of its "
                           f"{len(ours)} checkpoint(s), e.g. {os.path.join(path, ours[-1])!r}; "
                           f"`ds-async-ckpt list {path}` shows them")
        raise CliError(f"{path!r} was not written by this engine (no {META_DIR}/): it holds no "
                       "checksums to verify against")
    try:
        manifest = verify_checkpoint(path)
    except IntegrityError as e:
        if isinstance(e.__cause__, PermissionError):  # a file the user may not read: not a
            # verdict on the checkpoint (until session 30: "CORRUPT", exit 1, for an intact one)
            raise CliError(f"cannot read checkpoint {path!r}: {e}") from None
        print(f"CORRUPT: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # its manifest unreadable (permissions): nothing verified
        raise CliError(f"cannot read checkpoint {path!r}: {e}") from None
    total = sum(entry["bytes"] for entry in manifest["files"].values())
    checked = ("sizes verified (checksum none: no checksums recorded)" if manifest["checksum"] == "none"
               else f"{manifest['checksum']} verified")
    carried = len(manifest.get("carried", ()))
    files = f"{len(manifest['files'])} files" + (
        f" ({carried} carried over from the checkpoint it replaced)" if carried else "")
    print(f"OK: {path}: tag {manifest['tag']}, {files}, {total} bytes, "
          f"{manifest['world_size']} ranks, {checked}{note}")
    unlisted = _unlisted_files(path, manifest)
    if unlisted:  # not an error (a file the training script put there), but not checked either
        shown = ", ".join(unlisted[:8]) + (f" and {len(unlisted) - 8} more" if len(unlisted) > 8 else "")
        print(f"note: {len(unlisted)} file(s) there not in the manifest, not verified (a load "
              f"through the engine refuses them): {shown}")
    return 0


def _checkpoints_in(save_dir: str) -> list[str]:
    """The subdirectories of ``save_dir`` this engine wrote, by name."""
    import os

    from .commit import META_DIR

    try:
        return sorted(e.name for e in os.scandir(save_dir)
                      if e.is_dir() and os.path.isdir(os.path.join(e.path, META_DIR)))
    except OSError:
        return []


def _unlisted_files(ckpt_dir: str, manifest: dict) -> list[str]:
    """Files under ``ckpt_dir`` its manifest does not list (its own records left out)."""
    import os

    from .commit import META_DIR

    listed = {*manifest["files"], *manifest.get("late_files", ())}
    found = []
    for top, dirs, names in os.walk(ckpt_dir):
        rel = os.path.relpath(top, ckpt_dir)
        if rel == ".":
            dirs[:] = [d for d in dirs if d != META_DIR]
        found += [n if rel == "." else f"{rel}/{n}" for n in names]
    return sorted(n for n in found if n not in listed)


def _is_dir(path: str, checkpoint: str) -> bool:
    """Whether ``path`` is a directory; a failure other than its absence (permissions: another
    user's checkpoint) is an error about ``checkpoint``, not a "no"."""
    import errno
    import os
    import stat

    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return False
        raise CliError(f"cannot read checkpoint {checkpoint!r}: {exc.strerror or exc}") from None


def _listed_as_ours(path: str, row: dict) -> bool:
    """Whether ``list`` should read ``path`` as this engine's checkpoint; one the user may not
    enter is marked damaged on ``row`` (its problem: the permission), not passed over."""
    import os

    from .commit import META_DIR

    try:
        return _is_dir(os.path.join(path, META_DIR), path)
    except CliError as exc:
        row.update(state="damaged", problem=str(exc))
        return False


def _staged_replacement(path: str) -> str | None:
    """A committed staging directory meant to become ``path``, where ``path`` is missing."""
    import os

    from .commit import META_DIR, MANIFEST, STAGING_PREFIX

    parent, name = os.path.split(os.path.abspath(path))
    try:
        names = os.listdir(parent)
    except OSError:  # missing, not a directory, not ours to list
        return None
    for n in names:
        if n.startswith(STAGING_PREFIX) and n[len(STAGING_PREFIX):].partition(".")[2] == name \
                and os.path.isfile(os.path.join(parent, n, META_DIR, MANIFEST)):
            return os.path.join(parent, n)
    return None


def _params_arg(text: str) -> int:
    """Parse a parameter count: 175e9, 175000000000, 175B, 1.2T, 7b, 350M."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    t = text.strip().replace("_", "").replace(",", "")
    mult = 1.0
    if t and t[-1].lower() in scale:
        mult, t = scale[t[-1].lower()], t[:-1]
    try:
        value = float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 175e9 or 175B)")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r}")
    return int(round(value))


def _add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="checkpoint size, bandwidth, failure and interval arithmetic",
        description="Plan checkpoint size, write/restore bandwidth, stall, and the "
                    "checkpoint interval (Young/Daly). GB = 1e9 bytes.",
    )
    m = p.add_argument_group("model (give --params, or a shape via --model-config and/or shape flags)")
    m.add_argument("--params", type=_params_arg, help="parameter count, e.g. 175e9 or 175B")
    m.add_argument("--model-config", metavar="FILE.json",
                   help="Megatron-style keys: num_layers, hidden_size, ffn_hidden_size, vocab_size "
                        "(or padded_vocab_size), num_attention_heads, num_query_groups, swiglu, "
                        "untie_embeddings_and_output_weights")
    m.add_argument("--num-layers", type=int)
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--ffn-hidden-size", type=int, help="default 4 * hidden size")
    m.add_argument("--vocab-size", type=int)
    m.add_argument("--num-attention-heads", type=int)
    m.add_argument("--num-query-groups", type=int, help="grouped-query attention groups")
    m.add_argument("--untie-embeddings", action="store_true", default=None,
                   help="separate output layer (adds vocab*hidden parameters)")
    m.add_argument("--swiglu", action="store_true", default=None, help="gated MLP (3 matrices)")

    t = p.add_argument_group("training")
    t.add_argument("--ds-config", metavar="FILE.json",
                   help="DeepSpeed config: precision from bf16.enabled/fp16.enabled, optimizer.type")
    t.add_argument("--precision", metavar="|".join(PRECISIONS), help="default bf16 (or from --ds-config)")
    t.add_argument("--optimizer", metavar="|".join(OPTIMIZERS), help="default adam (or from --ds-config)")

    lay = p.add_argument_group("parallel layout")
    lay.add_argument("--tp", type=int, default=1, help="tensor parallel (default 1)")
    lay.add_argument("--pp", type=int, default=1, help="pipeline parallel (default 1)")
    lay.add_argument("--dp", type=int, default=1, help="data parallel (default 1)")
    lay.add_argument("--gpus-per-node", type=int, default=8, help="default 8")
    lay.add_argument("--writers", default="replica", metavar="replica|balanced",
                     help="replica: one DP replica (tp*pp GPUs) writes (default); "
                          "balanced: all tp*pp*dp GPUs write")

    s = p.add_argument_group("storage (GB/s; aggregate and/or per node, at least one write figure)")
    s.add_argument("--write-gbps", type=float, help="aggregate write bandwidth")
    s.add_argument("--write-gbps-per-node", type=float, help="write bandwidth per node")
    s.add_argument("--read-gbps", type=float, help="aggregate read bandwidth")
    s.add_argument("--read-gbps-per-node", type=float, help="read bandwidth per node")

    f = p.add_argument_group("failures")
    f.add_argument("--mtbf-hours", type=float, required=True, help="MTBF per GPU, hours")
    f.add_argument("--restart-s", type=float, default=0.0,
                   help="time lost per failure to restart + restore, seconds (default 0)")

    tg = p.add_argument_group("target (at most one)").add_mutually_exclusive_group()
    tg.add_argument("--target-time", type=float, metavar="S", help="checkpoint write time, seconds")
    tg.add_argument("--target-overhead", type=float, metavar="FRACTION",
                    help="expected lost fraction, e.g. 0.01")
    tg.add_argument("--target-overhead-pct", type=float, metavar="PCT",
                    help="expected lost percent, e.g. 1")
    tg.add_argument("--target-k", type=float, metavar="K", help="checkpoints per cluster MTTF")

    st = p.add_argument_group("stall")
    st.add_argument("--mode", default="lazy", metavar="lazy|sync",
                    help="which stall sets the interval (default lazy)")
    st.add_argument("--d2h-gbps", type=float, help="pinned device-to-host GB/s per GPU")
    st.add_argument("--pcie-gen", type=int, default=5, metavar="3|4|5",
                    help="D2H default: " + ", ".join(f"gen{g} {b:g}" for g, b in PCIE_D2H_GBPS.items())
                         + " GB/s (default gen5)")
    st.add_argument("--step-time", type=float, metavar="S",
                    help="training step time; the lazy copy overlaps the next forward/backward")

    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)


# --------------------------------------------------------------------------
# Config files
# --------------------------------------------------------------------------

def _load_json(path: str, flag: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as e:
        raise CliError(f"{flag} {path}: {e.strerror or e}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CliError(f"{flag} {path}: invalid JSON: {e}")
    if not isinstance(data, dict):
        raise CliError(f"{flag} {path}: expected a JSON object")
    return data


def shape_from_model_config(cfg: dict) -> dict:
    """ModelShape keyword arguments from Megatron-style config keys."""
    out = {}
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "swiglu"):
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    vocab = cfg.get("padded_vocab_size")
    if vocab is None:
        vocab = cfg.get("vocab_size")
    if vocab is not None:
        out["vocab_size"] = vocab
    if cfg.get("num_query_groups") is not None and cfg.get("group_query_attention", True):
        out["num_query_groups"] = cfg["num_query_groups"]
    if cfg.get("untie_embeddings_and_output_weights") is not None:
        out["untie_embeddings"] = cfg["untie_embeddings_and_output_weights"]
    return out


# DeepSpeed optimizer.type -> the optimizer with the same state bytes.
_DS_OPTIMIZERS = {
    "adam": "adam", "fusedadam": "adam", "cpuadam": "adam", "deepspeedcpuadam": "adam",
    "onebitadam": "adam", "zerooneadam": "adam", "lamb": "adam", "onebitlamb": "adam",
    "adamw": "adamw", "fusedadamw": "adamw",
    "sgd": "sgd", "adagrad": "sgd",
}


def precision_from_ds_config(cfg: dict) -> Optional[str]:
    """'bf16' / 'fp16' if enabled in the DeepSpeed config, 'fp32' if neither."""
    def enabled(*keys):
        for key in keys:
            section = cfg.get(key)
            if isinstance(section, dict) and "enabled" in section:
                value = section["enabled"]
                if not isinstance(value, bool):
                    raise CliError(f"--ds-config: {key}.enabled is {value!r}; pass --precision")
                return value
        return False

    bf16, fp16 = enabled("bf16", "bfloat16"), enabled("fp16")
    if bf16 and fp16:
        raise CliError("--ds-config: both bf16 and fp16 are enabled")
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def optimizer_from_ds_config(cfg: dict) -> Optional[str]:
    """Optimizer kind from optimizer.type; None if the config has no optimizer."""
    section = cfg.get("optimizer")
    if not isinstance(section, dict) or "type" not in section:
        return None
    name = str(section["type"])
    key = name.lower().replace("_", "").replace("-", "")
    if key not in _DS_OPTIMIZERS:
        raise CliError(f"--ds-config: unknown optimizer.type {name!r}; pass --optimizer "
                       f"({'|'.join(OPTIMIZERS)})")
    return _DS_OPTIMIZERS[key]


# --------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------

_FIELD_FLAGS = {
    "params": "--params", "precision": "--precision", "optimizer": "--optimizer",
    "tp": "--tp", "pp": "--pp", "dp": "--dp", "gpus_per_node": "--gpus-per-node",
    "writers": "--writers", "storage_write_gbps": "--write-gbps",
    "storage_write_gbps_per_node": "--write-gbps-per-node", "storage_read_gbps": "--read-gbps",
    "storage_read_gbps_per_node": "--read-gbps-per-node", "mtbf_hours": "--mtbf-hours",
    "restart_s": "--restart-s", "target_checkpoint_time_s": "--target-time",
    "target_overhead_fraction": "--target-overhead", "target_checkpoints_per_failure": "--target-k",
    "mode": "--mode", "d2h_gbps": "--d2h-gbps", "pcie_gen": "--pcie-gen", "step_time_s": "--step-time",
}


def _flag_for(field: str) -> Optional[str]:
    if field.startswith("shape."):
        return "--" + field[len("shape."):].replace("_", "-") + " / --model-config"
    return _FIELD_FLAGS.get(field)


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """Build validated PlanInputs: flags override config files, which override defaults."""
    shape_kw = shape_from_model_config(_load_json(args.model_config, "--model-config")) \
        if args.model_config else {}
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "vocab_size", "num_attention_heads",
                "num_query_groups", "untie_embeddings", "swiglu"):
        if getattr(args, key) is not None:
            shape_kw[key] = getattr(args, key)
    if args.params is not None and shape_kw:
        raise CliError("give either --params or a model shape (--model-config / shape flags), not both")
    shape = None
    if shape_kw:
        try:
            shape = ModelShape(**{"num_layers": None, "hidden_size": None, "vocab_size": None, **shape_kw})
        except TypeError as e:  # a config key of the wrong kind
            raise CliError(f"--model-config: {e}")

    precision, optimizer = args.precision, args.optimizer
    if args.ds_config:
        ds = _load_json(args.ds_config, "--ds-config")
        precision = precision or precision_from_ds_config(ds)
        optimizer = optimizer or optimizer_from_ds_config(ds)

    overhead = args.target_overhead
    if args.target_overhead_pct is not None:
        if not 0 < args.target_overhead_pct < 100:  # NaN too
            raise CliError(f"target overhead must be in (0, 100) percent, got "
                           f"{args.target_overhead_pct:g} (--target-overhead-pct)")
        if args.target_overhead_pct < 1e-4:  # the fraction's floor, in the flag's unit
            raise CliError(f"target overhead must be at least 0.0001 percent, got "
                           f"{args.target_overhead_pct:g} (--target-overhead-pct)")
        overhead = args.target_overhead_pct / 100.0

    return PlanInputs(
        params=args.params, shape=shape,
        precision=precision or "bf16", optimizer=optimizer or "adam",
        tp=args.tp, pp=args.pp, dp=args.dp, gpus_per_node=args.gpus_per_node, writers=args.writers,
        storage_write_gbps=args.write_gbps, storage_write_gbps_per_node=args.write_gbps_per_node,
        storage_read_gbps=args.read_gbps, storage_read_gbps_per_node=args.read_gbps_per_node,
        mtbf_hours=args.mtbf_hours, restart_s=args.restart_s,
        target_checkpoint_time_s=args.target_time, target_overhead_fraction=overhead,
        target_checkpoints_per_failure=args.target_k,
        mode=args.mode, d2h_gbps=args.d2h_gbps, pcie_gen=args.pcie_gen, step_time_s=args.step_time,
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    try:
        plan = make_plan(inputs_from_args(args))
    except PlanInputError as e:
        flag = _flag_for(e.field)
        raise CliError(f"{e} ({flag})" if flag else str(e))
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan))
    return 0


# --------------------------------------------------------------------------
# Human-readable table
# --------------------------------------------------------------------------

def _num(x: float) -> str:
    """Three significant figures, no exponent."""
    if x == 0:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{digits}f}"


def _count(n: int) -> str:
    return f"{_num(n / 1e12)} trillion" if n >= 1e12 else f"{_num(n / 1e9)} billion"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000:
            return f"{_num(n)} {unit}"
        n /= 1000.0
    return f"{_num(n)} EB"


def fmt_duration(s: float) -> str:
    if s < 120:
        return f"{_num(s)} s"
    if s < 2 * 3600:
        return f"{_num(s / 60)} min ({s:.0f} s)"
    if s < 10 * 86400:
        return f"{_num(s / 3600)} h ({s:.0f} s)"
    return f"{_num(s / 86400)} d ({s:.0f} s)"


def fmt_gbps(x: float) -> str:
    return f"{_num(x)} GB/s"


def fmt_pct(fraction: float) -> str:
    return f"{_num(fraction * 100)} %"


def _bandwidth_given(agg: Optional[float], node: Optional[float]) -> str:
    parts = []
    if agg is not None:
        parts.append(f"{fmt_gbps(agg)} aggregate")
    if node is not None:
        parts.append(f"{fmt_gbps(node)} per node")
    return " + ".join(parts)


def _sections(plan: Plan):
    i = plan.inputs
    w = plan.weights_bytes // plan.params
    mb = plan.master_weights_bytes // plan.params
    ob = plan.optimizer_bytes // plan.params
    size = [
        ("parameters", f"{plan.params:,} ({_count(plan.params)}"
                       + (", estimated from shape)" if plan.params_estimated else ")")),
        ("bytes per parameter", f"{plan.bytes_per_param} = {i.precision} weights {w} + fp32 master {mb}"
                                f" + {i.optimizer} moments {ob}"),
        ("weights", fmt_bytes(plan.weights_bytes)),
        ("fp32 master weights", fmt_bytes(plan.master_weights_bytes)),
        ("optimizer moments", fmt_bytes(plan.optimizer_bytes)),
        ("checkpoint total", fmt_bytes(plan.total_bytes)),
    ]
    writers = [
        ("layout", f"tp {i.tp} x pp {i.pp} x dp {i.dp} = {plan.total_gpus} GPUs on "
                   f"{plan.total_nodes} nodes ({i.gpus_per_node}/node)"),
        ("writers", f"{plan.writing_gpus} GPUs on {plan.writing_nodes} nodes "
                    + ("(one DP replica)" if i.writers == "replica" else "(balanced over all DP ranks)")),
        ("bytes per writing GPU", fmt_bytes(plan.bytes_per_writing_gpu)),
        ("bytes per writing node", fmt_bytes(plan.bytes_per_writing_node) + " (busiest node)"),
    ]
    bandwidth = [
        ("storage write", _bandwidth_given(i.storage_write_gbps, i.storage_write_gbps_per_node)),
        ("write time", fmt_duration(plan.write_time_s)),
    ]
    if plan.required_checkpoint_time_s is not None:
        if plan.target == "target_checkpoint_time_s":
            label, why = "target write time", ""
        else:
            label, why = "max sync write time", f" (keeps lost <= {fmt_pct(i.target_overhead_fraction)})"
        bandwidth += [
            (label, fmt_duration(plan.required_checkpoint_time_s) + why),
            ("  needs aggregate", fmt_gbps(plan.required_write_gbps)),
            ("  needs per node", fmt_gbps(plan.required_write_gbps_per_node)),
            ("  needs per writing GPU", fmt_gbps(plan.required_write_gbps_per_gpu)),
        ]
        if plan.required_d2h_gbps is not None:
            bandwidth.append(("  needs D2H (lazy)", fmt_gbps(plan.required_d2h_gbps)))
    bandwidth += [
        ("restore reads", f"{fmt_bytes(plan.read_bytes)} (full checkpoint x dp {i.dp}), "
                          f"{fmt_bytes(plan.read_bytes_per_node)} per node"),
    ]
    if plan.restore_time_s is not None:
        bandwidth.append(("restore time", f"{fmt_duration(plan.restore_time_s)} at "
                          + _bandwidth_given(i.storage_read_gbps, i.storage_read_gbps_per_node)))

    if plan.interval_basis == "k_per_failure":
        basis = f"k = {i.target_checkpoints_per_failure:g} per failure"
    else:
        basis = {"young_daly": "Young/Daly", "write_time_floor": "write time; Young/Daly is shorter"}[
            plan.interval_basis]
    failures = [
        ("cluster MTTF", f"{fmt_duration(plan.mttf_s)}: {i.mtbf_hours:g} h / {plan.total_gpus} GPUs"),
        ("checkpoint cost C", f"{fmt_duration(plan.stall_s)}, {i.mode} stall"),
        ("Young/Daly sqrt(2CM)", fmt_duration(plan.young_daly_interval_s)),
        ("interval", f"{fmt_duration(plan.interval_s)}, {basis}"),
    ]
    if plan.save_interval_steps is not None:
        failures.append(("save interval", f"{plan.save_interval_steps} steps of {i.step_time_s:g} s"))
    failures += [
        ("checkpoints per failure", _num(plan.checkpoints_per_failure)),
        ("checkpoints per day", _num(plan.checkpoints_per_day)),
        ("written per day", fmt_bytes(plan.write_bytes_per_day)),
        ("average write bandwidth", fmt_gbps(plan.avg_write_gbps)),
        ("lost: checkpoint stalls", fmt_pct(plan.checkpoint_overhead_fraction)),
        ("lost: rework", fmt_pct(plan.rework_fraction)),
        ("lost: restarts", fmt_pct(plan.restart_fraction)),
        ("lost total", fmt_pct(plan.lost_fraction)),
    ]
    if plan.max_stall_for_target_s is not None:
        failures.append(("max C for overhead target", fmt_duration(plan.max_stall_for_target_s)))
    if plan.target_met is not None:
        failures.append(("target met", "yes" if plan.target_met else "NO"))

    step = f"{i.step_time_s:g} s step" if i.step_time_s else "no step time"
    stall = [
        ("", "lazy", "sync"),
        ("what blocks training", f"D2H copy - step ({step})", "full storage write"),
        ("copy / write time", f"{fmt_duration(plan.lazy_copy_s)} at {fmt_gbps(plan.d2h_gbps)}",
         fmt_duration(plan.write_time_s)),
        ("stall per checkpoint", fmt_duration(plan.lazy_stall_s), fmt_duration(plan.sync_stall_s)),
        ("interval (Young/Daly)", fmt_duration(plan.lazy_interval_s), fmt_duration(plan.sync_interval_s)),
        ("lost total", fmt_pct(plan.lazy_lost_fraction), fmt_pct(plan.sync_lost_fraction)),
        ("pinned host memory/node", fmt_bytes(plan.lazy_host_buffer_bytes_per_node), "-"),
    ]
    out = [("Size", size), ("Writers", writers), ("Bandwidth", bandwidth),
           ("Failures & interval", failures), ("Stall", stall)]
    return out


def format_plan(plan: Plan) -> str:
    """Aligned text table, one block per section."""
    sections = _sections(plan)
    label_w = max(len(row[0]) for _, rows in sections for row in rows)
    lines = []
    for title, rows in sections:
        if lines:
            lines.append("")
        lines.append(title)
        ncols = max(len(r) for r in rows)
        widths = [max(len(r[c]) for r in rows if len(r) > c) for c in range(1, ncols)]
        for row in rows:
            cells = [row[0].ljust(label_w)]
            for c, cell in enumerate(row[1:]):
                cells.append(cell.ljust(widths[c]) if c < len(row) - 2 else cell)
            lines.append(("  " + "   ".join(cells)).rstrip())
    if plan.warnings:
        lines += ["", "Warnings"] + [f"  - {w}" for w in plan.warnings]
    return "\n".join(lines)


# --------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "func", None) is None:
            parser.print_help(sys.stderr)
            return 2
        return args.func(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
