"""The snapshot stager (``deepspeed_async_ckpt.snapshot.stager``): lazy and eager copies,
fences on any thread, tensors changed before their copy failing the save, staging
errors raised once."""

import io
import os
import threading
import time

import pytest
import torch

from deepspeed_async_ckpt.commit import Pointer, read_manifest, verify_checkpoint
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import AsyncCheckpointError, PersistError, SnapshotError

from _compare import assert_same

from helpers import make, sample_state, save_one, the_next_save_commits_and_closes, torch_save_reference


@pytest.fixture
def records_reach_the_copier(monkeypatch):
    """A record larger than the pool let through ``save``'s refusal, for this test only: a
    staging error from the copier itself, which tests of its reporting need."""
    from deepspeed_async_ckpt.core.files import SaveFiles
    monkeypatch.setattr(SaveFiles, "_check_fits_pool", lambda self, plans: None)


def test_lazy_tensors_are_frozen_at_the_fence_and_eager_ones_at_save(tmp_path):
    state = sample_state()
    expected = torch.load(torch_save_reference(tmp_path, state), weights_only=True)
    ck = make()
    save_one(ck, str(tmp_path), state)
    # mutated right after save returns: host-resident client state must not be torn in
    state["client"].add_(100)
    state["global_steps"] = 99
    ck.fence()  # the optimizer step may run only after this
    state["module"]["w"].add_(1.0)
    state["optimizer"]["state"][0]["step"].add_(1)
    ck.wait()
    assert_same(torch.load(tmp_path / "t1" / "model.pt", weights_only=True), expected)
    ck.close()


@pytest.mark.parametrize("cuda", [False, True], ids=["no_cuda", "cuda_host_sources"])
def test_fence_copies_from_the_back_while_a_slow_copier_works_from_the_front(tmp_path, monkeypatch, cuda):
    """A training thread blocked at the fence copies tensors in host memory too, without CUDA
    or beside it (ZeRO-Offload's optimizer state; on an H100 the fence only waited, as for
    CUDA tensors). The copier is held on its first item here: the fence copies every other one
    itself, the copier then finishes its item and finds the rest taken, and the file holds the
    values of save time although the "optimizer" changed every tensor right after the fence."""
    from deepspeed_async_ckpt.snapshot import Stager

    real_copy, release, timed_out = Stager._copy, threading.Event(), []

    def copy(self, item, ready=None):
        if threading.current_thread().name == "async-ckpt-copier" and not release.is_set():
            if not release.wait(10):
                timed_out.append(item.key)
        return real_copy(self, item, ready)

    monkeypatch.setattr(Stager, "_copy", copy)
    torch.manual_seed(3)
    state = {f"w{i}": torch.randn(128, 128) for i in range(8)}
    expected = {k: v.clone() for k, v in state.items()}
    ck = make()
    if ck._files.stager.use_cuda != cuda:  # the other machine's stager
        if cuda:  # as with CUDA, its stream never used (host sources only)
            monkeypatch.setattr(torch.cuda, "Stream", lambda: object())
            monkeypatch.setattr(Stager, "ready_event", lambda self: None)
        ck._files.stager.close()
        ck._files.stager = Stager(ck.pool, use_cuda=cuda)
    save_one(ck, str(tmp_path), state, eager=())
    others = 7 * 128 * 128 * 4
    watcher = threading.Thread(target=lambda: (
        [time.sleep(0.01) for _ in range(1000) if ck._files.stager.fence_copied_bytes < others],
        release.set()))
    watcher.start()
    ck.fence()
    watcher.join()
    for v in state.values():  # the optimizer step
        v.add_(1.0)
    ck.wait()
    ck.close()
    assert not timed_out, "the fence left every copy to the copier"
    assert ck._files.stager.fence_copied_bytes == others
    assert_same(torch.load(tmp_path / "t1" / "model.pt", weights_only=True), expected)


def test_a_strided_record_changed_before_its_copy_fails_the_save(tmp_path, held_copier):
    """A tensor recorded by its storage span is checked for in-place changes as any other."""
    weight = torch.zeros(8, 16).t()
    ck = make()
    held_copier.clear()
    ck.begin(str(tmp_path / "t"), tag="t")
    ck.save({"w": weight}, str(tmp_path / "t" / "m.pt"))
    ck.end()
    weight.add_(1)  # without fence_all()
    with pytest.raises(SnapshotError, match="changed in place after the save"):
        ck.fence()
    with pytest.raises(PersistError):
        ck.wait()
    ck.close()


