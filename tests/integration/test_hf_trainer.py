"""Hugging Face Trainer with this engine (deepspeed_async_ckpt/integrations/hf_trainer/): its
save_total_limit rotation and resume_from_checkpoint=True against saves still in flight.

The in-process tests build Trainer-style output directories with the core API (a
``checkpoint-N`` save directory holding ``global_stepN`` and DeepSpeed's ``latest``) and call
transformers' own functions, wrapped; the slow ones train a tiny GPT-2 with Trainer under
DeepSpeed ZeRO-2 on 2 gloo ranks (tests/workers/hf_worker.py)."""

import contextlib
import errno
import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch

import transformers.trainer_utils as trainer_utils  # the test extra installs transformers 5.x

from deepspeed_async_ckpt import AsyncCheckpointConfig, AsyncCheckpointer, Pointer
from deepspeed_async_ckpt.commit import MANIFEST, META_DIR
from deepspeed_async_ckpt.errors import Failure, PersistError
from deepspeed_async_ckpt.integrations import activation
from deepspeed_async_ckpt.integrations.hf_trainer import beside, in_flight, rotation, trainer_methods
from deepspeed_async_ckpt.tools.launch import launch

from conftest import REPO  # noqa: E402
WORKER = os.path.join(REPO, "tests", "integration", "workers", "hf_worker.py")


@pytest.fixture(autouse=True)
def wrapped():
    """transformers.trainer_utils with this package's wrappers, for this module's tests (the
    .pth hook may have installed them already: then they stay)."""
    patched = rotation.install(trainer_utils)
    assert trainer_utils.rotate_checkpoints is rotation.rotate_checkpoints
    yield
    rotation._forget_in_child()  # no rotation at exit left over from a failed test
    if patched:
        rotation.uninstall()
        trainer_methods.uninstall()


@pytest.fixture
def fresh_trainer_methods(monkeypatch):
    """Trainer's methods that the engine wraps when it is built (trainer_methods.TRAINER_METHODS),
    as transformers has them, and restored after the test with whatever wrapped them."""
    import transformers.modeling_utils  # noqa: F401  (and the other modules, below)
    import transformers.trainer  # noqa: F401
    import transformers.trainer_jit_checkpoint  # noqa: F401

    names = set()
    for (module, owner), methods in trainer_methods.TRAINER_METHODS.items():
        cls = trainer_methods._owner(module, owner)
        for name in methods:
            names.add(name)
            monkeypatch.setattr(cls, name, trainer_methods._ORIGINALS.get(name, getattr(cls, name)))
    monkeypatch.setattr(trainer_methods, "_ORIGINALS", {k: v for k, v in trainer_methods._ORIGINALS.items() if k not in names})


class WritesHeld:
    """Checkpoint writes held until some code waits for a commit
    (``CheckpointHandle.wait_committed``): a save stays in flight unless the code under test
    waits for it (else the writes go after 60 s, or at ``released.set()``)."""

    def __init__(self) -> None:
        self.released, self.waiting = threading.Event(), threading.Event()

    def start(self) -> threading.Thread:
        """Hold (again), until the next wait; join the returned thread once it has been."""
        self.released.clear()
        self.waiting.clear()
        thread = threading.Thread(target=lambda: (self.waiting.wait(60), self.released.set()))
        thread.start()
        return thread


@pytest.fixture
def writes_held(monkeypatch):
    from deepspeed_async_ckpt.core.handle import CheckpointHandle

    held = WritesHeld()
    from deepspeed_async_ckpt.persist import writer as writer_module

    real_write, real_wait = writer_module.write_file, CheckpointHandle.wait_committed
    monkeypatch.setattr(writer_module, "write_file",
                        lambda *a, **k: (held.released.wait(60), real_write(*a, **k))[1])
    monkeypatch.setattr(CheckpointHandle, "wait_committed",
                        lambda self, timeout=None: (held.waiting.set(), real_wait(self, timeout))[1])
    yield held
    held.released.set()


@pytest.fixture
def ck():
    checkpointer = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01))
    yield checkpointer
    checkpointer.close()


