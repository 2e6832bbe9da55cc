"""One rank of the Hugging Face Trainer tests (started by scripts/launch.py): a tiny GPT-2 trained
by ``transformers.Trainer`` under DeepSpeed ZeRO-2 (``--stage``) with the ``async_checkpoint`` key, a
checkpoint every 2 steps into ``<out>/run/checkpoint-N``.

  --limit K       Trainer's save_total_limit
  --hold-from S   rank 0's checkpoint writes are held from the save at step S on ...
  --release-at R  ... until Trainer's on_save at step R (after its rotation), so those saves are
                  still in flight when Trainer rotates; both take comma lists, one hold window
                  per pair (2,6 and 4,6: held from step 2 to 4, and again at step 6)
  --settle-at S   rank 0 waits for its saves to commit at the end of step S
  --kill-at K     rank 0 SIGKILLs itself in on_save at step K (its held save never commits)
  --resume        train(resume_from_checkpoint=True); the weights Trainer resumed with are
                  dumped to <out>/resumed_rank{r}.pt
  --tier URL      an S3 tier (keep_last 2) reached at --endpoint; rank 0 writes, at
                  on_train_begin, ``args.to_json_string()`` to <out>/args.json (what reporting
                  integrations log) and, at the end, the checkpoints drained to <out>/drained.json
                  (and whether the config given to TrainingArguments still holds --endpoint)
  --disabled      the async_checkpoint key with enabled: false (DeepSpeed's own engine saves)

At every on_save, rank 0 records what ``<out>/run`` holds to ``<out>/seen.json``: per step, each
``checkpoint-N`` with its ``latest`` (or null), and under "exports" the files its engine was given
to write beside the checkpoints (Trainer's model.safetensors). The test module asserts on those
files.
"""

import argparse
import json
import os
import signal
import threading

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import deepspeed_async_ckpt  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=6)
p.add_argument("--limit", type=int, default=None)
p.add_argument("--hold-from", type=lambda v: [int(s) for s in v.split(",")], default=[])
p.add_argument("--release-at", type=lambda v: [int(s) for s in v.split(",")], default=[])
p.add_argument("--settle-at", type=int, default=0)
p.add_argument("--kill-at", type=int, default=0)
p.add_argument("--resume", action="store_true")
p.add_argument("--stage", type=int, default=2, help="ZeRO stage (3: 16-bit weights gathered for save_model)")
p.add_argument("--tier")
p.add_argument("--endpoint")
p.add_argument("--disabled", action="store_true")
args = p.parse_args()
if len(args.hold_from) != len(args.release_at) and args.release_at:
    p.error("--hold-from and --release-at: one release step per hold step")
RANK = int(os.environ["RANK"])
RUN = os.path.join(args.out, "run")

deepspeed_async_ckpt.install()  # a no-op where the .pth hook already did it (pip install .)

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import deepspeed_async_ckpt.persist.writer as checkpointer  # noqa: E402
from deepspeed_async_ckpt.integrations.hf_trainer import beside  # noqa: E402

exports = []
real_write_beside = beside.write_beside


def write_beside(ck, path, write):
    exports.append(os.path.relpath(path, RUN))
    return real_write_beside(ck, path, write)


beside.write_beside = write_beside
hold, released = [False], threading.Event()
if RANK == 0 and args.hold_from:
    real_write_file = checkpointer.write_file

    def held_write_file(*a, **kw):
        if hold[0]:
            released.wait()
        return real_write_file(*a, **kw)

    checkpointer.write_file = held_write_file


def listing() -> dict:
    seen = {}
    for name in sorted(os.listdir(RUN)):
        if not name.startswith("checkpoint-"):  # a rotated one being deleted meanwhile, say
            continue
        latest = os.path.join(RUN, name, "latest")
        seen[name] = open(latest).read().strip() if os.path.exists(latest) else None
    return seen


class Probe(TrainerCallback):
    def on_step_end(self, targs, state, control, **kw):
        if state.global_step in args.hold_from:
            released.clear()
            hold[0] = True  # this step's save (it follows on_step_end) and later ones
        if RANK == 0 and state.global_step == args.settle_at:
            trainer.model_wrapped.checkpoint_engine.checkpointer.wait()

    def on_save(self, targs, state, control, **kw):
        if RANK != 0:
            return
        path = os.path.join(args.out, "seen.json")
        seen = json.load(open(path)) if os.path.exists(path) else {}
        seen[str(state.global_step)] = listing()
        seen["exports"] = exports
        with open(path, "w") as f:
            json.dump(seen, f)
        if state.global_step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if state.global_step in args.release_at:
            hold[0] = False
            released.set()

    def on_train_begin(self, targs, state, control, model=None, **kw):
        if args.tier and RANK == 0:
            with open(os.path.join(args.out, "args.json"), "w") as f:
                f.write(targs.to_json_string())
        if args.resume:  # Trainer has loaded the checkpoint by now (ZeRO-3: this rank's partitions)
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            torch.save({"global_step": state.global_step, "module": weights},
                       os.path.join(args.out, f"resumed_rank{RANK}.pt"))


ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "train_batch_size": "auto", "gradient_clipping": "auto",
      "zero_optimization": {"stage": args.stage,  # no "optimizer": Trainer's torch AdamW
                            "stage3_gather_16bit_weights_on_model_save": args.stage == 3},
      "async_checkpoint": {"enabled": not args.disabled, "host_buffer_gb": 0.05, "writer_threads": 2}}
if args.tier:
    ds["async_checkpoint"]["tiers"] = [{"url": args.tier, "endpoint_url": args.endpoint, "keep_last": 2}]
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
tokens = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": row, "labels": row} for row in tokens]
targs = TrainingArguments(output_dir=RUN, max_steps=args.max_steps, per_device_train_batch_size=4,
                          learning_rate=1e-3, save_strategy="steps", save_steps=2,
                          save_total_limit=args.limit, logging_steps=1, report_to=[], deepspeed=ds,
                          use_cpu=True)  # accelerate counts the gloo ranks only with use_cpu
trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Probe()])
trainer.train(resume_from_checkpoint=True if args.resume else None)
engine_name = type(trainer.model_wrapped.checkpoint_engine).__name__
assert engine_name == ("TorchCheckpointEngine" if args.disabled else "AsyncCheckpointEngine"), engine_name
if args.tier and RANK == 0:
    drained = None
    if not args.disabled:
        trainer.model_wrapped.checkpoint_engine.cleanup()  # close: the last drain ends
        drained = trainer.model_wrapped.checkpoint_engine.checkpointer.tiers.drainers[0].drained
    with open(os.path.join(args.out, "drained.json"), "w") as f:
        json.dump({"drained": drained,
                   "given_config_kept": ds["async_checkpoint"]["tiers"][0]["endpoint_url"] == args.endpoint}, f)
print(f"rank {RANK}: trained to step {trainer.state.global_step}", flush=True)