def test_a_save_whose_staging_failed_raises_once_though_a_fence_split_it(tmp_path, records_reach_the_copier):
    """A fence inside the open save (``fence_all`` from an eval thread) raised its staging
    error; the save went on (a later file, ``end``) and the next fence raised a second
    ``SnapshotError`` for the same save: errors were dropped per submit, and a save submits at
    every such fence. The rest of a failed save is not copied."""
    ck = make(gb=1 / 1024)  # 1 MiB: a 2 MiB tensor fails to stage
    big = torch.randn(2**19)
    d = str(tmp_path / "t")
    ck.begin(d, tag="t", pointer=Pointer(str(tmp_path / "latest"), "t"))
    ck.save({"x": big}, os.path.join(d, "a.pt"))
    with pytest.raises(SnapshotError, match="a.pt"):
        ck.fence()
    ck.save({"y": big * 2}, os.path.join(d, "b.pt"))  # too large as well: not raised again
    ck.end()
    ck.fence()  # raised "b.pt" again: once per save
    with pytest.raises(PersistError, match="a.pt|b.pt"):
        ck.wait()
    assert not (tmp_path / "latest").exists()
    save_one(ck, str(tmp_path), sample_state(), tag="t2")  # the next save commits
    ck.fence()
    ck.wait()
    assert (tmp_path / "latest").read_text() == "t2"
    ck.close()


@pytest.mark.parametrize("change", ["free", "grow"])
def test_a_storage_freed_or_resized_before_its_copy_fails_the_save_not_the_process(tmp_path, held_copier, change):
    """``untyped_storage().resize_(0)`` (how FSDP-style code frees a parameter) moves no
    version counter: the copier read the freed memory and the process died with a segfault. The
    storage is checked as the version is."""
    weight = torch.randn(1000)
    ck = make()
    held_copier.clear()
    ck.begin(str(tmp_path / "t"), tag="t")
    ck.save({"w": weight}, str(tmp_path / "t" / "m.pt"))
    ck.end()
    weight.untyped_storage().resize_(0 if change == "free" else 64_000)
    with pytest.raises(SnapshotError, match="storage was freed, resized or replaced after the save"):
        ck.fence()
    with pytest.raises(PersistError):
        ck.wait()
    ck.close()


def test_eager_tensors_are_copied_at_save_with_every_view_of_their_memory(tmp_path, held_copier):
    """``eager_tensors`` (a model's buffers) are copied before ``save``/``save_packed`` return,
    and so is any saved tensor viewing their memory (a state dict holds detached views); the
    others wait for the copier, held here until the fence, so they have the fence's values."""
    bn = torch.nn.BatchNorm1d(8)
    bn.running_mean.copy_(torch.arange(8.0))
    weight = torch.zeros(8)
    state = {"module": {k: v.detach() for k, v in bn.state_dict().items()}, "w": weight}
    ck = make()
    d = tmp_path / "t"
    ck.begin(str(d), tag="t")
    ck.save(state, str(d / "model.pt"), eager_tensors=list(bn.buffers()))
    ck.save_packed(str(d / "packed.distcp"), [("mean", {"m": bn.running_mean[2:6]}), ("w", {"w": weight})],
                   eager_tensors=list(bn.buffers()))
    ck.end()
    with torch.no_grad():  # the forward after the save: BatchNorm updates its statistics
        bn.running_mean.add_(100)
        bn.num_batches_tracked.add_(1)
        # changed before the fence, so the lazy copy takes it (through .data, whose version
        # counter is its own: an in-place change the engine cannot see, see the next test)
        weight.data.add_(1)
    ck.fence()
    ck.wait()
    ck.close()
    saved = torch.load(d / "model.pt", weights_only=True)
    assert torch.equal(saved["module"]["running_mean"], torch.arange(8.0))
    assert int(saved["module"]["num_batches_tracked"]) == 0
    assert torch.equal(saved["w"], torch.ones(8))
    parts = read_manifest(str(d))["files"]["packed.distcp"]["parts"]
    data = (d / "packed.distcp").read_bytes()
    offset, length = parts["mean"]
    assert torch.equal(torch.load(io.BytesIO(data[offset:offset + length]), weights_only=True)["m"],
                       torch.arange(2.0, 6.0))


