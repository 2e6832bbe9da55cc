"""What a checkpoint costs GPU training, measured A/B: GPT-2 24 x 1024, bf16, ZeRO-1, fused AdamW.

The model: a GPT-2 of 24 layers, width 1024, 16 heads,
sequence 1024, vocabulary 50257 (355M parameters; Hugging Face's ``GPT2LMHeadModel`` where
``transformers`` is installed, else the same architecture written out here, which the JSON
says), batch 8, bf16 under DeepSpeed ZeRO-1 with torch's fused AdamW: 14 bytes a parameter,
4.97 GB per checkpoint. Each step ends in ``torch.cuda.synchronize()``.

The measurement is ``bench_standin.py``'s: per engine, in one process, on the same model, real
saves and shams in ABBA order every ``--interval`` steps, each event against the median of the
``--base`` steps before it; mean(real) - mean(sham) with a 95% interval, the A/A floor, every
step kept, the threads beside training per event. Engines: ``torch`` (DeepSpeed's
``TorchCheckpointEngine``), ``threads`` and ``process`` (this engine, ``persist_in`` thread and
process), ``decoupled`` (DeepSpeed's decoupled writer: the configs ``bench_worker.py`` probes,
on a tiny model with the same ZeRO stage, and then one save of this model; where it fails, its
error is the result). Megatron-core's ``--async-save`` runs only inside Megatron's own training
loop (``scripts/pretrain_gpt.py``) and is not measured here; the JSON says so.

Whole ABBA blocks only, within ``--budget-s`` (each engine gets an equal share of what is
left). ``--tiny`` runs the same path on the CPU in seconds (the smoke test's).

    python scripts/bench_gpu_lost.py --out $OUT/lost.json      # about 8 minutes on an H100
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's package, before an installed one
import bench_standin  # noqa: E402
from bench_standin import Adapter, ENGINES, run_engine, table  # noqa: E402

now = time.perf_counter
LABELS = {**ENGINES, "decoupled": "DS DecoupledCheckpointEngine"}
MEGATRON_NOTE = ("not measured: megatron-core's async save (--async-save) runs inside Megatron's "
                 "training loop (scripts/pretrain_gpt.py), not under DeepSpeed")


def gpt2(torch, layers: int, width: int, heads: int, seq: int, vocab: int):
    """Hugging Face's GPT-2 where installed, else the same shapes written out: (model, source)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=seq, vocab_size=vocab)
        return GPT2LMHeadModel(cfg), "transformers.GPT2LMHeadModel"
    except ImportError:
        pass
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attn, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.attn(self.ln_1(x)).view(b, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)

        def forward(self, input_ids, labels=None):
            x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.t()  # tied, as GPT-2's head
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
            return type("Out", (), {"loss": loss})()

    return GPT(), "GPT-2 shapes written out (transformers not installed)"


class GPTLoop:
    """One training step: forward and backward of a fixed batch, DeepSpeed's step, a sync."""

    def __init__(self, engine, torch, batch: int, seq: int, vocab: int) -> None:
        self.engine, self.torch = engine, torch
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(vocab, (batch, seq), generator=g).to(engine.device)
        self.fence_waits: list[float] = []

    def step(self) -> None:
        loss = self.engine(input_ids=self.ids, labels=self.ids).loss
        self.engine.backward(loss)
        self.engine.step()
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()


def build(args):
    bench_standin._single_rank_env()
    import logging

    import torch
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    from deepspeed_async_ckpt.integrations.activation import install

    install()
    ds_logger.setLevel(logging.WARNING)
    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model, source = gpt2(torch, args.layers, args.width, args.heads, args.seq, args.vocab)
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": cuda}},
           "bf16": {"enabled": cuda}, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9,
           "checkpoint": {"tag_validation": "Ignore"},
           "async_checkpoint": {"enabled": True, **json.loads(args.async_config)}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return torch, engine, cfg, source