def begin_save(ck, run, step):
    """What Trainer and DeepSpeed do for the save at ``step``: Trainer's own files into
    ``checkpoint-N``, then the DeepSpeed checkpoint ``global_stepN`` (left open)."""
    save_dir = os.path.join(run, f"checkpoint-{step}")
    os.makedirs(save_dir, exist_ok=True)
    with open(os.path.join(save_dir, "trainer_state.json"), "w") as f:
        json.dump({"global_step": step}, f)
    tag = f"global_step{step}"
    ck.begin(os.path.join(save_dir, tag), tag=tag, pointer=Pointer(os.path.join(save_dir, "latest"), tag))
    ck.save({"module": {"w": torch.full((8,), float(step))}},
            os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"))
    return save_dir


def committed(ck, run, step):
    save_dir = begin_save(ck, run, step)
    ck.end()
    return save_dir


def cut_short(ck, run, step):
    """A save a crash cut short: files and rank records, no manifest, no ``latest``."""
    save_dir = committed(ck, run, step)
    os.remove(os.path.join(save_dir, f"global_step{step}", META_DIR, MANIFEST))
    os.remove(os.path.join(save_dir, "latest"))
    return save_dir


def plain(run, step):
    """A checkpoint-N without this engine's checkpoints (DeepSpeed's own engine, or no DeepSpeed)."""
    save_dir = os.path.join(run, f"checkpoint-{step}")
    os.makedirs(os.path.join(save_dir, f"global_step{step}"))
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write(f"global_step{step}")
    return save_dir


def names(run):
    return sorted(n for n in os.listdir(run) if n.startswith("checkpoint-"))


def test_resume_skips_checkpoints_whose_save_never_committed(tmp_path, ck, caplog):
    """Trainer alone resumes from the highest-numbered checkpoint-N, which after a crash
    mid-persist holds no committed DeepSpeed checkpoint (DeepSpeed finds no `latest` and
    Trainer raises): with the engine it skips that one and resumes from the newest committed."""
    run = str(tmp_path)
    committed(ck, run, 2)
    cut_short(ck, run, 4)
    with caplog.at_level(logging.WARNING, logger=rotation.__name__):
        assert trainer_utils.get_last_checkpoint(run) == os.path.join(run, "checkpoint-2")
    assert "not resuming from" in caplog.text and "checkpoint-4" in caplog.text
    assert rotation._ORIGINALS["get_last_checkpoint"](run) == os.path.join(run, "checkpoint-4")

    plain(run, 6)  # not this engine's: Trainer's own judgement
    assert trainer_utils.get_last_checkpoint(run) == os.path.join(run, "checkpoint-6")
    shutil.rmtree(os.path.join(run, "checkpoint-6"))

    os.remove(os.path.join(run, "checkpoint-2", "latest"))  # committed, but DeepSpeed cannot find it
    assert trainer_utils.get_last_checkpoint(run) is None


def test_rotation_counts_committed_checkpoints_and_keeps_the_save_in_flight(tmp_path, ck):
    """save_total_limit=1: Trainer kept only the newest checkpoint-N, the one still being
    written, and deleted the last committed one."""
    run = str(tmp_path)
    committed(ck, run, 2)
    committed(ck, run, 4)
    begin_save(ck, run, 6)  # in flight (begun, not ended)
    trainer_utils.rotate_checkpoints(run, save_total_limit=1)
    assert names(run) == ["checkpoint-4", "checkpoint-6"]
    ck.end()
    rotation._rotate_at_exit()  # at exit, once the save in flight committed: done again
    assert names(run) == ["checkpoint-6"]
    assert trainer_utils.get_last_checkpoint(run) == os.path.join(run, "checkpoint-6")
    assert not rotation._deferred


@pytest.mark.parametrize("best_step", [2, 4])
def test_save_total_limit_1_keeps_only_the_best_model_at_the_end_as_trainer_does(tmp_path, ck, best_step):
    """With a best model tracked (``metric_for_best_model``) and ``save_total_limit=1``,
    Trainer's end of training deletes every checkpoint but the best one. The last save, still
    in flight then, is left out of that list; the rotation at exit deletes it once the save
    committed, so one checkpoint is left, as Trainer leaves; a best model that is the last
    save stays alone."""
    run = str(tmp_path)
    committed(ck, run, 2)
    best = os.path.join(run, f"checkpoint-{best_step}")
    begin_save(ck, run, 4)  # the last save of training, in flight
    trainer_utils.rotate_checkpoints(output_dir=run, save_total_limit=1, best_model_checkpoint=best)
    # Trainer's end of training (trainer.py: "Delete the last checkpoint when save_total_limit=1")
    for path in trainer_utils.sort_checkpoints(output_dir=run, best_model_checkpoint=best):
        if not os.path.samefile(path, best):
            shutil.rmtree(path, ignore_errors=True)
    # the one in flight left alone (and checkpoint-2 deleted where checkpoint-4 is the best)
    assert names(run) == (["checkpoint-2", "checkpoint-4"] if best_step == 2 else ["checkpoint-4"])
    ck.end()  # the exit flush commits it
    rotation._rotate_at_exit()
    assert names(run) == [f"checkpoint-{best_step}"]
    assert not rotation._deferred and not rotation._best_only_at_exit


def test_save_total_limit_1_with_the_best_model_in_flight_keeps_one_committed_checkpoint(tmp_path, ck):
    """The metric improves at every evaluation: Trainer's ``best_model_checkpoint`` is the save
    just begun, still in flight when it rotates. Named as the best, Trainer would count it among
    the checkpoints to keep although the list leaves it out, and keep two committed checkpoints
    plus the one in flight. The rotation keeps one committed and the one in flight, as with no
    best model tracked."""
    run = str(tmp_path)
    for step in (2, 4, 6, 8):
        best = begin_save(ck, run, step)
        trainer_utils.rotate_checkpoints(output_dir=run, save_total_limit=1, best_model_checkpoint=best)
        assert names(run) == [f"checkpoint-{n}" for n in (step - 2, step) if n > 0], step
        ck.end()
    rotation._rotate_at_exit()
    assert names(run) == ["checkpoint-8"]


def test_the_end_of_training_without_a_best_model_or_a_save_in_flight_changes_nothing_at_exit(tmp_path, ck):
    run = str(tmp_path)
    committed(ck, run, 2)
    begin_save(ck, run, 4)
    trainer_utils.rotate_checkpoints(output_dir=run, save_total_limit=1)
    trainer_utils.sort_checkpoints(output_dir=run)  # no best model: nothing noted
    assert not rotation._best_only_at_exit
    ck.end()
    trainer_utils.sort_checkpoints(output_dir=run, best_model_checkpoint=os.path.join(run, "checkpoint-2"))
    assert not rotation._best_only_at_exit  # nothing in flight: Trainer saw every checkpoint
    rotation._rotate_at_exit()
    assert names(run) == ["checkpoint-4"]


def test_rotation_deletes_never_committed_checkpoints_older_than_the_newest_resumable(tmp_path, ck):
    run = str(tmp_path)
    committed(ck, run, 2)
    cut_short(ck, run, 4)
    committed(ck, run, 6)
    cut_short(ck, run, 8)  # newer than every resumable one: kept until one is newer
    trainer_utils.rotate_checkpoints(run, save_total_limit=2)
    assert names(run) == ["checkpoint-2", "checkpoint-6", "checkpoint-8"]
    committed(ck, run, 10)
    trainer_utils.rotate_checkpoints(run, save_total_limit=2)
    assert names(run) == ["checkpoint-10", "checkpoint-6"]
    trainer_utils.rotate_checkpoints(run, save_total_limit=None)  # no limit: nothing deleted
    assert names(run) == ["checkpoint-10", "checkpoint-6"]


def test_rotation_deletes_only_on_evidence_and_never_the_best_model(tmp_path, ck):
    """A `latest` that cannot be read (an I/O error, a stale handle) is no evidence that the
    save never committed: kept. The best model's checkpoint, which Trainer reads at the end of
    training, is not deleted either, even if its save never committed."""
    run = str(tmp_path)
    committed(ck, run, 2)
    os.remove(os.path.join(run, "checkpoint-2", "latest"))
    os.mkdir(os.path.join(run, "checkpoint-2", "latest"))  # open() raises IsADirectoryError
    cut_short(ck, run, 4)
    cut_short(ck, run, 6)
    committed(ck, run, 8)
    assert "cannot be read" in rotation.why_not_resumable(os.path.join(run, "checkpoint-2"))
    trainer_utils.rotate_checkpoints(run, save_total_limit=1,
                                     best_model_checkpoint=os.path.join(run, "checkpoint-4"))
    assert names(run) == ["checkpoint-2", "checkpoint-4", "checkpoint-8"]


def test_what_trainer_pushes_to_the_hub_is_committed_first(tmp_path, fresh_trainer_methods, writes_held,
                                                            monkeypatch):
    """hub_strategy="checkpoint": Trainer uploads checkpoint-N in the background right after
    saving it, which with a save in flight would give the Hub a checkpoint without `latest` and
    with temporary files. The push waits for the save to commit, on the rank that pushes, when
    the push happens; with other strategies (model files only, written by Trainer itself) it
    does not wait. push_to_hub() uploads output_dir, where save_model put a DeepSpeed
    checkpoint under ZeRO-3 without gathered weights: it waits for that too, also with
    args.push_to_hub off."""
    import types

    import transformers.trainer as trainer

    pushed = []

    def state(folder):
        return [rotation.why_not_resumable(d) for d in sorted(glob.glob(folder + "/*/"))] \
            if not os.path.basename(folder).startswith("checkpoint-") else rotation.why_not_resumable(folder)

    def push_to_hub(self):  # Trainer's: save_model, then _finish_current_push, then the upload
        self._finish_current_push()
        pushed.append((self.args.output_dir, state(self.args.output_dir)))

    monkeypatch.setattr(trainer.Trainer, "_push_from_checkpoint",  # undone after, as are:
                        lambda self, folder: pushed.append((folder, state(folder))))
    monkeypatch.setattr(trainer.Trainer, "push_to_hub", push_to_hub)
    monkeypatch.setattr(trainer.Trainer, "_finish_current_push", lambda self: None)
    activation.check_installed()  # what building the engine does
    for name, wrapper in trainer_methods.TRAINER_METHODS[("transformers.trainer", "Trainer")].items():
        assert getattr(trainer.Trainer, name) is wrapper, name

    def fake_trainer(rank0=True, busy_push=False, **args):
        previous = types.SimpleNamespace(is_done=lambda: not busy_push)
        return types.SimpleNamespace(args=types.SimpleNamespace(hub_always_push=False, **args),
                                     is_world_process_zero=lambda: rank0, push_in_progress=previous,
                                     _finish_current_push=lambda: trainer.Trainer._finish_current_push(t))

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    releaser = writes_held.start()
    try:
        run = str(tmp_path)
        cases = [("every_save", True, False), ("checkpoint", False, False), ("checkpoint", True, True),
                 ("checkpoint", True, False)]
        for step, (strategy, rank0, busy_push) in enumerate(cases, start=1):
            folder = begin_save(ck, run, step)
            ck.end()
            t = fake_trainer(rank0, busy_push, hub_strategy=strategy)
            trainer.Trainer._push_from_checkpoint(t, folder)
        saving = rotation.SAVING_REASON
        # no wait: another strategy, another rank, a push Trainer skips; then the one that pushes
        assert [p[1] for p in pushed] == [saving, saving, saving, None], pushed
        releaser.join()

        for push_to_hub in (False, True):  # push_to_hub() with args.push_to_hub off, or on
            releaser = writes_held.start()
            out = os.path.join(run, f"out-{push_to_hub}")
            ck.begin(os.path.join(out, "global_step9"), tag="global_step9",
                     pointer=Pointer(os.path.join(out, "latest"), "global_step9"))
            ck.save({"w": torch.ones(4)}, os.path.join(out, "global_step9", "mp_rank_00_model_states.pt"))
            ck.end()
            t = fake_trainer(push_to_hub=push_to_hub, output_dir=out)
            trainer.Trainer._finish_current_push(t)  # the end of train(): no upload, no wait
            assert in_flight.being_saved(out)
            trainer.Trainer.push_to_hub(t)
            assert pushed[-1] == (out, [None])  # uploaded once committed
            releaser.join()
    finally:
        writes_held.released.set()
        ck.close()


def _jit_trainer(ck, run):
    """What transformers' ``CheckpointManager.execute_jit_checkpoint`` uses of Trainer: its
    ``_save_checkpoint`` saves step 7 with ``ck`` into ``run/checkpoint-7``."""
    import types

    class FakeTrainer:
        state = types.SimpleNamespace(global_step=7)
        model = None

        def _get_output_dir(self, trial):
            return run

        def _save_checkpoint(self, model, trial):
            begin_save(ck, run, 7)
            ck.end()

    return FakeTrainer


def test_a_just_in_time_checkpoint_is_marked_complete_once_committed(tmp_path, fresh_trainer_methods,
                                                                    writes_held, monkeypatch):
    """enable_jit_checkpoint: on SIGTERM Trainer saves, removes its "checkpoint-is-incomplete"
    sentinel and logs success as soon as _save_checkpoint returns, which with this engine is
    before the save is committed (a SIGKILL would leave a checkpoint marked complete that is
    not). The sentinel goes once the save has committed. transformers' own CheckpointManager
    runs."""
    from transformers.trainer_jit_checkpoint import CheckpointManager

    activation.check_installed()
    assert CheckpointManager.execute_jit_checkpoint is trainer_methods.execute_jit_checkpoint
    releaser = writes_held.start()
    run, seen = str(tmp_path), {}
    ck_async = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))

    FakeTrainer = _jit_trainer(ck_async, run)

    real_remove = os.remove

    def remove(path):  # the sentinel's removal: is the save committed by then?
        seen[os.path.basename(path)] = rotation.why_not_resumable(os.path.join(run, "checkpoint-7"))
        real_remove(path)

    monkeypatch.setattr(os, "remove", remove)
    trainer = FakeTrainer()
    try:
        CheckpointManager(trainer).execute_jit_checkpoint()
    finally:
        writes_held.released.set()
        releaser.join()
        ck_async.close()
    assert seen == {"checkpoint-is-incomplete.txt": None}
    assert "_save_checkpoint" not in vars(trainer)  # the wrapper is gone again


