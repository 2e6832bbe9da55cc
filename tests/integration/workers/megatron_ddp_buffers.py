"""One rank: ``MegatronCheckpointer.save(..., model=[chunk])`` with the chunk wrapped in
megatron-core's DistributedDataParallel (as Megatron-LM's ``model`` is), the copier held until the
fence, and the buffer changed before it. Prints one JSON line: the buffer as saved."""

import json
import os
import sys
import tempfile

import _one_megatron_rank  # noqa: F401  (first: the process group, the shim, parallel state)
import torch
from _copier import hold_copier_until_fence
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from megatron_adapter.checkpointer import MegatronCheckpointer

config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)


class Chunk(MegatronModule):
    def __init__(self):
        super().__init__(config)
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("expert_bias", torch.zeros(4))


chunk = Chunk()
ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), chunk)
hold_copier_until_fence()
ckpt = MegatronCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, fsync=False))
save_dir = tempfile.mkdtemp()
state = {"bias": ShardedTensor.from_rank_offsets("bias", chunk.expert_bias, replica_id=0),
         "weight": ShardedTensor.from_rank_offsets("weight", chunk.linear.weight.detach(), replica_id=0)}
ckpt.save(state, save_dir, 1, model=[ddp])
with torch.no_grad():
    chunk.expert_bias.add_(1.0)  # finalize_model_grads, before the optimizer step's fence
ckpt.fence()
ckpt.close()
from megatron.core import dist_checkpointing  # noqa: E402

loaded = dist_checkpointing.load({"bias": ShardedTensor.from_rank_offsets("bias", torch.empty(4), replica_id=0)},
                                 os.path.join(save_dir, "iter_0000001"))
print(json.dumps({"bias": loaded["bias"].tolist(), "ddp_buffers_is_a": type(ddp.buffers).__name__}))
sys.stdout.flush()
os._exit(0)
