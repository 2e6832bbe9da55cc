"""Unit tests for the retention policies (``deepspeed_async_ckpt.commit.policy``) and for
``retire_checkpoints`` asking them, on checkpoints made of bare manifests (no training)."""

import json
import os
import threading

import pytest

from deepspeed_async_ckpt.commit import (META_DIR, CheckpointInfo, KeepAny, KeepEvery, KeepIf, KeepLast,
                                         RetentionPolicy, retire_checkpoints)
from deepspeed_async_ckpt.commit.layout import FORMAT, MANIFEST
from deepspeed_async_ckpt.commit.retire import step_in_name
from deepspeed_async_ckpt.storage import LocalStorage


def infos(*specs):
    """``CheckpointInfo`` values from ``(name, step)`` or ``(name, step, loadable)``."""
    return [CheckpointInfo(*spec) for spec in specs]


NEWEST_FIRST = infos(("s50", 50), ("s40", 40), ("s30", 30), ("s20", 20), ("s10", 10), ("s0", 0))


# KeepLast


def test_keep_last_keeps_the_n_newest():
    assert KeepLast(2).should_keep(NEWEST_FIRST) == [True, True, False, False, False, False]


def test_keep_last_zero_keeps_none_and_more_than_there_are_keeps_all():
    assert KeepLast(0).should_keep(NEWEST_FIRST) == [False] * 6
    assert KeepLast(10).should_keep(NEWEST_FIRST) == [True] * 6
    assert KeepLast(3).should_keep([]) == []


def test_keep_last_neither_keeps_nor_counts_a_checkpoint_that_cannot_be_loaded():
    checkpoints = infos(("a", 3), ("b", 2, False), ("c", 1), ("d", 0))
    assert KeepLast(2).should_keep(checkpoints) == [True, False, True, False]


@pytest.mark.parametrize("n", [-1, True, 1.5, "3", None])
def test_keep_last_refuses_what_is_no_count_naming_n(n):
    with pytest.raises(ValueError, match=r"KeepLast: n must be an integer >= 0"):
        KeepLast(n)


# KeepEvery


def test_keep_every_keeps_multiples_of_n_including_step_zero():
    assert KeepEvery(20).should_keep(NEWEST_FIRST) == [False, True, False, True, False, True]


def test_keep_every_keeps_no_checkpoint_whose_step_is_unknown():
    assert KeepEvery(1).should_keep(infos(("best", None), ("s7", 7))) == [False, True]


def test_keep_every_keeps_a_multiple_that_cannot_be_loaded():
    """As Megatron-LM's interval does: the name decides, not whether the save finished."""
    assert KeepEvery(10).should_keep(infos(("s20", 20, False), ("s25", 25, False))) == [True, False]


@pytest.mark.parametrize("n", [0, -5, True, 2.0, "10"])
def test_keep_every_refuses_what_is_no_interval_naming_n(n):
    with pytest.raises(ValueError, match=r"KeepEvery: n must be an integer >= 1"):
        KeepEvery(n)


# KeepIf


def test_keep_if_asks_the_predicate_about_each_name():
    policy = KeepIf(lambda name: name.endswith("0") and name != "s0")
    assert policy.should_keep(NEWEST_FIRST) == [True, True, True, True, True, False]


def test_keep_if_refuses_what_cannot_be_called_naming_predicate():
    with pytest.raises(ValueError, match="KeepIf: predicate must be callable"):
        KeepIf("best")


# KeepAny


def test_keep_any_keeps_what_any_of_its_policies_keeps():
    policy = KeepAny(KeepLast(1), KeepEvery(20))
    assert policy.should_keep(NEWEST_FIRST) == [True, True, False, True, False, True]


def test_keep_any_composes_with_itself_and_with_one_policy_is_that_policy():
    nested = KeepAny(KeepAny(KeepLast(1), KeepIf(lambda n: n == "s10")), KeepEvery(30))
    assert nested.should_keep(NEWEST_FIRST) == [True, False, True, False, True, True]
    assert KeepAny(KeepLast(2)).should_keep(NEWEST_FIRST) == KeepLast(2).should_keep(NEWEST_FIRST)


def test_policies_compare_by_value():
    assert KeepAny(KeepLast(1), KeepEvery(5)) == KeepAny(KeepLast(1), KeepEvery(5))
    assert KeepAny(KeepLast(1)) != KeepAny(KeepLast(2))
    assert repr(KeepAny(KeepLast(1), KeepEvery(5))) == "KeepAny(KeepLast(n=1), KeepEvery(n=5))"


def test_keep_any_refuses_no_policies_and_what_is_not_one_naming_policies():
    with pytest.raises(ValueError, match="KeepAny: policies must name at least one"):
        KeepAny()
    with pytest.raises(ValueError, match="KeepAny: policies must be retention policies"):
        KeepAny(KeepLast(1), 3)