@pytest.mark.parametrize("during_copy", [False, True])
def test_a_lazy_tensor_changed_in_place_before_its_copy_fails_the_save_not_silently(
        tmp_path, monkeypatch, during_copy, held_copier):
    """Weights changed in place after a save and before the next optimizer step (an EMA swap
    without ``fence_all()``) reached the file with no word: a checkpoint of values from after
    the save, or a mix. The tensor's version counter at the save is checked before and after
    its copy: the fence raises naming the file and record, the save is not committed, the
    previous checkpoint stays ``latest``, and the next save goes on. The copier is held
    until the fence; with ``during_copy`` the change happens while the copy runs."""
    release = held_copier
    weight = torch.zeros(8)
    with torch.inference_mode():  # no version counter: nothing to check, saved as it is
        frozen = torch.full((4,), 7.0)
    ck = make()
    release.set()
    save_one(ck, str(tmp_path), {"w": weight, "frozen": frozen}, tag="t1", eager=())
    ck.fence()
    ck.wait()
    release.clear()
    if during_copy:
        real_copy_ = torch.Tensor.copy_

        def copy_(dst, src, *args, **kwargs):  # the loop's edit lands while the copy runs
            out = real_copy_(dst, src, *args, **kwargs)
            if src is not None and src.data_ptr() == weight.data_ptr():
                with torch.no_grad():
                    weight.add_(1)
            return out

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    save_one(ck, str(tmp_path), {"w": weight, "frozen": frozen}, tag="t2", eager=())
    if not during_copy:
        with torch.no_grad():
            weight.add_(1)  # no fence_all() first
    with pytest.raises(SnapshotError, match=r"t2/model\.pt: tensor record 0 \(8,\) torch\.float32 failed: "
                                             r"changed in place after the save .*fence_all\(\)"):
        ck.fence()
    with pytest.raises(PersistError):
        ck.wait()
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "t1"
    assert torch.equal(torch.load(tmp_path / "t1" / "model.pt", weights_only=True)["w"], torch.zeros(8))
    release.set()
    save_one(ck, str(tmp_path), {"w": weight, "frozen": frozen}, tag="t3", eager=())
    ck.fence()
    ck.wait()
    ck.close()
    saved = torch.load(tmp_path / "t3" / "model.pt", weights_only=True)
    assert torch.equal(saved["w"], torch.ones(8)) and torch.equal(saved["frozen"], frozen)
    assert (tmp_path / "latest").read_text() == "t3"


def test_parameters_in_a_state_are_copied_lazily_and_checked_like_their_detached_tensors(tmp_path, held_copier):
    """An ``nn.Parameter`` in a state (``state_dict(keep_vars=True)``) was reduced through
    ``p.data``, a new tensor each time, never among the lazy ones: copied before ``save``
    returned, a stall the same weights as detached tensors do not cost.
    Its data is now copied lazily, and an in-place change before its copy fails the save as
    for any lazy tensor; it still loads as an ``nn.Parameter``."""
    release = held_copier
    model = torch.nn.Linear(4, 2)
    at_save = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ck = make()
    d = tmp_path / "t1"
    ck.begin(str(d), tag="t1", pointer=Pointer(str(tmp_path / "latest"), "t1"))
    ck.save({"model": model.state_dict(keep_vars=True)}, str(d / "model.pt"), eager_keys=())
    items = list(ck._saves.current.items)
    ck.end()
    assert len(items) == 2 and not any(i.eager for i in items)  # left to the copier
    ck.fence()  # the optimizer step's
    with torch.no_grad():
        model.weight.add_(1)
    ck.wait()
    saved = torch.load(d / "model.pt", weights_only=True)["model"]
    assert type(saved["weight"]) is torch.nn.Parameter
    assert_same({k: v.detach() for k, v in saved.items()}, at_save)
    release.clear()
    save_one(ck, str(tmp_path), {"model": model.state_dict(keep_vars=True)}, tag="t2", eager=())
    with torch.no_grad():
        model.bias.mul_(2)  # no fence_all() first
    with pytest.raises(SnapshotError, match="changed in place after the save"):
        ck.fence()
    with pytest.raises(PersistError):
        ck.wait()
    ck.close()
    assert (tmp_path / "latest").read_text() == "t1"


