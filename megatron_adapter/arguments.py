"""The adapter's command-line flags, for ``scripts/pretrain_gpt.py`` and Megatron-LM's
``pretrain(extra_args_provider=...)``.

``--async-ckpt``              use the engine asynchronously (without it: the same pipeline, inline,
                              unless the config file's ``mode`` says otherwise)
``--async-ckpt-config PATH``  engine settings: the DeepSpeed ``"async_checkpoint"`` schema
``--async-ckpt-writers MODE`` writer election, ``replica`` (default) or ``balanced``
"""

from __future__ import annotations

import argparse

from deepspeed_async_ckpt.config import AsyncCheckpointConfig, read_block
from deepspeed_async_ckpt.errors import ConfigError
from deepspeed_async_ckpt.tiers.config import refuse_overlap

from .election import WRITER_MODES


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the adapter's flags to ``parser`` and return it (usable as an extra_args_provider)."""
    g = parser.add_argument_group("async checkpointing (megatron_adapter)")
    g.add_argument("--async-ckpt", action="store_true",
                   help="save through the async checkpoint engine: lazy device-to-host snapshots, "
                        "background writes, atomic commit of the tracker. Without this flag the "
                        "same pipeline runs inline (synchronous save), unless the "
                        "--async-ckpt-config file sets \"mode\" (it wins either way).")
    g.add_argument("--async-ckpt-config", default=None, metavar="PATH", type=read_config_file,
                   help="JSON engine settings, the same schema as DeepSpeed's 'async_checkpoint' key "
                        "(the block itself or {\"async_checkpoint\": {...}}); \"enabled\" defaults to "
                        "true here, and false falls back to megatron-core's own dist_checkpointing.")
    g.add_argument("--async-ckpt-writers", choices=WRITER_MODES, default="replica",
                   help="which ranks write: 'replica' = one data-parallel replica writes each "
                        "(TP, PP) shard; 'balanced' = unique shards spread over all DP ranks.")
    return parser


_PARSED: dict[str, dict] = {}
"""``--async-ckpt-config`` paths read at parse time -> the block each held."""


def read_config_file(path: str) -> str:
    """The argparse ``type`` of ``--async-ckpt-config``: the file is read and checked once, when
    the flags are parsed, and refused there naming the flag, the path and the key (not at
    the first save, after that much training; a file edited or removed later changes
    nothing). Returns the path itself: ``args`` stays plain (Megatron-LM saves it in every
    checkpoint); the block is kept for :func:`config_from_args`."""
    try:
        block = read_block(path)
        AsyncCheckpointConfig.from_dict({"enabled": True, **block})
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc) if path in str(exc) else f"{path}: {exc}") from None
    _PARSED[path] = block
    return path


def config_from_args(args: argparse.Namespace) -> AsyncCheckpointConfig:
    """The engine config the flags ask for. ``enabled`` defaults to true here (the file can set
    it false); the mode is the file's ``mode`` where it sets one, else ``async`` with
    ``--async-ckpt`` and ``sync`` without (a file's ``"mode": "async"`` was overridden to sync
    without the flag, while its ``"sync"`` won over the flag). A tier that is, contains or lies
    inside ``--save`` or ``--load`` is refused here (ConfigError), before the engine is built."""
    path = getattr(args, "async_ckpt_config", None)
    raw = {"enabled": True, "mode": "async" if getattr(args, "async_ckpt", False) else "sync"}
    if path:  # as parsed (not read again at each save), or a path set on args by other code
        raw.update(_PARSED[path] if path in _PARSED else read_block(path))
    try:
        config = AsyncCheckpointConfig.from_dict(raw)
        for flag in ("save", "load"):  # the checkpoint directories, known from here on
            if config.enabled and getattr(args, flag, None):
                refuse_overlap(config.tiers, getattr(args, flag),
                               what=f"the checkpoint directory (--{flag})")
        return config
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}" if path else str(exc)) from None