@pytest.fixture
def writes_fail(monkeypatch):
    """Every checkpoint file's write fails, as on a full disk."""
    from deepspeed_async_ckpt.persist import writer as writer_module

    def write_file(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module, "write_file", write_file)


def test_a_just_in_time_checkpoint_whose_save_failed_keeps_its_sentinel_and_fails(tmp_path, fresh_trainer_methods,
                                                                                   writes_fail):
    """A just-in-time save that fails is not marked complete: Trainer gets the failure, as a
    synchronous save would have raised it, so the sentinel stays and nothing logs "completed
    successfully" (training stops next: no later save would raise the error)."""
    from transformers.trainer_jit_checkpoint import CheckpointManager

    activation.check_installed()
    run = str(tmp_path)
    ck_async = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))

    FakeTrainer = _jit_trainer(ck_async, run)

    try:
        with pytest.raises(PersistError, match=r"checkpoint-7/global_step7: the save failed.*just-in-time.*No space"):
            CheckpointManager(FakeTrainer()).execute_jit_checkpoint()
        assert os.path.exists(os.path.join(run, "checkpoint-7", "checkpoint-is-incomplete.txt"))
        assert not os.path.exists(os.path.join(run, "checkpoint-7", "latest"))
    finally:
        with pytest.raises(PersistError):  # the engine's own report of it, as always
            ck_async.close()


