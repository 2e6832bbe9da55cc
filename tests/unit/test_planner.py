"""The plan cache (``snapshot.planner.PlanCache``): a save of a file whose structure did not
change reuses the last plan of it and allocates a few objects per record only; any change of
structure plans the file afresh; the bytes are those of a fresh plan either way."""

import gc
import os

import torch

from deepspeed_async_ckpt import AsyncCheckpointer
from deepspeed_async_ckpt.commit import Pointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.snapshot import PlanCache, plan_file


def _state(n=300, step=1):
    torch.manual_seed(0)
    flat = torch.randn(n * 16)
    module = {f"layer{i}.w": flat[16 * i:16 * (i + 1)].view(4, 4) for i in range(n)}
    module["tied"] = module["layer0.w"].view(4, 4)  # aliasing: one record for both
    module["t"] = torch.randn(8, 4).t()  # strided: kept with its strides
    optim = {"state": {i: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(16)} for i in range(n)},
             "param_groups": [{"lr": 0.1 / step, "params": list(range(n))}]}
    return {"module": module, "optimizer": optim, "global_steps": step, "empty": torch.empty(0)}


def _tracked_objects_left_by(fn):
    """GC-tracked objects allocated by ``fn`` and still alive while its result is."""
    gc.collect()
    gc.disable()
    try:
        before = gc.get_count()[0]
        result = fn()
        return gc.get_count()[0] - before, result
    finally:
        gc.enable()


def test_a_steady_state_plan_reuses_the_last_one_and_allocates_a_few_objects_per_record():
    state = _state()
    cache = PlanCache()
    plan_file(state, set(), "f", cache)
    fresh_objects, fresh = _tracked_objects_left_by(lambda: plan_file(state, set(), "f"))
    for step in range(2, 12):  # Python values change (steps, lr), the structure does not
        state["global_steps"] = step
        state["optimizer"]["param_groups"][0]["lr"] = 0.1 / step
        objects, plan = _tracked_objects_left_by(lambda: plan_file(state, set(), "f", cache))
        records = len(plan.items)
        # per record: its TensorItem with its latch, source view, label and storage identity
        assert objects <= 6 * records + 50, (step, objects, records)
        del plan
    assert cache.hits == 10
    assert objects < fresh_objects / 2, (objects, fresh_objects)
    again = plan_file(state, set(), "f")
    cached = plan_file(state, set(), "f", cache)
    assert cached.pickle_bytes == again.pickle_bytes
    assert [(i.key, i.nbytes, i.eager) for i in cached.items] == [(i.key, i.nbytes, i.eager) for i in again.items]
    assert len(fresh.items) == records


def test_a_plan_leaves_no_reference_cycle_for_the_cyclic_gc_to_free():
    """Garbage in a cycle lives, with the tensors it holds, until a collection finds it; a
    plan's objects are freed as soon as the plan is."""
    state = _state(n=50)
    for cache in (None, PlanCache(), PlanCache()):
        gc.collect()
        gc.disable()
        try:
            plan_file(state, set(), "f", cache)
            plan_file(state, set(), "f", cache)
            assert gc.collect() == 0
        finally:
            gc.enable()


def test_a_cached_plan_keeps_no_tensor_of_the_state_alive():
    import weakref

    cache = PlanCache()
    state = {"w": torch.randn(64), "n": 1}
    plan_file(state, set(), "f", cache)
    gone = weakref.ref(state["w"])
    state["w"] = torch.randn(64)  # the old tensor is dropped by its owner
    assert gone() is None


def test_a_changed_structure_is_planned_afresh():
    cache = PlanCache()
    state = _state(n=20)
    plan_file(state, set(), "f", cache)
    changes = [
        lambda s: s["module"].__setitem__("new", torch.ones(3)),  # a tensor added
        lambda s: s["module"].pop("layer3.w"),  # removed
        lambda s: s["module"].__setitem__("layer4.w", torch.randn(4, 4)),  # reallocated
        lambda s: s["module"].__setitem__("layer5.w", s["module"]["layer5.w"].reshape(2, 8)),  # reshaped
        lambda s: s["module"].__setitem__("layer6.w", s["module"]["layer6.w"].double()),  # dtype
        lambda s: s["module"].__setitem__("tied", s["module"]["layer1.w"].view(4, 4)),  # a view of another
        lambda s: s["module"].__setitem__("t", s["module"]["t"].t()),  # strides
    ]
    for change in changes:
        change(state)
        hits = cache.hits
        cached = plan_file(state, set(), "f", cache)
        assert cache.hits == hits  # planned afresh
        fresh = plan_file(state, set(), "f")
        assert cached.pickle_bytes == fresh.pickle_bytes
        assert [i.nbytes for i in cached.items] == [i.nbytes for i in fresh.items]
        again = plan_file(state, set(), "f", cache)  # and that plan is reused next time
        assert cache.hits == hits + 1 and again.pickle_bytes == fresh.pickle_bytes


def _save(ck, root, tag, state):
    d = os.path.join(root, tag)
    ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
    ck.save(state, os.path.join(d, "model.pt"), eager_keys=("empty",))
    ck.end()
    ck.fence()
    ck.wait()
    return open(os.path.join(d, "model.pt"), "rb").read()


def test_saves_from_a_reused_plan_write_the_bytes_of_a_fresh_one_and_follow_changes(tmp_path):
    state = _state(n=50)
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="async", host_buffer_gb=0.01))
    steps = [1, 2, 3, 4]
    for step in steps:
        state["global_steps"] = step
        if step == 3:  # the structure changes: re-planned
            state["module"]["layer2.w"] = torch.randn(2, 8)
        for t in state["module"].values():
            t.add_(1.0)  # new values, the same tensors
        ours = _save(ck, str(tmp_path / "reused"), f"s{step}", state)
        fresh = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01))
        assert ours == _save(fresh, str(tmp_path / "fresh"), f"s{step}", state), step
        fresh.close()
        loaded = torch.load(tmp_path / "reused" / f"s{step}" / "model.pt", weights_only=True)
        assert loaded["global_steps"] == step
        assert torch.equal(loaded["module"]["layer2.w"], state["module"]["layer2.w"])
    ck.close()