def decoupled(engine, root: str) -> tuple[object | None, dict]:
    """DeepSpeed's decoupled engine, probed on a tiny model (``bench_worker``'s configs, this
    ZeRO stage), then one save of this model: (the checkpoint engine or None, what happened)."""
    import bench_worker

    attempts, working, tiny = bench_worker.decoupled_engine(0, 2, 1, os.path.join(root, "probe"),
                                                            bench_worker.DECOUPLED_VARIANTS)
    info = {"attempts": attempts, "working_config": working}
    if tiny is None:
        info["error"] = f"no decoupled-writer config completes a save: {attempts[-1]['error']} (at {attempts[-1].get('failed_at')})"
        return None, info
    ckpt = tiny.checkpoint_engine
    adapter = Adapter("decoupled", engine, ckpt, root)
    try:
        adapter.event("R", "probe")
    except Exception as exc:
        info["error"] = f"this model's first save: {type(exc).__name__}: {exc}"
        return None, info
    info["tiny_engine"] = tiny  # kept alive: it owns the writer process
    return ckpt, info


def _write(path: str | None, result: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, default=str)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--interval", type=int, default=30, help="steps between events (saves further apart than a persist)")
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--base", type=int, default=15)
    p.add_argument("--events", type=int, default=20)
    p.add_argument("--engines", default="decoupled,threads,process,torch",
                   help="in this order, the last gets what the others leave of the budget")
    p.add_argument("--async-config", default="{}")
    p.add_argument("--budget-s", type=float, default=480, help="seconds for every engine together")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: the path, in seconds")
    p.add_argument("--work-dir", default=os.path.join(os.path.dirname(HERE), "bench_out", "gpu_lost"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.seq, args.vocab, args.batch = 2, 64, 2, 32, 256, 2
        args.interval, args.base, args.events = 6, 3, 4
    args.window = args.window or args.interval
    args.thread_steps = False
    engines = [e for e in args.engines.split(",") if e]
    if any(e not in LABELS for e in engines):
        p.error(f"--engines: choose from {sorted(LABELS)}")
    from deepspeed_async_ckpt.tools.launch import scratch_dir

    root = scratch_dir(args.work_dir)
    t0 = now()
    torch, engine, cfg, source = build(args)
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from deepspeed_async_ckpt.integrations.deepspeed.engine import AsyncCheckpointEngine

    ours = engine.checkpoint_engine
    loop = GPTLoop(engine, torch, args.batch, args.seq, args.vocab)
    for _ in range(3):
        loop.step()
    if ours.reservation is not None:
        ours.reservation.join()
    params = sum(q.numel() for q in engine.module.parameters())
    result = {"config": {**{k: v for k, v in vars(args).items() if k != "deadline"}, "model": source,
                         "params": params, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                         "torch": torch.__version__, "megatron_async_save": MEGATRON_NOTE},
              "engines": {}, "not_run": {}}
    for i, name in enumerate(engines):
        share = (t0 + args.budget_s - now()) / (len(engines) - i)
        args.deadline = now() + share
        info: dict = {}
        if name == "torch":
            ckpt = TorchCheckpointEngine(engine._config)
        elif name == "threads":
            ckpt = ours
        elif name == "process":
            keys = {**cfg["async_checkpoint"], "persist_in": "process"}
            ckpt = AsyncCheckpointEngine(engine._config, AsyncCheckpointConfig(**keys), zero_stage=1)
        else:
            ckpt, info = decoupled(engine, root)
            if ckpt is None:
                result["not_run"][name] = info
                print(f"{name}: {info['error']}", flush=True)
                continue
        adapter = Adapter(name, engine, ckpt, root)
        r = run_engine(adapter, loop, args)
        r["label"] = LABELS[name]
        if info:
            r["probe"] = {k: v for k, v in info.items() if k != "tiny_engine"}
        result["engines"][name] = r
        adapter.close()
        _write(args.out, result)  # each engine's figures kept, should a later one overrun
        if len(r["labels"]) < args.events:
            print(f"{name}: {len(r['labels'])} of {args.events} events within the budget", flush=True)
        print(f"{name}: done at {now() - t0:.0f} s", flush=True)
    engine.checkpoint_engine = TorchCheckpointEngine(engine._config)
    shutil.rmtree(root, ignore_errors=True)
    result["config"]["seconds"] = now() - t0
    result["checkpoint_bytes_estimate"] = 14 * params if torch.cuda.is_available() else 12 * params
    print(table(result))
    for name, info in result["not_run"].items():
        print(f"{LABELS[name]}: {info['error']}")
    print(f"megatron-core --async-save: {MEGATRON_NOTE}")
    if args.out:
        _write(args.out, result)
        print(f"wrote {args.out}")
    return 0 if result["engines"] and all(math.isfinite(r["interval_s"]) for r in result["engines"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