@pytest.mark.parametrize("rank0", ["committed", "failed", "raised"])
def test_a_just_in_time_checkpoint_on_another_rank_waits_for_rank_0s_commit(tmp_path, fresh_trainer_methods, rank0):
    """Every rank runs the just-in-time checkpoint and removes the same sentinel; a rank other
    than 0 must not mark it complete once only its own part is durable, but once rank 0
    committed. With the engine of the trainer's DeepSpeed engine, the ranks share the outcome
    (``wait_all_ranks``): here rank 1 of 2, with rank 0's report stubbed in the exchange.
    ("raised": this rank's own steps of the save raised, as rank 0's Hub push of a failed save
    does: it still joins the exchange, with its error, so the others are not left waiting
    there, and raises that.)"""
    import types

    from transformers.trainer_jit_checkpoint import CheckpointManager

    from deepspeed_async_ckpt.errors import CommitError

    activation.check_installed()
    action = "marking the just-in-time checkpoint complete"
    report = {0: Failure("PersistError", "[Errno 28] No space left on device")} if rank0 == "failed" else {}
    exchanged = []

    def exchange(value, error, key=""):
        exchanged.append((value, error))
        return (value, report) if value == action else (("sid0001", False), {})

    run = str(tmp_path)
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), rank=1, world_size=2,
                           exchange=exchange)

    class FakeTrainer:
        state = types.SimpleNamespace(global_step=7)
        model = None
        is_deepspeed_enabled = True
        deepspeed = types.SimpleNamespace(checkpoint_engine=types.SimpleNamespace(checkpointer=ck))

        def _get_output_dir(self, trial):
            return run

        def _save_checkpoint(self, model, trial):
            d = os.path.join(run, "checkpoint-7")
            os.makedirs(d, exist_ok=True)
            ck.begin(os.path.join(d, "global_step7"), tag="global_step7",
                     pointer=Pointer(os.path.join(d, "latest"), "global_step7"))
            ck.save({"w": torch.ones(8)}, os.path.join(d, "global_step7", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
            ck.end()
            if rank0 == "raised":
                raise PersistError("the push of a failed save")

    sentinel = os.path.join(run, "checkpoint-7", "checkpoint-is-incomplete.txt")
    try:
        if rank0 == "failed":
            with pytest.raises(CommitError, match=r"just-in-time checkpoint complete refused.*rank\(s\) 0"):
                CheckpointManager(FakeTrainer()).execute_jit_checkpoint()
            assert os.path.exists(sentinel)
        elif rank0 == "raised":
            with pytest.raises(PersistError, match="the push of a failed save"):
                CheckpointManager(FakeTrainer()).execute_jit_checkpoint()
            assert os.path.exists(sentinel)
            assert (action, Failure("PersistError", "the push of a failed save")) in exchanged
        else:
            CheckpointManager(FakeTrainer()).execute_jit_checkpoint()
            assert not os.path.exists(sentinel)
        assert action in [value for value, _ in exchanged]
    finally:
        ck.close()


def test_push_to_hub_is_not_failed_by_an_older_checkpoints_save(tmp_path, fresh_trainer_methods, writes_fail,
                                                                monkeypatch):
    """``push_to_hub`` uploads output_dir without its checkpoint-* folders: the check before it
    counts the saves directly in output_dir, and failures not reported yet, so a checkpoint-N's
    failed save (reported by the engine, or its checkpoint deleted) does not fail the push."""
    import types

    import transformers.trainer as trainer

    pushed = []
    monkeypatch.setattr(trainer.Trainer, "push_to_hub",
                        lambda self: (self._finish_current_push(), pushed.append(self.args.output_dir)))
    monkeypatch.setattr(trainer.Trainer, "_finish_current_push", lambda self: None)
    activation.check_installed()
    run = str(tmp_path)
    t = types.SimpleNamespace(args=types.SimpleNamespace(output_dir=run))
    t._finish_current_push = lambda: trainer.Trainer._finish_current_push(t)
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    try:
        begin_save(ck, run, 2)
        ck.end()
        trainer.Trainer.push_to_hub(t)  # not reported yet, but in a checkpoint-N: not uploaded
        with pytest.raises(PersistError):
            ck.wait()  # reported
        shutil.rmtree(os.path.join(run, "checkpoint-2"))
        trainer.Trainer.push_to_hub(t)
        assert pushed == [run, run]
    finally:
        ck.close()


def test_a_push_of_a_checkpoint_whose_save_failed_fails_and_uploads_nothing(tmp_path, fresh_trainer_methods,
                                                                           writes_fail, monkeypatch):
    """hub_strategy="checkpoint" of a checkpoint-N whose save failed would upload no ``latest``,
    a partial ``global_stepN`` and a new ``trainer_state.json`` beside an older ``latest`` on
    the Hub's ``last-checkpoint``. The push, and ``push_to_hub()`` of an output_dir whose save
    failed, raise instead, as a synchronous save would have before them. A strategy that
    uploads only the model files fails on a failed weights export, and not on the DeepSpeed
    save it does not wait for."""
    import types

    import transformers.trainer as trainer

    pushed = []
    monkeypatch.setattr(trainer.Trainer, "_push_from_checkpoint", lambda self, folder: pushed.append(folder))
    monkeypatch.setattr(trainer.Trainer, "push_to_hub",
                        lambda self: (self._finish_current_push(), pushed.append(self.args.output_dir)))
    monkeypatch.setattr(trainer.Trainer, "_finish_current_push", lambda self: None)
    activation.check_installed()

    def fake_trainer(**args):
        t = types.SimpleNamespace(args=types.SimpleNamespace(hub_always_push=False, **args),
                                  is_world_process_zero=lambda: True, push_in_progress=None)
        t._finish_current_push = lambda: trainer.Trainer._finish_current_push(t)
        return t

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    run = str(tmp_path)
    try:
        for strategy in ("checkpoint", "all_checkpoints"):
            folder = begin_save(ck, run, 1 if strategy == "checkpoint" else 2)
            ck.end()
            with pytest.raises(PersistError, match=r"global_step\d: the save failed.*Trainer uploads it"):
                trainer.Trainer._push_from_checkpoint(fake_trainer(hub_strategy=strategy), folder)
            with pytest.raises(PersistError, match="No space"):
                ck.wait()  # the engine reports it too, as always
        folder = begin_save(ck, run, 3)
        ck.end()
        trainer.Trainer._push_from_checkpoint(fake_trainer(hub_strategy="every_save"), folder)  # no wait
        assert pushed == [folder]
        with pytest.raises(PersistError):
            ck.wait()

        def no_room(f):
            raise OSError(errno.ENOSPC, "No space left on device")

        folder = os.path.join(run, "checkpoint-4")
        os.makedirs(folder)
        beside.write_beside(ck, os.path.join(folder, "model.safetensors"), no_room)
        with pytest.raises(PersistError, match=r"model.safetensors: the save failed.*model files"):
            trainer.Trainer._push_from_checkpoint(fake_trainer(hub_strategy="every_save"), folder)
        with pytest.raises(PersistError):
            ck.wait()

        out = os.path.join(run, "out")
        ck.begin(os.path.join(out, "global_step9"), tag="global_step9",
                 pointer=Pointer(os.path.join(out, "latest"), "global_step9"))
        ck.save({"w": torch.ones(4)}, os.path.join(out, "global_step9", "mp_rank_00_model_states.pt"))
        ck.end()
        with pytest.raises(PersistError, match=r"global_step9: the save failed"):
            trainer.Trainer.push_to_hub(fake_trainer(push_to_hub=True, output_dir=out))
        assert pushed == [os.path.join(run, "checkpoint-3")]
    finally:
        with contextlib.suppress(PersistError):
            ck.close()


def test_with_the_engine_in_async_mode_rotation_deletes_in_the_background(tmp_path):
    """Trainer deleted the previous checkpoint on the training thread (shutil.rmtree): 0.3 s for
    1.85 GB idle, 0.6-1.0 s with the next save's writes in flight, most of what was left of its
    stall. With an async-mode checkpointer open, the directory is renamed out of Trainer's
    sight and the engine's retention thread deletes it, with what a crash left renamed;
    without one, Trainer deletes it as before."""
    from deepspeed_async_ckpt.commit import REMOVING_PREFIX

    run = str(tmp_path)
    for step in (2, 4):
        plain(run, step)
    leftover = os.path.join(run, f"{REMOVING_PREFIX}checkpoint-1.0a1b2c")  # a crash's
    os.makedirs(os.path.join(leftover, "global_step1"))
    ck_async = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    gate, real_remove = threading.Event(), ck_async.storage.remove_tree
    ck_async.storage.remove_tree = lambda path: (gate.wait(60), real_remove(path))[1]
    try:
        trainer_utils.rotate_checkpoints(output_dir=run, save_total_limit=1, use_mtime=False)
        assert names(run) == ["checkpoint-4"]  # what Trainer and resume see at once
        trash = sorted(n for n in os.listdir(run) if n.startswith(REMOVING_PREFIX))
        assert len(trash) == 2 and trash[1].startswith(f"{REMOVING_PREFIX}checkpoint-2.")
        gate.set()
        ck_async.wait()
        assert os.listdir(run) == ["checkpoint-4"]
    finally:
        gate.set()
        ck_async.close()
    plain(run, 6)
    trainer_utils.rotate_checkpoints(output_dir=run, save_total_limit=1, use_mtime=False)
    assert os.listdir(run) == ["checkpoint-6"]  # no async checkpointer open: deleted right here


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def test_a_checkpoints_weights_export_is_written_by_the_engine_and_committed_with_it(
        tmp_path, fresh_trainer_methods, monkeypatch):
    """Trainer's save_model writes model.safetensors before the DeepSpeed save begins (0.6 of
    the 1.1 s a save stalls training, for a 91M-parameter GPT-2). Inside a checkpoint's
    save_model the file goes to the engine's writers: save_pretrained returns before it is
    written, the DeepSpeed checkpoint beside it commits only once it is durable, and it holds
    the weights of the save even if training changes them meanwhile (here the model's own
    tensors, which the export copies; accelerate hands it clones)."""
    import types

    import transformers.modeling_utils as modeling_utils
    import transformers.trainer as trainer
    from safetensors.torch import load_file

    activation.check_installed()
    assert modeling_utils.safe_save_file is trainer_methods.safe_save_file
    assert trainer.Trainer.save_model is trainer_methods.save_model
    from deepspeed_async_ckpt import persist

    gate, real_write = threading.Event(), persist.write_safetensors
    monkeypatch.setattr(persist, "write_safetensors", lambda *a, **k: (gate.wait(60), real_write(*a, **k))[1])
    monkeypatch.setitem(trainer_methods._ORIGINALS, "save_model",  # Trainer's, without DeepSpeed
                        lambda self, output_dir=None, _internal_call=False: self.model.save_pretrained(output_dir))
    monkeypatch.setitem(trainer_methods._ORIGINALS, "_save_checkpoint",  # Trainer's: save_model first
                        lambda self, folder: trainer.Trainer.save_model(self, folder, _internal_call=True))
    exports, real_beside = [], beside.write_beside
    monkeypatch.setattr(beside, "write_beside",
                        lambda ck, path, write: (exports.append(path), real_beside(ck, path, write))[1])
    model = tiny_gpt2()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    ck_async = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    engine = types.SimpleNamespace(checkpoint_engine=types.SimpleNamespace(checkpointer=ck_async))
    t = types.SimpleNamespace(model=model, is_deepspeed_enabled=True, deepspeed=engine,
                              args=types.SimpleNamespace(save_only_model=False))
    run = str(tmp_path)
    folder = os.path.join(run, "checkpoint-2")
    try:
        trainer.Trainer._save_checkpoint(t, folder)
        assert os.path.exists(os.path.join(folder, "config.json"))  # Trainer's small files: as before
        assert not os.path.exists(os.path.join(folder, "model.safetensors"))
        assert rotation.why_not_resumable(folder) == rotation.SAVING_REASON  # rotation keeps it
        with torch.no_grad():
            for p in model.parameters():  # the optimizer step after the save
                p.add_(1.0)
        begin_save(ck_async, run, 2)  # the DeepSpeed checkpoint, into the same checkpoint-N
        handle = ck_async.end()
        for fut in handle.files:
            fut.result()
        assert not handle.wait_persisted(0.5)  # its own files are durable, the export is not
        gate.set()
        ck_async.wait()
        assert handle.committed
        exported = load_file(os.path.join(folder, "model.safetensors"))
        assert exported.keys() == saved.keys() - {"lm_head.weight"}  # tied to the embeddings
        for name, tensor in exported.items():
            assert torch.equal(tensor, saved[name]), name
        assert [n for n in os.listdir(folder) if ".tmp." in n] == []

        assert exports == [os.path.join(folder, "model.safetensors")]

        # not deferred: the user's own save_model (read right after it returns), save_only_model
        # (no DeepSpeed checkpoint follows), the engine in sync mode, and save_model's own
        # internal calls outside a checkpoint's save (push_to_hub, Ray Tune's
        # _tune_save_checkpoint: they upload or hand over the directory right after, so it
        # must hold its weights by then)
        for name, internal, only_model, mode, in_checkpoint in [("user", False, False, "async", True),
                                                                ("only_model", True, True, "async", True),
                                                                ("sync", True, False, "sync", True),
                                                                ("tune", True, False, "async", False)]:
            t.args.save_only_model = only_model
            ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode, host_buffer_gb=0.01))
            engine.checkpoint_engine.checkpointer = ck
            if in_checkpoint:
                monkeypatch.setitem(trainer_methods._ORIGINALS, "_save_checkpoint",
                                    lambda self, folder, internal=internal:
                                    trainer.Trainer.save_model(self, folder, _internal_call=internal))
                trainer.Trainer._save_checkpoint(t, os.path.join(run, name))
            else:
                trainer.Trainer.save_model(t, os.path.join(run, name), _internal_call=internal)
            ck.close()
            assert os.path.exists(os.path.join(run, name, "model.safetensors")), name
        assert len(exports) == 1
    finally:
        gate.set()
        ck_async.close()


