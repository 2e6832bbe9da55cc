"""What a checkpoint costs a Hugging Face Trainer run under DeepSpeed: this engine against
DeepSpeed's own (``TorchCheckpointEngine``), on the same model, one rank with a spare core
(``OMP_NUM_THREADS=1``, the shape of a GPU node whose host CPUs idle while the GPUs compute).

Each engine runs in a process of its own: a GPT-2 built from its config (no download) trained by
``Trainer`` under ZeRO-1 with fp32 Adam, a checkpoint every ``--save-every`` steps. Per save
(the first left out: it faults the staging memory in), Trainer's whole ``_save_checkpoint``
(the stall), with three of its parts: ``save_model`` (Trainer's ``model.safetensors`` export:
written by Trainer with DeepSpeed's engine, by the engine's writers with this one), the
DeepSpeed checkpoint (``_save_optimizer_and_scheduler``, which is ``engine.save_checkpoint``)
and the rotation (``save_total_limit=1``: deleting the previous checkpoint, on the engine's
retention thread with this one); the steps right after a save (the first save's left out)
against the others (waiting at the fence, and the background work competing for the cores);
what a save costs the run (the stall plus the next step's extra time); and, for this engine,
the time from the save to its commit. Prints a table and writes JSON.

    PYTHONPATH=. python scripts/bench_hf_trainer.py --out docs/bench_results/hf_trainer.json
    PYTHONPATH=. python scripts/bench_hf_trainer.py --quick --out bench_out/hf_quick.json
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # this checkout's package, before an installed one
from deepspeed_async_ckpt.tools.launch import free_port  # noqa: E402

ENGINES = {"torch": "DeepSpeed TorchCheckpointEngine", "async": "this engine (async)"}


def child(args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import deepspeed_async_ckpt

    deepspeed_async_ckpt.install()
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "zero_optimization": {"stage": 1}}
    if args.engine == "async":
        ds["async_checkpoint"] = {"enabled": True}
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                                       vocab_size=8192, n_positions=128))
    tokens = torch.randint(0, 8192, (256, 64), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    targs = TrainingArguments(output_dir=args.work_dir, max_steps=args.saves * args.save_every,
                              per_device_train_batch_size=2, save_strategy="steps",
                              save_steps=args.save_every, save_total_limit=1, report_to=[],
                              logging_steps=10_000, deepspeed=ds, use_cpu=True)
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    timings: dict[str, list[float]] = {"save": [], "save_model": [], "deepspeed": [], "rotation": []}
    save_started: list[float] = []  # when each of Trainer's _save_checkpoint began

    import transformers.trainer as trainer_module

    from deepspeed_async_ckpt.bench.usage import timed

    trainer_module.rotate_checkpoints = timed(trainer_module.rotate_checkpoints, timings["rotation"].append)
    trainer._save_checkpoint = timed(trainer._save_checkpoint, timings["save"].append, save_started.append)
    # looked up per call: the engine wraps Trainer.save_model when it is built, inside train()
    trainer.save_model = timed(lambda *a, **k: type(trainer).save_model(trainer, *a, **k),
                               timings["save_model"].append)
    trainer._save_optimizer_and_scheduler = timed(trainer._save_optimizer_and_scheduler,
                                                  timings["deepspeed"].append)
    steps: list[tuple[int, float]] = []

    class Steps(TrainerCallback):
        def on_step_begin(self, a, state, c, **k):
            self.start = time.perf_counter()

        def on_step_end(self, a, state, c, **k):
            steps.append((state.global_step, time.perf_counter() - self.start))

    trainer.add_callback(Steps())
    trainer.train()
    result = {"params": sum(p.numel() for p in model.parameters()), **timings,
              "steps": steps, "save_every": args.save_every}
    engine = trainer.model_wrapped.checkpoint_engine
    if args.engine == "async":
        checkpointer = engine.checkpointer
        checkpointer.wait()
        # from the start of Trainer's save (its model export goes first, before DeepSpeed's save
        # and the engine's begin: timed from begin it reads about 3% short)
        # (the history keeps the last saves only: paired from the end)
        history = list(checkpointer.history)
        result["commit_s"] = [h.times["committed"] - t0 for h, t0 in zip(history, save_started[-len(history):])]
        result["fence_wait_s"] = [h.fence_wait_s for h in checkpointer.history]
    ckpt = os.path.join(args.work_dir, f"checkpoint-{args.saves * args.save_every}")
    result["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
    result["engine_class"] = type(engine).__name__
    return result


def summarize(name: str, raw: dict) -> dict:
    later = slice(1, None)  # the first save faults staging memory in: reported apart
    after = [t for step, t in raw["steps"] if step % raw["save_every"] == 1 and step > raw["save_every"] + 1]
    others = [t for step, t in raw["steps"] if step % raw["save_every"] not in (1,) and step > 1]
    row = {"engine": ENGINES[name], "params_m": raw["params"] / 1e6, "checkpoint_gb": raw["bytes"] / 1e9,
           "first_save_s": raw["save"][0],
           "stall_s": statistics.median(raw["save"][later]),
           "save_model_s": statistics.median(raw["save_model"][later]),
           "deepspeed_s": statistics.median(raw["deepspeed"][later]),
           "rotation_s": statistics.median(raw["rotation"][later]),
           "step_s": statistics.median(others),
           "next_step_s": statistics.median(after) if after else None}
    row["cost_s"] = None if row["next_step_s"] is None else \
        row["stall_s"] + row["next_step_s"] - row["step_s"]
    if "commit_s" in raw:
        row["commit_s"] = statistics.median(raw["commit_s"][later])
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--save-every", type=int, default=3, help="at least 2 (a step after a save, and one not)")
    p.add_argument("--quick", action="store_true", help="a tiny model, 3 saves: a smoke run")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "bench_results", "hf_trainer.json"))
    p.add_argument("--work-dir", default=None)
    p.add_argument("--engine", choices=list(ENGINES), help=argparse.SUPPRESS)  # the child
    args = p.parse_args()
    if args.quick:
        args.layers, args.hidden, args.saves, args.save_every = 2, 64, 3, 2
    if args.save_every < 2 or args.saves < 2:
        p.error("--save-every and --saves must be at least 2")
    if args.engine:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0

    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    rows, raw = [], {}
    for name in ENGINES:
        work = tempfile.mkdtemp(prefix=f"hf_{name}_", dir=args.work_dir)
        try:
            cmd = [sys.executable, os.path.abspath(__file__), "--engine", name, "--work-dir", work,
                   "--layers", str(args.layers), "--hidden", str(args.hidden),
                   "--saves", str(args.saves), "--save-every", str(args.save_every)]
            # a free port per run: a fixed one failed with EADDRINUSE beside another job
            proc = subprocess.run(cmd, env=dict(env, MASTER_PORT=str(free_port())), capture_output=True,
                                  text=True, timeout=3600)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{name}: exit code {proc.returncode}")
            raw[name] = json.loads(line[-1][len("RESULT "):])
            rows.append(summarize(name, raw[name]))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def f(x):
        return "-" if x is None else f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"

    print(f"GPT-2 {rows[0]['params_m']:.0f}M, ZeRO-1 fp32 Adam, 1 rank (OMP_NUM_THREADS=1), "
          f"checkpoint-N {rows[0]['checkpoint_gb']:.2f} GB, a save every {args.save_every} steps; medians of "
          f"saves 2-{args.saves}")
    print("| engine | Trainer's save (stall) | its save_model | its DeepSpeed save | its rotation | 1st save | "
          "step | next step | cost per save | save to commit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {f(r['stall_s'])} | {f(r['save_model_s'])} | {f(r['deepspeed_s'])} | "
              f"{f(r['rotation_s'])} | {f(r['first_save_s'])} | {f(r['step_s'])} | {f(r['next_step_s'])} | "
              f"{f(r['cost_s'])} | {f(r.get('commit_s'))} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"date": time.strftime("%Y-%m-%d"), "config": vars(args), "rows": rows, "raw": raw}, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
