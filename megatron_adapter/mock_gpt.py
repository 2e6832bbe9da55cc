"""GPT pretraining with megatron-core on mock tokens, checkpointing through ``megatron_adapter``.

    torchrun --nproc_per_node 4 scripts/pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 32 --vocab-size 128 --micro-batch-size 2 \\
        --global-batch-size 4 --train-iters 100 --lr 1e-3 --use-distributed-optimizer \\
        --save ckpt --save-interval 50 --load ckpt \\
        --async-ckpt [--async-ckpt-config configs/megatron_async.json]

A real megatron-core loop: ``GPTModel`` (local layer spec), megatron's DDP and optimizer
(``--use-distributed-optimizer`` for the distributed one), ``OptimizerParamScheduler``, the
pipeline schedule from ``get_forward_backward_func``. Flags use Megatron-LM's names for what is
supported. Checkpoints are megatron-core ``torch_dist`` directories ``<save>/iter_NNNNNNN`` with
``latest_checkpointed_iteration.txt``, as Megatron-LM writes them.

``--async-ckpt`` saves asynchronously; without it the same pipeline runs inline. A config file
with ``"enabled": false`` saves with megatron-core's own ``dist_checkpointing.save`` instead.

Without CUDA (CI) the script runs on CPU with gloo: it then applies ``tests/megatron_cpu_shim.py``
first (only when ``torch.cuda.is_available()`` is false), which redirects the few ``torch.cuda``
calls megatron-core makes unconditionally; so do the tests' ranks that import this module. Run
one process per rank (``torchrun`` or ``scripts/launch.py``); ``--log-json`` writes one JSON
line per event (losses, saves). ``scripts/pretrain_gpt.py`` runs :func:`main`; the tests' ranks
build the same model, optimizer and state dict from the functions here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

from deepspeed_async_ckpt.commit import verify_file
from deepspeed_async_ckpt.errors import IntegrityError
from deepspeed_async_ckpt.tools.launch import NON_NEGATIVE, POSITIVE

from . import compat
from .arguments import add_arguments, config_from_args
from .checkpointer import MegatronCheckpointer, checkpoint_dir, read_tracker, tracker_path
from .monitor import attach_figures


# ---------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("parallelism (Megatron-LM names)")
    g.add_argument("--tensor-model-parallel-size", type=POSITIVE, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=POSITIVE, default=1)
    g.add_argument("--context-parallel-size", type=POSITIVE, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=POSITIVE, default=4)
    g.add_argument("--hidden-size", type=POSITIVE, default=64)
    g.add_argument("--ffn-hidden-size", type=POSITIVE, default=None)
    g.add_argument("--num-attention-heads", type=POSITIVE, default=4)
    g.add_argument("--seq-length", type=POSITIVE, default=32)
    g.add_argument("--max-position-embeddings", type=POSITIVE, default=None)
    g.add_argument("--vocab-size", type=POSITIVE, default=128, help="mock-data vocabulary")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   default="learned_absolute")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--transformer-impl", choices=("local",), default="local")
    g.add_argument("--mock-data", action="store_true", help="accepted; the data is always mock tokens")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=POSITIVE, default=2)
    g.add_argument("--global-batch-size", type=POSITIVE, default=None)
    g.add_argument("--train-iters", type=POSITIVE, required=True)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    g.add_argument("--lr-warmup-iters", type=NON_NEGATIVE, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=POSITIVE, default=1)
    g = p.add_argument_group("checkpointing (Megatron-LM names)")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=POSITIVE, default=None)
    g.add_argument("--save-retain-interval", type=POSITIVE, default=None,
                   help="as in Megatron-LM: keep every N-th iteration's checkpoint and the newest, "
                        "remove the others once the tracker moved")
    g.add_argument("--load", default=None)
    g.add_argument("--ckpt-step", type=NON_NEGATIVE, default=None, help="load this iteration, not the tracker's")
    g.add_argument("--ckpt-format", choices=("torch_dist",), default="torch_dist")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--ckpt-assume-constant-structure", action="store_true",
                   help="validate the sharding of the first save only")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="accepted: the distributed optimizer is always saved fully reshardable here")
    g = p.add_argument_group("logging (Megatron-LM names)")
    g.add_argument("--tensorboard-dir", default=None,
                   help="TensorBoard event files: the loss (last rank, as Megatron-LM) and each "
                        "committed save's async-ckpt/... figures (rank 0)")
    g.add_argument("--wandb-project", default=None, help="a W&B run (last rank, as Megatron-LM)")
    g.add_argument("--wandb-exp-name", default=None)
    g = p.add_argument_group("this script")
    g.add_argument("--log-json", default=None, metavar="PATH", help="append JSON-lines events")
    add_arguments(p)
    args = p.parse_args(argv)
    # megatron-core's scheduler asserts these after the process group and the model are built,
    # naming no flag: refused here at parse, naming the flag
    if args.lr_warmup_iters >= args.train_iters:
        p.error(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be below --train-iters ({args.train_iters})")
    if args.min_lr > args.lr:
        p.error(f"--min-lr ({args.min_lr:g}) must not exceed --lr ({args.lr:g})")
    if args.context_parallel_size != 1:
        p.error("--context-parallel-size > 1 needs Transformer Engine attention; this script "
                "uses the local layer spec")
    return args


# ---------------------------------------------------------------------------------- setup
def init_distributed(args: argparse.Namespace) -> None:
    from megatron.core import parallel_state as ps

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                 context_parallel_size=args.context_parallel_size)
    args.data_parallel_size = ps.get_data_parallel_world_size()
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                         f"micro batch x DP = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step


def set_seeds(seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # Same seed on every rank: replicated parameters (layer norms, TP-replicated biases) must
    # start equal; megatron's tracker then gives TP ranks distinct streams for sharded init.
    random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build_model(args: argparse.Namespace):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        bf16=args.bf16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available())
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=args.vocab_size,
                   max_sequence_length=args.max_position_embeddings or args.seq_length,
                   pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                   share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                   position_embedding_type=args.position_embedding_type)
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    # As Megatron-LM: bf16 weights, fp32 inputs/outputs at the model boundary.
    module = Float16Module(config, gpt) if args.bf16 else gpt
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               use_distributed_optimizer=args.use_distributed_optimizer)
    return DistributedDataParallel(config, ddp_config, module), gpt, config


def build_optimizer(args: argparse.Namespace, ddp_model, config):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(opt_config, [ddp_model])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr,
        min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.train_iters * args.global_batch_size, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=1,
        wd_incr_style="constant")
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return optimizer, scheduler


# ---------------------------------------------------------------------------------- data
def mock_batch(args: argparse.Namespace, iteration: int, microbatch: int) -> dict[str, torch.Tensor]:
    """Arithmetic sequences mod the vocabulary, a pure function of (seed, iteration, microbatch,
    DP rank): resuming at any iteration sees exactly the data a straight run would."""
    from megatron.core import parallel_state as ps

    g = torch.Generator().manual_seed(
        hash((args.seed, iteration, microbatch, ps.get_data_parallel_rank())) % (2**63))
    b, s = args.micro_batch_size, args.seq_length
    start = torch.randint(0, args.vocab_size, (b, 1), generator=g)
    step = torch.randint(1, 8, (b, 1), generator=g)
    tokens = (start + step * torch.arange(s + 1)) % args.vocab_size
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return {"tokens": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device),
            "position_ids": torch.arange(s, device=device).expand(b, s)}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token_loss: torch.Tensor):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


# ---------------------------------------------------------------------------------- state
def sharded_metadata(args: argparse.Namespace) -> dict[str, Any]:
    """Megatron-LM's content metadata (``_build_sharded_state_dict_metadata``): recorded in the
    checkpoint, and read back on load to rebuild the same optimizer layout."""
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        # The format that reshards along TP, PP and DP (Megatron-LM's default, dp_reshardable,
        # only along DP).
        metadata["distrib_optim_sharding_type"] = "fully_reshardable"
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return metadata


def rng_state_object(args: argparse.Namespace):
    """The RNG states as one ShardedObject per (PP, TP) coordinate, as Megatron-LM saves them."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state(),
             "cuda_rng_state": torch.cuda.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return ShardedObject("rng_state", [state],
                         (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def state_dict_for(args, gpt, optimizer, scheduler, iteration: int, *, metadata: dict,
                   is_loading: bool = False, with_optim: bool = True, with_rng: bool = True) -> dict:
    """Megatron-LM's ``generate_state_dict`` for the torch_dist format."""
    from megatron.core import parallel_state as ps

    metadata = dict(metadata, dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))
    state = {"args": argparse.Namespace(**{k: v for k, v in vars(args).items()
                                           if isinstance(v, (int, float, str, bool, type(None)))}),
             "checkpoint_version": 3.0, "iteration": iteration,
             "num_floating_point_operations_so_far": 0}
    state["model"] = gpt.sharded_state_dict(metadata=metadata)
    if with_optim:
        if is_loading:
            compat.materialize_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = rng_state_object(args)
    return state


def save_checkpoint(args, ckpt: MegatronCheckpointer | None, gpt, optimizer, scheduler,
                    iteration: int, validate: bool):
    metadata = sharded_metadata(args)
    state = state_dict_for(args, gpt, optimizer, scheduler, iteration, metadata=metadata,
                           with_optim=not args.no_save_optim)
    if ckpt is not None:
        return ckpt.save(state, args.save, iteration, content_metadata=metadata,
                         validate_access_integrity=validate, model=gpt)
    # "enabled": false: megatron-core's own synchronous save, then the tracker, as Megatron-LM.
    from megatron.core import dist_checkpointing

    ckpt_dir = checkpoint_dir(args.save, iteration)
    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, ckpt_dir, content_metadata=metadata,
                            validate_access_integrity=validate)
    if dist.get_rank() == 0:
        # --save-retain-interval as Megatron-LM applies it: once the tracker moved, the
        # checkpoint it named before goes unless its iteration is a multiple of N (read from
        # the tracker, as Megatron-LM does: the one a resumed run started from goes too, not
        # only this run's own previous save)
        previous = None
        if args.save_retain_interval:
            try:
                previous = read_tracker(args.save)
            except IntegrityError:  # Megatron-LM's "release", or a torn write: nothing to remove
                previous = None
        with open(tracker_path(args.save), "w", encoding="utf-8") as f:
            f.write(str(iteration))
        if args.save_retain_interval and previous is not None and previous != iteration \
                and previous % args.save_retain_interval:
            shutil.rmtree(checkpoint_dir(args.save, previous), ignore_errors=True)
    dist.barrier()
    return None


