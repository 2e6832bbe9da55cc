"""``ds-async-ckpt plan``: the capacity planner's inputs from flags and config files (a
Megatron-style model config, a DeepSpeed config), the plan, and its report (:mod:`.plan_report`)
or ``--json``. Flags override config files, which override defaults; an invalid input is an
error naming its flag.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Optional

from .capacity import ModelShape, PlanInputError, PlanInputs, make_plan
from .errors import CliError
from .formulas import OPTIMIZERS, PCIE_D2H_GBPS, PRECISIONS
from .plan_report import format_plan


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


def add_parser(sub) -> None:
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

    mem = p.add_argument_group("memory tier (async_checkpoint.memory: every save in host memory, "
                               "every persist_every-th also on disk)")
    mem.add_argument("--memory", action="store_true",
                     help="plan the memory tier: two intervals, persist_every, work lost per failure "
                          "with and without it")
    mem.add_argument("--memory-survives", type=float, default=0.3, metavar="FRACTION",
                     help="share of failures that leave the node's host memory to restart from "
                          "(default 0.3, from Llama 3's interruptions: docs/planning.md)")
    mem.add_argument("--memory-keep-last", type=int, default=2, metavar="N",
                     help="memory checkpoints each node's keeper holds (default 2)")
    mem.add_argument("--memory-save-s", type=float, metavar="S",
                     help="training time a memory save costs (default: the lazy stall + 0.05 s of save call)")
    mem.add_argument("--disk-save-s", type=float, metavar="S",
                     help="training time a disk save costs, counted whole (the lost time per checkpoint "
                          "scripts/bench_gpu_lost.py measures; default: the --mode stall + 0.05 s)")
    mem.add_argument("--memory-restart-s", type=float, metavar="S",
                     help="time lost per failure restarting from memory (no storage read; default --restart-s)")
    mem.add_argument("--host-memory-gb", type=float, metavar="GB",
                     help="host memory per node: warn when the keeper and the pinned pool need more")

    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


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
    "memory_survives_fraction": "--memory-survives", "memory_keep_last": "--memory-keep-last",
    "memory_save_s": "--memory-save-s", "disk_save_s": "--disk-save-s",
    "memory_restart_s": "--memory-restart-s", "host_memory_gb_per_node": "--host-memory-gb",
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
        memory=args.memory, memory_survives_fraction=args.memory_survives,
        memory_keep_last=args.memory_keep_last, memory_save_s=args.memory_save_s,
        disk_save_s=args.disk_save_s, memory_restart_s=args.memory_restart_s,
        host_memory_gb_per_node=args.host_memory_gb,
    )


def run(args: argparse.Namespace) -> int:
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