def test_a_fence_on_another_thread_during_a_save_or_its_end_loses_and_doubles_nothing(tmp_path, monkeypatch):
    """``fence_all`` on another thread (an eval thread about to swap in EMA weights) seals the
    open save's files and copies while the training thread may still be adding to them, or
    sealing them itself in ``end``. A fence that handed a snapshot of the lists to the copier
    and then emptied them would leave a file saved meanwhile with its writer waiting for
    copies never queued (the save never commits, ``wait`` and ``close`` never return), and a
    fence during ``end`` would give one file to two writers."""
    from deepspeed_async_ckpt.core import fence_all
    from deepspeed_async_ckpt.snapshot import Stager

    window, slow = threading.Event(), {"at": None}

    def widened(at):  # the fence is inside its hand-over (of copies, or of files): widen it
        if slow["at"] == at and threading.current_thread().name == "eval":
            window.set()
            time.sleep(0.3)

    submit = Stager.submit

    def slow_submit(self, items, **kwargs):
        items = list(items)
        widened("copies")
        return submit(self, items, **kwargs)

    monkeypatch.setattr(Stager, "submit", slow_submit)
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    writes = []
    writers_submit = ck._writers.submit

    def slow_writers_submit(fn, storage, path, *args, **kwargs):
        writes.append(path)
        widened("files")
        return writers_submit(fn, storage, path, *args, **kwargs)

    monkeypatch.setattr(ck._writers, "submit", slow_writers_submit)
    a, b = {"w": torch.randn(1000)}, {"w2": torch.randn(1000)}
    for step, during, slow["at"] in ((1, "save", "copies"), (2, "end", "files")):
        d = str(tmp_path / f"t{step}")
        ck.begin(d, tag=f"t{step}", pointer=Pointer(str(tmp_path / "latest"), f"t{step}"))
        ck.save(a, os.path.join(d, "a.pt"))
        window.clear()
        other = threading.Thread(target=fence_all, name="eval")
        other.start()
        assert window.wait(30)
        if during == "save":
            ck.save(b, os.path.join(d, "b.pt"))  # while the fence hands a.pt over
            other.join()  # the fence is done before the save is sealed
            ck.end()
        else:
            ck.end()  # while the fence hands a.pt over
            other.join()
        ck.wait(timeout=20)
        names = ["a.pt", "b.pt"] if during == "save" else ["a.pt"]
        assert sorted(os.path.basename(p) for p in writes) == names, (during, writes)  # each once
        writes.clear()
        for name in names:
            saved = torch.load(os.path.join(d, name))
            assert_same(saved, a if name == "a.pt" else b)
    ck.close()


def test_a_staging_error_is_raised_by_one_fence_and_the_next_save_goes_on(tmp_path, records_reach_the_copier):
    """A failed record leaves the fence's queue once its error is raised: left at the head, it
    would make every later fence, so every optimizer step, raise the same old error, after
    later saves had committed."""
    ck = make(gb=64 * 1024 / 1024**3)
    save_one(ck, str(tmp_path), {"w": torch.zeros(32 * 1024)}, tag="big", eager=())  # 128 KiB
    with pytest.raises(SnapshotError, match="big/model.pt"):
        ck.fence()
    with pytest.raises(PersistError):
        ck.wait()
    for step in range(2):
        save_one(ck, str(tmp_path), {"w": torch.full((16,), float(step))}, tag=f"t{step}", eager=())
        ck.fence()
    ck.wait()
    ck.close()
    assert_same(torch.load(tmp_path / "t1" / "model.pt"), {"w": torch.ones(16)})
    assert (tmp_path / "latest").read_text() == "t1"


@pytest.mark.parametrize("cause", ["too_big", "changed"])
def test_a_failed_save_is_raised_by_one_fence_however_many_of_its_records_failed(tmp_path, cause, held_copier,
                                                                                 records_reach_the_copier):
    """Each failed record of a save raised at its own fence: a save whose every weight was
    changed before its copy (an EMA swap without fence_all(), say) raised at as many
    optimizer steps as it had records, and a loop that caught the
    error skipped a step each time. The first fence raises; the save's other records, in
    every file, are not waited for by a fence again; wait() reports the save."""
    release = held_copier
    size = 32 * 1024 if cause == "too_big" else 16  # 128 KiB records: larger than the pool
    tensors = [torch.zeros(size) for _ in range(4)]
    ck = make(gb=64 * 1024 / 1024**3)
    d = tmp_path / "t"
    ck.begin(str(d), tag="t", pointer=Pointer(str(tmp_path / "latest"), "t"))
    ck.save({"a": tensors[0], "b": tensors[1]}, str(d / "model.pt"), eager_keys=())
    ck.save({"c": tensors[2], "d": tensors[3]}, str(d / "optim.pt"), eager_keys=())
    ck.end()
    if cause == "changed":
        for t in tensors:
            t.add_(1)
    with pytest.raises(SnapshotError, match=r"t/model\.pt: tensor record 0"):
        ck.fence()
    for _ in range(3):  # the next optimizer steps
        ck.fence()
    with pytest.raises(PersistError):
        ck.wait()
    release.set()
    save_one(ck, str(tmp_path), {"w": torch.ones(16)}, tag="t2", eager=())
    ck.fence()
    ck.wait()
    ck.close()
    assert (tmp_path / "latest").read_text() == "t2"