def load_checkpoint(args, ckpt: MegatronCheckpointer | None, gpt, optimizer, scheduler) -> int:
    """Load ``--ckpt-step`` or the tracker's iteration from ``--load``; returns the iteration
    (0 when there is nothing to load). Layout changes (TP/PP/DP) are resharded on load; RNG
    states are then not restored, as in Megatron-LM. With the memory tier on, the node
    keeper's checkpoint is read instead where it is newer than ``--load``'s (laid out on tmpfs
    for this load, removed after), as the Megatron-LM hook does."""
    if ckpt is not None:  # collective; rank 0 finishes a re-save a crash cut short
        ckpt.wait(recover=args.load)
    memory = ckpt.restore_from_memory(args.load, args.ckpt_step) if ckpt is not None else None
    if memory is None:
        return _load_from(args.load, args, ckpt, gpt, optimizer, scheduler)
    try:
        iteration = _load_from(memory.load_dir, args, ckpt, gpt, optimizer, scheduler)
        dist.barrier()  # every rank of the node read its copy before it goes
    finally:
        memory.close()
    return iteration


def _load_from(load_dir: str, args, ckpt: MegatronCheckpointer | None, gpt, optimizer, scheduler) -> int:
    from megatron.core import dist_checkpointing, tensor_parallel

    iteration = args.ckpt_step if args.ckpt_step is not None else read_tracker(load_dir)
    if iteration is None:
        return 0
    ckpt_dir = checkpoint_dir(load_dir, iteration)
    if ckpt is not None and ckpt.config.verify_on_load:  # read before ckpt.load checks the rest
        verify_file(os.path.join(ckpt_dir, "common.pt"))
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    metadata = common.get("content_metadata") or sharded_metadata(args)
    saved = common.get("args")
    same_grid = saved is None or (
        getattr(saved, "tensor_model_parallel_size", None) == args.tensor_model_parallel_size
        and getattr(saved, "pipeline_model_parallel_size", None) == args.pipeline_model_parallel_size)
    with_rng = same_grid and not args.no_load_rng
    # A checkpoint saved with --no-save-optim has neither optimizer tensors nor scheduler state.
    with_optim = not args.no_load_optim and "opt_param_scheduler" in common
    request = state_dict_for(args, gpt, optimizer, scheduler, iteration, metadata=metadata,
                             is_loading=True, with_optim=with_optim, with_rng=with_rng)
    for key in ("opt_param_scheduler", "args", "iteration", "checkpoint_version",
                "num_floating_point_operations_so_far"):
        request.pop(key, None)  # plain values come from common.pt
    if ckpt is not None:
        state = ckpt.load(request, ckpt_dir)
    else:
        state = dist_checkpointing.load(request, ckpt_dir)
    gpt.load_state_dict(state["model"])
    if with_optim:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        # the optimizer's fp32 main copies (--bf16) still hold the initial weights: its first
        # step would copy them back over the loaded ones, as Megatron-LM avoids the same way
        # (without this, a --bf16 resume without the optimizer restarts from the initial weights)
        optimizer.reload_model_params()
    if with_rng:
        rng = state["rng_state"][0]
        random.setstate(rng["random_rng_state"])
        torch.set_rng_state(rng["torch_rng_state"])
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda_rng_state"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])
    return int(state["iteration"])


