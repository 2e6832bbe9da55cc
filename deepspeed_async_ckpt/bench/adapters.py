"""How the checkpoint benchmark saves with each engine, and learns when the save is durable:
this package's, DeepSpeed's torch and decoupled engines, torch DCP. Each drives the benchmark
worker's trainer: its DeepSpeed ``engine``, its ``timed`` wrapper and its ``pre_step`` hook."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

now = time.perf_counter


class Adapter:
    """How the benchmark saves, and learns when the save is durable, for one engine."""

    name = ""
    durable = True  # fsyncs before it reports completion
    note = ""

    def save(self, save_dir: str, tag: str) -> Any: ...

    def drain(self, token: Any) -> float:
        """Block until the save is complete; return the perf_counter time it completed."""

    def forget(self) -> None:
        """Drop what earlier saves left for :meth:`drain` (after a cadence drained its last)."""

    def close(self) -> None: ...

    def stats(self, token: Any) -> dict:
        return {}


def use_checkpoint_engine(ds_engine, ckpt_engine) -> None:
    """Swap engines as ``deepspeed.initialize`` would have built them (which replicas save the
    model states follows the engine): see the plugin's ``use_checkpoint_engine``."""
    from deepspeed_async_ckpt.integrations.deepspeed.patches import use_checkpoint_engine as use

    use(ds_engine, ckpt_engine)


class DeepSpeedAdapter(Adapter):
    """Any DeepSpeed ``CheckpointEngine``, saved through ``engine.save_checkpoint``."""

    def __init__(self, name: str, trainer, ckpt_engine, *, durable: bool, note: str = "") -> None:
        self.name, self.trainer, self.ckpt_engine = name, trainer, ckpt_engine
        self.durable, self.note = durable, note
        use_checkpoint_engine(trainer.engine, ckpt_engine)

    def save(self, save_dir: str, tag: str) -> Any:
        self.trainer.engine.save_checkpoint(save_dir, tag=tag)
        return now()

    def drain(self, token: Any) -> float:
        return token  # torch.save has returned: in the page cache, not fsynced

    def close(self) -> None:
        pass


class AsyncAdapter(DeepSpeedAdapter):
    """This package's engine, async or sync mode. Completion = the commit of ``latest``."""

    def __init__(self, name: str, trainer, ckpt_engine) -> None:
        mode = ckpt_engine.checkpointer.config.mode
        super().__init__(name, trainer, ckpt_engine, durable=ckpt_engine.checkpointer.config.fsync,
                         note=f"mode={mode}")
        ck = ckpt_engine.checkpointer
        ck.fence = trainer.timed(ck.fence)  # the wait at the optimizer step

    def save(self, save_dir: str, tag: str) -> Any:
        ck = self.ckpt_engine.checkpointer
        t0 = now()
        self.trainer.engine.save_checkpoint(save_dir, tag=tag)
        handle = ck.history[-1]
        box: dict = {"handle": handle, "t0": t0}

        def watch() -> None:  # blocks on events only: no CPU taken from training
            handle.wait_staged()
            box["staged"] = now()

        box["watcher"] = threading.Thread(target=watch, daemon=True)
        box["watcher"].start()
        return box

    def drain(self, token: Any) -> float:
        ck = self.ckpt_engine.checkpointer
        ck.wait()
        token["watcher"].join()
        return token["handle"].times["committed"]

    def stats(self, token: Any) -> dict:
        h = token["handle"]
        base = token["t0"]
        times = {k: round(v - base, 6) for k, v in h.times.items()}
        times["staged"] = round(token["staged"] - base, 6)
        pool = self.ckpt_engine.checkpointer.pool
        return {"engine_times_s": times, "staged_bytes": h.nbytes,
                "pool_peak_bytes": pool.peak_bytes, "pool_allocations": pool.allocations}

    def close(self) -> None:
        self.ckpt_engine.cleanup()


class DCPAdapter(Adapter):
    """``torch.distributed.checkpoint.async_save`` of the same model and optimizer tensors."""

    name = "dcp_async"

    def __init__(self, trainer, pg, partitioned: bool) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp, self.trainer, self.pg, self.partitioned = dcp, trainer, pg, partitioned
        # Pinned staging needs a CUDA build (this package's pool pins under the same condition).
        self.pinned = torch.cuda.is_available()
        self.stager = None
        if self.pinned:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                       use_async_staging=True, use_non_blocking_copy=True))
            self.note = "pinned staging (DefaultStager), thread writer, sync_files=True"
        else:
            self.note = ("CPU-only torch: no pinned memory, so DCP's default staging (a blocking "
                         "copy to new CPU tensors) and its thread writer, sync_files=True")

    def state_dict(self) -> dict:
        eng = self.trainer.engine
        # Replicated state gets the same key on every rank (DCP writes it once); ZeRO optimizer
        # partitions differ per rank, so they get per-rank keys (else DCP dedupes them).
        optim_key = f"optim_rank{dist.get_rank()}" if self.partitioned else "optim"
        return {"model": eng.module.state_dict(), optim_key: eng.optimizer.state_dict()}

    def save(self, save_dir: str, tag: str) -> Any:
        path = os.path.join(save_dir, tag)
        box: dict = {}
        result = self.dcp.async_save(self.state_dict(), checkpoint_id=path, process_group=self.pg,
                                     async_stager=self.stager)
        upload = getattr(result, "upload_completion", result)
        staging = getattr(result, "staging_completion", None)
        if staging is not None:
            self.trainer.pre_step = staging.result  # params must not change before staging ends
        upload.add_done_callback(lambda _: box.setdefault("done", now()))
        box["future"] = upload
        return box

    def drain(self, token: Any) -> float:
        token["future"].result()
        return token["done"]

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


class DecoupledAdapter(DeepSpeedAdapter):
    """DeepSpeed's ``DecoupledCheckpointEngine``: a writer subprocess; the commit (which waits
    for the subprocess to finish writing) runs at the next ``engine.step()``."""

    def __init__(self, trainer, ckpt_engine, writer_type: str) -> None:
        super().__init__("ds_decoupled", trainer, ckpt_engine, durable=False,
                         note=f"writer type={writer_type} (no fsync); commit waits at the next step")
        ce = self.ckpt_engine
        self.committed_at: list[float] = []
        orig_commit = ce.commit

        def commit(info):
            try:
                return orig_commit(info)
            finally:
                self.committed_at.append(now())

        ce.commit = trainer.timed(commit)

    def drain(self, token: Any) -> float:
        if not self.committed_at:  # no step ran since the save
            self.trainer.engine._commit_decoupled_checkpoint()
        return self.committed_at.pop()

    def forget(self) -> None:
        self.committed_at.clear()