def test_a_ctrl_c_between_the_fences_claim_and_its_copy_fails_the_save_not_the_next_fence(tmp_path, monkeypatch):
    """The fence claims an item to copy from the back of the queue, then a Ctrl-C lands
    before the copy begins. The copier skips claimed items, so the item fails: the save is
    not committed, the next fence raises that once, and the next save commits. An item
    claimed and never issued would leave the next fence (the next optimizer step), ``wait``
    and the exit flush waiting for good."""
    from deepspeed_async_ckpt.snapshot import Stager

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.05))
    stager = ck._files.stager
    stage, copy = stager.stage, Stager._copy
    slow = threading.Event()
    monkeypatch.setattr(stager, "stage", lambda item, ready=None, expected_bytes=0:
                        (slow.wait(1.0), stage(item, ready, expected_bytes))[1])  # a busy copier
    hits = []

    def interrupted_copy(self, item, ready=None):
        if threading.current_thread() is threading.main_thread() and not hits:
            hits.append(item)
            raise KeyboardInterrupt  # before _copy's own try
        return copy(self, item, ready)

    monkeypatch.setattr(Stager, "_copy", interrupted_copy)
    root = str(tmp_path)
    d = os.path.join(root, "t1")
    ck.begin(d, tag="t1", pointer=Pointer(os.path.join(root, "latest"), "t1"))
    ck.save({f"w{i}": torch.full((4096,), float(i)) for i in range(8)}, os.path.join(d, "model.pt"))
    ck.end()
    with pytest.raises(KeyboardInterrupt):
        ck.fence()
    assert hits and hits[0].issued
    slow.set()
    with pytest.raises(SnapshotError, match="KeyboardInterrupt"):
        ck.fence()
    ck.fence()  # once
    with pytest.raises(PersistError):
        ck.wait(timeout=30)
    the_next_save_commits_and_closes(ck, tmp_path)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ctrl_c_while_the_training_thread_copies_is_a_keyboard_interrupt(tmp_path, monkeypatch, mode):
    """Ctrl-C landing while the training thread copies (a sync save; the fence helping the
    copier) was caught with the copy's errors and came back as a SnapshotError or PersistError
    with an empty reason: ``except KeyboardInterrupt`` handlers never ran, and loops catching
    ``Exception`` trained on. The save is still abandoned
    cleanly: the previous checkpoint stays, the next save commits."""
    from deepspeed_async_ckpt import snapshot

    root = str(tmp_path)
    ck = make(mode)
    save_one(ck, root, sample_state(), tag="t1")
    ck.fence()
    ck.wait()
    real_copy = torch.Tensor.copy_
    on_this_thread = threading.current_thread()

    def interrupted(self, *args, **kwargs):
        if threading.current_thread() is on_this_thread:
            raise KeyboardInterrupt
        return real_copy(self, *args, **kwargs)

    if mode == "async":  # the copier never gets there: the fence copies from the back
        hold = threading.Event()
        real_stage = snapshot.Stager.stage
        monkeypatch.setattr(snapshot.Stager, "stage", lambda self, *a, **k: (hold.wait(), real_stage(self, *a, **k)))
    monkeypatch.setattr(torch.Tensor, "copy_", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_one(ck, root, sample_state(), tag="t2", eager=())
        ck.fence()
    monkeypatch.undo()
    if mode == "async":
        hold.set()
    if ck.is_open:
        ck.end(commit=False)
    if mode == "async":  # the writer's failure of that save, reported once, named (not blank)
        with pytest.raises(AsyncCheckpointError, match="failed: KeyboardInterrupt"):
            ck.wait()
    else:  # sync: the interrupt was the report, the save abandoned
        ck.wait()
    save_one(ck, root, sample_state(), tag="t3")
    ck.fence()
    ck.close()
    assert (tmp_path / "latest").read_text() == "t3"
    verify_checkpoint(os.path.join(root, "t1"))


def test_saves_waited_for_without_a_fence_leave_nothing_queued_for_one(tmp_path):
    """A loop that saves and waits but never fences (evaluation, the end of an epoch) kept
    every lazy item of every save queued for a fence that never came (200 after 20 saves)."""
    ck = make()
    for step in range(20):
        save_one(ck, str(tmp_path), {f"w{i}": torch.randn(64) for i in range(10)}, tag=f"t{step}", eager=())
        ck.wait()
    left = len(ck._files.stager._pending)
    ck.close()
    assert left == 0


def test_a_staging_error_reported_by_wait_is_not_raised_again_by_a_later_fence(tmp_path, records_reach_the_copier):
    """The order the existing test does not take: wait() raises a save's staging failure
    first; a later save commits; the next fence raised the old failure again."""
    ck = make(gb=64 * 1024 / 1024**3)
    save_one(ck, str(tmp_path), {"w": torch.zeros(32 * 1024)}, tag="big", eager=())  # > pool
    with pytest.raises(PersistError, match="big/model.pt"):
        ck.wait()
    save_one(ck, str(tmp_path), {"w": torch.ones(16)}, tag="t1", eager=())
    ck.wait()
    try:
        ck.fence()
    finally:
        ck.close()
    assert (tmp_path / "latest").read_text() == "t1"


def test_a_fence_leaves_the_copies_of_what_the_step_does_not_change_to_the_copier(tmp_path, monkeypatch):
    """The optimizer step's fence, told which tensors the step leaves alone (frozen
    parameters), waits for the other copies only: the copier, held on the frozen tensor, is
    still copying it when the fence returns, and a fence that is not told waits for it. The
    file holds the values of save time."""
    from deepspeed_async_ckpt.snapshot import Stager

    frozen, trained = torch.randn(256, 256), torch.randn(64, 64)
    expected = {"frozen": frozen.clone(), "trained": trained.clone()}
    real_copy, release = Stager._copy, threading.Event()

    def copy(self, item, ready=None):
        if item.nbytes == frozen.numel() * 4 and threading.current_thread().name == "async-ckpt-copier":
            release.wait(10)
        return real_copy(self, item, ready)

    monkeypatch.setattr(Stager, "_copy", copy)
    ck = make()
    save_one(ck, str(tmp_path), {"frozen": frozen, "trained": trained}, eager=())
    stager = ck._files.stager
    t = time.perf_counter()
    ck.fence(lambda: [frozen])
    assert time.perf_counter() - t < 5 and not release.is_set()
    trained.add_(1.0)  # the optimizer step, while the frozen tensor's copy is held
    assert [i.nbytes for i in stager._pending] == [frozen.numel() * 4]  # still to be fenced by others
    fenced = threading.Thread(target=ck.fence)
    fenced.start()
    fenced.join(0.3)
    assert fenced.is_alive()  # an unrestricted fence waits for it
    release.set()
    fenced.join(10)
    ck.wait()
    ck.close()
    assert_same(torch.load(tmp_path / "t1" / "model.pt", weights_only=True), expected)


def test_a_frozen_tensor_changed_before_its_copy_still_fails_the_save(tmp_path, held_copier):
    frozen = torch.zeros(64, 64)
    ck = make()
    held_copier.clear()
    save_one(ck, str(tmp_path), {"frozen": frozen, "w": torch.ones(8)}, eager=())
    frozen.add_(1)  # changed though the caller said the step leaves it alone
    try:
        ck.fence(lambda: [frozen])  # lets the copier go; raises only if it got there first
    except SnapshotError as exc:
        assert "changed in place after the save" in str(exc)
    with pytest.raises(PersistError, match="changed in place after the save"):
        ck.wait()
    assert not (tmp_path / "latest").exists()  # not committed
    ck.close()


def test_an_item_is_claimed_once_and_keeps_its_first_failure():
    """The copier and a helping fence take an item through ``claim``: only one of them gets
    it. A failure recorded first (the copy's own) is the one reported, not a later one."""
    from deepspeed_async_ckpt.snapshot import TensorItem

    item = TensorItem("k", torch.zeros(4), 16, eager=False, what="a record")
    assert item.claim() and not item.claim()
    first = RuntimeError("the copy's own failure")
    item.fail(first)
    item.fail(KeyboardInterrupt())
    item.wait_issued()  # returns: a failed item counts as issued
    assert item.issued and item.error is first and item.src is None
    with pytest.raises(SnapshotError, match="a record.*the copy's own failure"):
        item.wait_staged()