def writers(args: argparse.Namespace) -> tuple[Any, Any]:
    """Megatron-LM's TensorBoard and W&B writers: on the last rank, None elsewhere."""
    if dist.get_rank() != dist.get_world_size() - 1:
        return None, None
    tensorboard = wandb = None
    if args.tensorboard_dir:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise SystemExit(f"--tensorboard-dir: TensorBoard cannot be imported ({exc}): "
                             "pip install tensorboard") from None
        tensorboard = SummaryWriter(log_dir=args.tensorboard_dir)
    if args.wandb_project:
        try:
            import wandb
        except ImportError as exc:
            raise SystemExit(f"--wandb-project: W&B cannot be imported ({exc}): pip install wandb") from None
        wandb.init(project=args.wandb_project, name=args.wandb_exp_name, config=vars(args))
    return tensorboard, wandb


# ---------------------------------------------------------------------------------- loop
def main(argv: list[str] | None = None, storage=None) -> int:
    """Train (every rank; without CUDA, the CPU shim applied first: see the module's
    docstring); ``storage`` (tests) is handed to the engine (a fault-injecting Storage)."""
    args = parse_args(argv)
    init_distributed(args)
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    compat.install()  # megatron-core 0.16 + torch Adam: optimizer-load fixes, see the module
    set_seeds(args.seed)
    ddp_model, gpt, config = build_model(args)
    optimizer, scheduler = build_optimizer(args, ddp_model, config)
    cfg = config_from_args(args)
    def saved(iteration: int, info: Any) -> None:  # rank 0, once the tracker names it
        emit(event="saved", iteration=iteration, seconds=info.seconds, bytes=info.bytes, files=info.files)

    ckpt = MegatronCheckpointer(cfg, writers=args.async_ckpt_writers, storage=storage,
                                retain_interval=args.save_retain_interval,
                                on_saved=saved) if cfg.enabled else None
    rank = dist.get_rank()
    log = open(args.log_json, "a", encoding="utf-8") if args.log_json else None
    tensorboard, wandb = writers(args)
    if ckpt is not None:  # rank 0: each commit's figures, beside the loss (see megatron_adapter.monitor)
        attach_figures(ckpt, tensorboard=tensorboard, wandb=wandb, tensorboard_dir=args.tensorboard_dir,
                       wandb_project=args.wandb_project)

    # One line on stdout per step (from the last rank, on the last pipeline stage), save, saved
    # checkpoint (the tracker moved: in the background with --async-ckpt) and resume (rank 0),
    # as Megatron-LM prints its iterations; every event in --log-json.
    says = {"step": rank == dist.get_world_size() - 1, "save": rank == 0, "saved": rank == 0,
            "resumed": rank == 0}

    def emit(**event: Any) -> None:
        if log is not None:
            log.write(json.dumps(dict(rank=rank, **event)) + "\n")
            log.flush()
        if says.get(event["event"]):
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in event.items() if v is not None), flush=True)

    iteration = 0
    if args.load:
        iteration = load_checkpoint(args, ckpt, gpt, optimizer, scheduler)
        if iteration:
            emit(event="resumed", iteration=iteration)
    forward_backward = get_forward_backward_func()
    last_saved = iteration if args.load else None
    validate = True
    reserved = False
    try:
        while iteration < args.train_iters:
            t0 = time.perf_counter()
            ddp_model.zero_grad_buffer()
            optimizer.zero_grad()
            batches = iter([mock_batch(args, iteration, m) for m in range(args.num_microbatches)])
            losses = forward_backward(forward_step_func=forward_step, data_iterator=batches,
                                      model=[ddp_model], num_microbatches=args.num_microbatches,
                                      seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                      forward_only=False)
            t_fence = time.perf_counter()
            if ckpt is not None:
                ckpt.fence()  # the last save's lazy copies must be done before weights change
            fence_s = time.perf_counter() - t_fence
            ok, grad_norm, _ = optimizer.step()
            scheduler.step(increment=args.global_batch_size)
            iteration += 1
            if ckpt is not None and args.save and not reserved:
                # After the first step (the optimizer state exists now): the host pool faulted
                # in, in the background, before the first save needs it.
                state = state_dict_for(args, gpt, optimizer, scheduler, iteration,
                                       metadata=sharded_metadata(args), with_optim=not args.no_save_optim)
                emit(event="reserve", iteration=iteration, bytes=ckpt.reserve(state))
                reserved = True
                del state
            if ps.is_pipeline_last_stage() and iteration % args.log_interval == 0:
                loss = sum(float(x["lm loss"]) for x in losses) / max(len(losses), 1)
                emit(event="step", iteration=iteration, loss=loss, grad_norm=float(grad_norm or 0),
                     step_s=time.perf_counter() - t0, fence_s=fence_s)
                if tensorboard is not None:
                    tensorboard.add_scalar("lm loss", loss, iteration)
                if wandb is not None:
                    wandb.log({"lm loss": loss}, step=iteration)
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                record = save_checkpoint(args, ckpt, gpt, optimizer, scheduler, iteration, validate)
                validate = not args.ckpt_assume_constant_structure
                last_saved = iteration
                emit(event="save", iteration=iteration,
                     blocked_s=record.blocked_s if record else None,
                     items=len(record.files) if record else None,
                     files=len({f["path"] for f in record.files}) if record else None,
                     staged_bytes=ckpt.staged_bytes if ckpt else None)
        if args.save and last_saved != iteration:
            save_checkpoint(args, ckpt, gpt, optimizer, scheduler, iteration, validate)
        if ckpt is not None:
            ckpt.wait()  # collective: every rank knows the last checkpoint is committed
            # only now: a save's lazy copies take their pool buffers after it returns
            emit(event="pool", iteration=iteration, pooled_bytes=ckpt.checkpointer.pooled_bytes,
                 pool_allocations=ckpt.checkpointer.pool.allocations)
    finally:
        if ckpt is not None:
            ckpt.close()
    emit(event="done", iteration=iteration)
    if log is not None:
        log.close()
    if tensorboard is not None:
        tensorboard.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0

