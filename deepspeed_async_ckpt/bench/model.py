"""The model and data of ``scripts/ds_train.py`` (the README's training loop), shared by the
benchmarks and the DeepSpeed tests: an MLP of Linear, GELU and LayerNorm blocks, and a
deterministic batch per (step, rank)."""

from __future__ import annotations

import torch
import torch.nn as nn


def build_model(hidden: int, layers: int, pipeline_stages: int = 0):
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden)]
    blocks.append(nn.Linear(hidden, 1))
    if pipeline_stages:
        from deepspeed.pipe import PipelineModule

        return PipelineModule(layers=blocks, num_stages=pipeline_stages, loss_fn=nn.MSELoss())
    return nn.Sequential(*blocks)


def batch(step: int, rank: int, micro: int, hidden: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(micro, hidden, generator=g)
    y = x.sum(dim=1, keepdim=True).tanh()
    return x.to(dtype), y.to(dtype)