def test_a_rotation_it_does_not_know_is_left_alone():
    import types

    unknown = types.SimpleNamespace(sort_checkpoints=lambda *a: [], get_last_checkpoint=lambda f: None,
                                    rotate_checkpoints=lambda folder, keep: None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rotation, "_ORIGINALS", {})
        assert not rotation.install(unknown)
        assert "rotate_checkpoints" not in rotation._ORIGINALS


@pytest.mark.parametrize("limit,best,use_mtime", [(1, None, False), (2, None, True), (1, 3, False),
                                                   (2, 1, False), (3, None, False), (0, None, False)])
def test_without_this_engine_the_wrappers_do_what_transformers_does(tmp_path, limit, best, use_mtime):
    """Directories holding no checkpoint of this engine are judged as Trainer judges them."""
    for variant in ("original", "wrapped"):
        run = tmp_path / variant
        for step in (1, 2, 3, 4, 5):
            plain(str(run), step)
            os.utime(run / f"checkpoint-{step}", (1000 + 10 * step, 1000 + 10 * step))
        (run / "checkpoint-x").mkdir()
    originals = rotation._ORIGINALS
    for variant, rotate, last in (("original", originals["rotate_checkpoints"], originals["get_last_checkpoint"]),
                                  ("wrapped", trainer_utils.rotate_checkpoints, trainer_utils.get_last_checkpoint)):
        run = str(tmp_path / variant)
        rotate(run, save_total_limit=limit, use_mtime=use_mtime,
               best_model_checkpoint=os.path.join(run, f"checkpoint-{best}") if best else None)
        assert os.path.basename(last(run)) == "checkpoint-5"
    assert names(tmp_path / "original") == names(tmp_path / "wrapped")
    assert len(names(tmp_path / "wrapped")) < 6 or limit == 0


