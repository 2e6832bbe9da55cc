"""The engine's figures of each committed save in Megatron's TensorBoard and W&B, at the
iteration it was saved at, named next to Megatron-LM's own ``save-checkpoint-time``:
``async-ckpt/save-call-ms``, ``async-ckpt/committed-s``, ... (the list:
:mod:`deepspeed_async_ckpt.core.figures`).

Rank 0 commits, so rank 0 writes them (on the engine's commit callbacks' thread). Megatron-LM
makes its writers on the last rank (``args.rank == world_size - 1``); where rank 0 does not hold
them (more than one rank):

- TensorBoard: rank 0 writes into ``--tensorboard-dir`` with a writer of its own (its event
  file beside Megatron-LM's: TensorBoard shows both in the one run);
- W&B: one process writes a W&B run, the last rank's; the figures then go to TensorBoard only
  (logged once, at the first save).

Nothing is attached without ``--tensorboard-dir`` or a writer.
"""

from __future__ import annotations

import logging
from typing import Any

from deepspeed_async_ckpt.core.figures import CommitFigures, write_to

logger = logging.getLogger(__name__)


def attach_figures(engine: Any, *, tensorboard: Any = None, wandb: Any = None,
                   tensorboard_dir: str | None = None, wandb_project: str | None = None
                   ) -> CommitFigures | None:
    """Rank 0 of a :class:`~.checkpointer.MegatronCheckpointer` ``engine``: write each committed
    save's figures through ``tensorboard`` (a ``SummaryWriter``) and ``wandb`` (what
    ``log(values, step=...)``: Megatron-LM's W&B writer), the writers this rank holds (None:
    none), or into ``tensorboard_dir`` with a writer of its own. Returns what was attached, or
    None (another rank, no writer): then nothing is written."""
    if engine.rank != 0:
        return None
    if tensorboard is None and tensorboard_dir:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard not installed: as Megatron-LM, a warning
            logger.warning("async checkpoint: --tensorboard-dir given but TensorBoard cannot be "
                           "imported (%s): no checkpoint figures written", exc)
        else:
            tensorboard = SummaryWriter(log_dir=tensorboard_dir, filename_suffix=".async-ckpt")
    if wandb is None and wandb_project:
        logger.warning("async checkpoint: the W&B run is written by another rank (Megatron-LM's "
                       "last): the checkpoint figures go to TensorBoard only")
    writers = [w for w in (tensorboard, wandb) if w is not None]
    if not writers:
        return None
    figures = CommitFigures(write_to(writers), step_of=lambda handle: int(handle.tag))
    return figures.attach(engine.checkpointer)