def test_step_in_name_reads_the_number_a_name_ends_with():
    assert [step_in_name(n) for n in ("global_step900", "iter_0000900", "checkpoint-900", "best", "v2a")] \
        == [900, 900, 900, None, None]


# retire_checkpoints asking a policy


def committed(save_dir, *names):
    """Bare committed checkpoints, committed in the order given (the last is the newest)."""
    for at, name in enumerate(names, start=1000):
        meta = os.path.join(save_dir, name, META_DIR)
        os.makedirs(meta)
        manifest = {"format": FORMAT, "tag": name, "save_id": f"{at:016d}", "world_size": 1,
                    "checksum": "xxh128", "committed_at": float(at), "files": {}}
        with open(os.path.join(meta, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f)


def retire(save_dir, protected=(), **how):
    return retire_checkpoints(LocalStorage(fsync=False), save_dir, protected=lambda: set(protected),
                              lock=threading.Lock(), **how)


def left(save_dir):
    return sorted(n for n in os.listdir(save_dir) if not n.startswith(META_DIR))


ITERATIONS = [f"iter_{i:07d}" for i in range(0, 110, 10)]


def test_the_keyword_form_is_keep_last_or_keep_if(tmp_path):
    """``keep_last=N, keep=predicate`` (the Megatron adapter's --save-retain-interval) removes
    what ``KeepAny(KeepLast(N), KeepIf(predicate))`` does, and ``KeepEvery`` on the steps
    read from the names does the same as the adapter's predicate."""
    def on_interval(name):  # the Megatron adapter's: iteration % interval == 0
        return int(name[len("iter_"):]) % 30 == 0

    runs = {"keyword": dict(keep_last=2, keep=on_interval),
            "keep_if": dict(policy=KeepAny(KeepLast(2), KeepIf(on_interval))),
            "keep_every": dict(policy=KeepAny(KeepLast(2), KeepEvery(30)))}
    removed = {}
    for label, how in runs.items():
        save_dir = str(tmp_path / label)
        committed(save_dir, *ITERATIONS)
        removed[label] = retire(save_dir, **how)
        assert left(save_dir) == ["iter_0000000", "iter_0000030", "iter_0000060", "iter_0000090",
                                  "iter_0000100"], label
    assert removed["keyword"] == removed["keep_if"] == removed["keep_every"] == \
        ["iter_0000080", "iter_0000070", "iter_0000050", "iter_0000040", "iter_0000020", "iter_0000010"]


def test_keep_last_alone_in_keyword_form(tmp_path):
    save_dir = str(tmp_path)
    committed(save_dir, "a", "b", "c")
    assert retire(save_dir, keep_last=1) == ["b", "a"]
    assert left(save_dir) == ["c"]


def test_what_protected_or_a_link_names_stays_whatever_the_policy_says(tmp_path):
    """The pointer's target is among ``protected()``; a policy that keeps nothing does not
    remove it, nor what a symbolic link names."""
    save_dir = str(tmp_path)
    committed(save_dir, "a", "b", "c", "d")
    os.symlink("b", os.path.join(save_dir, "best"))
    assert retire(save_dir, protected={os.path.join(save_dir, "c")}, policy=KeepLast(0)) == ["d", "a"]
    assert left(save_dir) == ["b", "best", "c"]


def test_a_policy_sees_the_committed_checkpoints_newest_first_with_their_steps(tmp_path):
    seen = []

    class Record(RetentionPolicy):
        def should_keep(self, checkpoints):
            seen.extend(checkpoints)
            return [True] * len(checkpoints)

    save_dir = str(tmp_path)
    committed(save_dir, "global_step5", "best", "global_step7")
    assert retire(save_dir, policy=Record()) == []
    assert seen == infos(("global_step7", 7), ("best", None), ("global_step5", 5))


def test_retire_checkpoints_refuses_a_policy_and_the_keyword_form_together_or_neither(tmp_path):
    with pytest.raises(ValueError, match="policy is given, so keep_last and keep must not be"):
        retire(str(tmp_path), policy=KeepLast(1), keep_last=1)
    with pytest.raises(ValueError, match="keep_last .or policy. is required"):
        retire(str(tmp_path))
    with pytest.raises(ValueError, match="policy must be a RetentionPolicy"):
        retire(str(tmp_path), policy=3)


def test_a_policy_that_answers_for_the_wrong_number_of_checkpoints_is_refused(tmp_path):
    class Short(RetentionPolicy):
        def should_keep(self, checkpoints):
            return [True]

    save_dir = str(tmp_path)
    committed(save_dir, "a", "b")
    with pytest.raises(ValueError, match="answered 1 times for 2 checkpoints"):
        retire(save_dir, policy=Short())
    assert left(save_dir) == ["a", "b"]