def test_install_rebinds_names_imported_before_it_and_uninstall_restores_them(wrapped):
    import transformers.trainer as trainer

    assert trainer.get_last_checkpoint is rotation.get_last_checkpoint
    assert trainer.rotate_checkpoints is rotation.rotate_checkpoints
    assert trainer.sort_checkpoints is rotation.sort_checkpoints
    originals = dict(rotation._ORIGINALS)
    rotation.uninstall()
    try:
        assert trainer.rotate_checkpoints is originals["rotate_checkpoints"]
        assert trainer_utils.get_last_checkpoint is originals["get_last_checkpoint"]
    finally:
        assert rotation.install(trainer_utils)
    assert trainer.rotate_checkpoints is rotation.rotate_checkpoints


def test_the_engine_warns_when_trainer_is_imported_without_the_wrappers(fresh_trainer_methods, monkeypatch,
                                                                       caplog):
    monkeypatch.setattr(rotation, "_ORIGINALS", {})
    monkeypatch.setattr(activation, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=activation.__name__):
        activation.check_installed()
        activation.check_installed()
    assert caplog.text.count("save_total_limit") == 1


def test_auto_activation_wraps_trainer_utils_when_transformers_is_imported(repo_env):
    """The .pth hook (no code change in the training script); off with DS_ASYNC_CKPT_AUTOLOAD=0,
    where deepspeed_async_ckpt.install() after the import does it."""
    probe = ("import deepspeed_async_ckpt_autoload, sys\n"
             "import transformers.trainer as t\n"
             "from deepspeed_async_ckpt.integrations.hf_trainer import rotation\n"
             "print(t.rotate_checkpoints is rotation.rotate_checkpoints,"
             " t.get_last_checkpoint is rotation.get_last_checkpoint)\n"
             "if sys.argv[1] == 'install':\n"
             "    import deepspeed_async_ckpt; deepspeed_async_ckpt.install()\n"
             "    print(t.rotate_checkpoints is rotation.rotate_checkpoints,"
             " t.get_last_checkpoint is rotation.get_last_checkpoint)\n")
    runs = {
        "on": ([sys.executable, "-c", probe, "-"], repo_env),
        "off": ([sys.executable, "-c", probe, "install"], dict(repo_env, DS_ASYNC_CKPT_AUTOLOAD="0")),
    }
    out = {k: subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
           for k, (cmd, env) in runs.items()}
    assert out["on"].returncode == 0, out["on"].stderr[-2000:]
    assert out["on"].stdout.split() == ["True", "True"]
    assert out["off"].returncode == 0, out["off"].stderr[-2000:]
    assert out["off"].stdout.split() == ["False", "False", "True", "True"]


def run_trainer(repo_env, out, *args, expect):
    os.makedirs(out, exist_ok=True)
    codes = launch(WORKER, ["--out", str(out), *[str(a) for a in args]], 2, timeout=300,
                   env=repo_env, log_prefix=os.path.join(str(out), f"log{len(os.listdir(out))}"))
    assert expect(codes), f"rank exit codes {codes} for {args}; logs in {out}"


def seen(out) -> dict:
    with open(os.path.join(out, "seen.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_trainer_rotation_leaves_saves_in_flight_alone_and_every_save_commits(tmp_path, repo_env):
    """save_total_limit=1, the saves of steps 2 and 4 both still being written when Trainer
    rotates after step 4's: Trainer alone would delete checkpoint-2 under the save writing it,
    which would fail (and the job with it, at its next save); here both are kept and every save
    commits. Step 6's save is held too until Trainer has rotated after it (were it committed
    first, Trainer would rightly delete checkpoint-4, and the listing below would differ)."""
    out = tmp_path / "out"
    run_trainer(repo_env, out, "--limit", 1, "--hold-from", "2,6", "--release-at", "4,6", "--settle-at", 5,
                expect=lambda codes: codes == [0, 0])
    at = seen(out)
    assert at["4"] == {"checkpoint-2": None, "checkpoint-4": None}  # both in flight, both kept
    # committed (settled at step 5), and the newest resumable while step 6's is in flight
    # (checkpoint-2, rotated out here, may still be in the trash being deleted: a hidden name)
    assert {k: v for k, v in at["6"].items() if not k.startswith(".")} == \
        {"checkpoint-4": "global_step4", "checkpoint-6": None}
    run = out / "run"
    for name in names(run):  # every checkpoint left can be resumed from
        assert rotation.why_not_resumable(str(run / name)) is None, name
    # rotated again at exit, after the exit flush committed step 6's save: the limit holds
    assert names(run) == ["checkpoint-6"]
    # each save's model.safetensors was written by the engine, and holds that step's weights
    assert at["exports"] == [f"checkpoint-{n}/model.safetensors" for n in (2, 4, 6)]
    assert_export_holds_the_checkpoints_weights(run / "checkpoint-6", 6)


def assert_export_holds_the_checkpoints_weights(folder, step, zero3=False):
    from safetensors.torch import load_file

    if zero3:  # the weights are the fp32 partitions of every rank (fp32 training)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=f"global_step{step}")
    else:
        module = torch.load(folder / f"global_step{step}" / "mp_rank_00_model_states.pt",
                            weights_only=False)["module"]
    exported = load_file(folder / "model.safetensors")
    # lm_head.weight is tied to the embeddings (accelerate's clones untie it: then both are there)
    assert module.keys() - {"lm_head.weight"} <= exported.keys() <= module.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, module[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_killed_mid_save_with_save_total_limit_1_resumes_from_the_last_committed(tmp_path, repo_env,
                                                                                         stage):
    """Rank 0 SIGKILLed while step 4's save is still being written (save_total_limit=1): Trainer
    alone would have deleted checkpoint-2, the only committed checkpoint, and
    resume_from_checkpoint=True would pick checkpoint-4 and raise. Here checkpoint-2 is kept
    and resumed from (ZeRO-2: bitwise, the weights being whole on every rank)."""
    out = tmp_path / "out"
    flags = ["--limit", 1, "--stage", stage]
    run_trainer(repo_env, out, *flags, "--settle-at", 3, "--hold-from", 4, "--kill-at", 4,
                expect=lambda codes: codes[0] == -9)
    assert seen(out)["4"] == {"checkpoint-2": "global_step2", "checkpoint-4": None}
    run = out / "run"
    assert names(run) == ["checkpoint-2", "checkpoint-4"]
    assert not (run / "checkpoint-4" / "latest").exists()
    assert seen(out)["exports"] == ["checkpoint-2/model.safetensors", "checkpoint-4/model.safetensors"]
    assert_export_holds_the_checkpoints_weights(run / "checkpoint-2", 2, zero3=stage == 3)
    if stage == 2:
        saved = torch.load(run / "checkpoint-2" / "global_step2" / "mp_rank_00_model_states.pt",
                           weights_only=False)["module"]

    run_trainer(repo_env, out, *flags, "--resume", expect=lambda codes: codes == [0, 0])
    for rank in (0, 1):
        resumed = torch.load(out / f"resumed_rank{rank}.pt")
        assert resumed["global_step"] == 2
        if stage == 2:
            assert resumed["module"].keys() == saved.keys()
            for name, tensor in saved.items():
                assert torch.equal(resumed["module"][name], tensor), (rank, name)
    assert names(run) == ["checkpoint-6"]
    assert rotation.why_not_resumable(str(run / "checkpoint-6")) is None


def test_a_failing_adaptation_does_not_break_importing_transformers(tmp_path, repo_env):
    broken = tmp_path / "broken" / "deepspeed_async_ckpt"
    (broken / "integrations").mkdir(parents=True)
    (broken / "__init__.py").write_text("")
    (broken / "integrations" / "__init__.py").write_text("")
    (broken / "integrations" / "activation.py").write_text(
        "def adapt_trainer(module):\n    raise KeyError('rotate_checkpoints')\n")
    out = subprocess.run([sys.executable, "-c", "import transformers.trainer_utils; print('imported')"],
                         env=dict(repo_env, PYTHONPATH=f"{broken.parent}{os.pathsep}{REPO}"),
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1] == "imported", out.stderr[-2000:]
    assert "adapting transformers' Trainer to asynchronous saves failed" in out.stderr
    assert "KeyError: 'rotate_checkpoints'" in out.stderr
