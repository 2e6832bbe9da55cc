"""Restore before load: the newest checkpoint committed on any tier, each file from the
fastest tier holding a verified copy; a copy that fails verification is named."""

import json
import logging
import os
import shutil

import pytest
import torch

from deepspeed_async_ckpt.commit import Pointer, verify_checkpoint
from deepspeed_async_ckpt.errors import IntegrityError
from deepspeed_async_ckpt.tiers.remote import PathRemote, open_remote
from deepspeed_async_ckpt.tiers.config import TierConfig
from deepspeed_async_ckpt.tiers.choose import RECORD_FILE
from deepspeed_async_ckpt.tiers.restore import restore

from helpers import flip_byte, make
from s3server import s3, s3_server  # noqa: F401  (fixtures)


def save_steps(ck, save_dir, steps):
    for i in steps:
        d = os.path.join(save_dir, f"step{i}")
        ck.begin(d, tag=f"step{i}", pointer=Pointer(os.path.join(save_dir, "latest"), f"step{i}"))
        torch.manual_seed(i)
        ck.save({"w": torch.randn(256, 64), "step": i}, os.path.join(d, "model.pt"))
        ck.save({"opt": torch.randn(512)}, os.path.join(d, "optim.pt"))
        ck.end()
        ck.fence()
        ck.wait()
        assert ck.tiers is None or ck.tiers.wait_idle(60)


def tree(path):
    """Every file under ``path`` (relative name -> bytes)."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            full = os.path.join(root, f)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


def s3_remote(bucket):
    return open_remote(TierConfig(**bucket.tier("run")))


def test_restore_into_an_emptied_first_tier_gives_the_same_bytes(tmp_path, s3):
    local = tmp_path / "local"
    ck = make(tiers=[s3.tier("run")])
    save_steps(ck, str(local), [1, 2])
    ck.close()
    saved = tree(local / "step2")
    shutil.rmtree(local)  # a replaced node: its disk is empty
    assert restore(str(local), [s3_remote(s3)], pointer_name="latest") == "step2"
    assert (local / "latest").read_text() == "step2"
    assert tree(local / "step2") == {k: v for k, v in saved.items() if "rank_" not in k}
    verify_checkpoint(str(local / "step2"))
    assert torch.equal(torch.load(local / "step2" / "model.pt")["w"], (torch.manual_seed(2), torch.randn(256, 64))[1])


def test_a_corrupted_tier_object_is_named(tmp_path, s3):
    local = tmp_path / "local"
    ck = make(tiers=[s3.tier("run")])
    save_steps(ck, str(local), [1])
    ck.close()
    shutil.rmtree(local)
    data = bytearray(s3.get("run/step1/model.pt"))
    data[len(data) // 2] ^= 1
    s3.put("run/step1/model.pt", bytes(data))
    with pytest.raises(IntegrityError) as err:
        restore(str(local), [s3_remote(s3)], pointer_name="latest")
    message = str(err.value)
    assert f"s3://{s3.name}/run/step1/model.pt: xxh128" in message and "corrupted" in message
    assert not (local / "step1" / "model.pt").exists() and not (local / "latest").exists()


def test_a_damaged_first_tier_file_is_fetched_from_the_tier(tmp_path):
    local, tier = tmp_path / "local", tmp_path / "tier"
    ck = make(tiers=[{"url": str(tier)}])
    save_steps(ck, str(local), [1])
    ck.close()
    good = (local / "step1" / "optim.pt").read_bytes()
    flip_byte(local / "step1" / "optim.pt")
    (local / "step1" / "model.pt").unlink()
    assert restore(str(local), [PathRemote(str(tier))], pointer_name="latest") == "step1"
    assert (local / "step1" / "optim.pt").read_bytes() == good
    verify_checkpoint(str(local / "step1"))


def test_the_second_tier_serves_what_the_first_durable_tier_has_corrupted(tmp_path):
    local, fast, slow = tmp_path / "local", tmp_path / "fast", tmp_path / "slow"
    ck = make(tiers=[{"url": str(fast)}, {"url": str(slow)}])
    save_steps(ck, str(local), [1])
    ck.close()
    flip_byte(fast / "step1" / "model.pt")
    shutil.rmtree(local)
    restore(str(local), [PathRemote(str(fast)), PathRemote(str(slow))], pointer_name="latest")
    assert (local / "step1" / "model.pt").read_bytes() == (slow / "step1" / "model.pt").read_bytes()


def test_no_valid_copy_anywhere_names_each_copy(tmp_path):
    local, tier = tmp_path / "local", tmp_path / "tier"
    ck = make(tiers=[{"url": str(tier)}])
    save_steps(ck, str(local), [1])
    ck.close()
    (local / "step1" / "model.pt").unlink()
    (tier / "step1" / "model.pt").unlink()
    with pytest.raises(IntegrityError) as err:
        restore(str(local), [PathRemote(str(tier))], pointer_name="latest")
    message = str(err.value)
    assert "no tier holds a valid copy of model.pt" in message
    assert f"{local / 'step1' / 'model.pt'}: cannot be read: [Errno 2] No such file or directory" in message
    assert f"{tier / 'step1' / 'model.pt'}: cannot be fetched" in message


def test_the_newest_commit_on_any_tier_wins(tmp_path):
    local, tier = tmp_path / "local", tmp_path / "tier"
    ck = make(tiers=[{"url": str(tier)}])
    save_steps(ck, str(local), [1])
    stale = tmp_path / "stale"
    shutil.copytree(local, stale)  # the first tier as the engine left it after step1
    save_steps(ck, str(local), [2])
    ck.close()
    # the first tier newer than the durable one: nothing fetched, its pointer kept
    ck = make()
    save_steps(ck, str(local), [3])
    ck.close()
    before = tree(local)
    assert restore(str(local), [PathRemote(str(tier))], pointer_name="latest") == "step3"
    assert tree(local) == before
    # the durable tier newer than the pointer the engine wrote on a disk left behind (a node
    # back from another allocation): restored from it, the pointer and its record moved
    shutil.rmtree(local)
    shutil.move(stale, local)
    assert restore(str(local), [PathRemote(str(tier))], pointer_name="latest") == "step2"
    assert (local / "latest").read_text() == "step2"
    assert json.loads((local / RECORD_FILE).read_text()) == {"checkpoint": "step2", "pointer": ["latest", "step2"]}
    verify_checkpoint(str(local / "step2"))


def test_a_pointer_rolled_back_by_hand_is_followed_with_one_line_naming_the_newer(tmp_path, caplog):
    local, tier = tmp_path / "local", tmp_path / "tier"
    ck = make(tiers=[{"url": str(tier)}])
    save_steps(ck, str(local), [1, 2, 3])
    ck.close()
    (local / "latest").write_text("step1\n")  # a rollback to a checkpoint whole on disk
    before = tree(local)
    with caplog.at_level(logging.INFO, logger="deepspeed_async_ckpt"):
        assert restore(str(local), [PathRemote(str(tier))], pointer_name="latest") == "step1"
    assert tree(local) == before  # the pointer and the engine's record as they were
    lines = [r.getMessage() for r in caplog.records if "rollback" in r.getMessage()]
    assert len(lines) == 1 and f"{tier} holds the newer step3" in lines[0] and "names step1" in lines[0]
    # rolled back to one the first tier no longer holds: restored from the tier, still followed
    shutil.rmtree(local / "step1")
    assert restore(str(local), [PathRemote(str(tier))], pointer_name="latest") == "step1"
    assert (local / "latest").read_text() == "step1\n"
    verify_checkpoint(str(local / "step1"))
    # a pointer naming no committed checkpoint: the newest on any tier
    (local / "latest").write_text("step9")
    assert restore(str(local), [PathRemote(str(tier))], pointer_name="latest") == "step3"
    assert (local / "latest").read_text() == "step3"


def test_a_newest_checkpoint_no_tier_can_make_whole_gives_way_to_the_newest_that_can(tmp_path, s3, caplog):
    local = tmp_path / "local"
    ck = make(tiers=[s3.tier("run", keep_last=0)])
    save_steps(ck, str(local), [1, 2, 3])
    ck.close()
    saved = tree(local / "step2")
    shutil.rmtree(local)  # the first tier gone, and one file of the newest lost on the tier
    s3.client.delete_object(Bucket=s3.name, Key="run/step3/optim.pt")
    with caplog.at_level(logging.WARNING, logger="deepspeed_async_ckpt"):
        assert restore(str(local), [s3_remote(s3)], pointer_name="latest") == "step2"
    assert (local / "latest").read_text() == "step2"
    assert sorted(os.listdir(local)) == [RECORD_FILE, "latest", "step2"]  # no step3 left behind
    assert tree(local / "step2") == {k: v for k, v in saved.items() if "rank_" not in k}
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "loading step2; skipped the newer step3 (rank 0: checkpoint step3: no tier holds a valid copy of " \
        "optim.pt" in lines[0] and f"s3://{s3.name}/run/step3/optim.pt: cannot be fetched" in lines[0]
    # the tag asked for is never replaced: its failure is raised, and nothing of it left
    with pytest.raises(IntegrityError, match="checkpoint step3: no tier holds a valid copy of optim.pt"):
        restore(str(local), [s3_remote(s3)], pointer_name="latest", tag="step3")
    assert sorted(os.listdir(local)) == [RECORD_FILE, "latest", "step2"]


def test_no_checkpoint_any_tier_can_make_whole_names_each_and_leaves_no_directory(tmp_path):
    local, tier = tmp_path / "local", tmp_path / "tier"
    ck = make(tiers=[{"url": str(tier), "keep_last": 0}])
    save_steps(ck, str(local), [1, 2])
    ck.close()
    shutil.rmtree(local)
    (tier / "step1" / "model.pt").unlink()
    flip_byte(tier / "step2" / "optim.pt")
    with pytest.raises(IntegrityError) as err:
        restore(str(local), [PathRemote(str(tier))], pointer_name="latest")
    message = str(err.value)
    assert message.startswith("no committed checkpoint can be made whole from any tier: step2 (rank 0: "
                              "checkpoint step2: no tier holds a valid copy of optim.pt")
    assert "; step1 (rank 0: checkpoint step1: no tier holds a valid copy of model.pt" in message
    assert not local.exists()


def test_a_first_tier_that_cannot_be_written_fails_the_load_instead_of_passing_over(tmp_path, monkeypatch):
    import errno

    from deepspeed_async_ckpt.tiers import restore as restore_module

    local, tier = tmp_path / "local", tmp_path / "tier"
    ck = make(tiers=[{"url": str(tier), "keep_last": 0}])
    save_steps(ck, str(local), [1, 2])
    ck.close()
    shutil.rmtree(local)

    def disk_full(storage, path, text, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(restore_module, "write_text_atomic", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        restore(str(local), [PathRemote(str(tier))], pointer_name="latest")
    assert not local.exists()  # step2's files fetched, then removed with the directory


def test_a_named_tag_is_restored_without_moving_the_pointer(tmp_path):
    local, tier = tmp_path / "local", tmp_path / "tier"
    ck = make(tiers=[{"url": str(tier), "keep_last": 0}])
    save_steps(ck, str(local), [1, 2])
    ck.close()
    shutil.rmtree(local / "step1")
    assert restore(str(local), [PathRemote(str(tier))], pointer_name="latest", tag="step1") == "step1"
    assert (local / "latest").read_text() == "step2"
    verify_checkpoint(str(local / "step1"))


def test_nothing_on_any_tier_restores_nothing(tmp_path):
    assert restore(str(tmp_path / "local"), [PathRemote(str(tmp_path / "tier"))], pointer_name="latest") is None
    assert not (tmp_path / "local").exists() or not os.listdir(tmp_path / "local")


class WriteMarkers:
    """A finalize step writing Megatron's marker files after the manifest (late files)."""

    files = (".metadata", "metadata.json")

    def __call__(self, ctx):
        ctx.write_file(".metadata", b"dcp-metadata" * 10)
        ctx.write_file("metadata.json", '{"sharded_backend": "torch_dist"}')


def test_megatron_layout_tracker_and_late_files_drain_and_restore(tmp_path, s3):
    """Megatron's layout: ``iter_NNNNNNN`` directories, the tracker holding the iteration, and
    marker files written after the manifest: each drained and restored, the tracker last."""
    from megatron_adapter.checkpointer import TRACKER_FILE

    local = tmp_path / "local"
    ck = make(tiers=[s3.tier("mg")])
    for it in (10, 20):
        d = local / f"iter_{it:07d}"
        ck.begin(str(d), tag=str(it), pointer=Pointer(str(local / TRACKER_FILE), str(it)),
                 finalize=[WriteMarkers()])
        ck.save({"w": torch.randn(128)}, str(d / "__0_0.distcp"))
        ck.end()
        ck.fence()
        ck.wait()
        assert ck.tiers.wait_idle(60)
    ck.close()
    saved = tree(local / "iter_0000020")
    assert s3.get(f"mg/{TRACKER_FILE}") == b"20"
    shutil.rmtree(local)
    name = restore(str(local), [s3_remote_at(s3, "mg")], pointer_name=TRACKER_FILE,
                   name_of=lambda text: f"iter_{int(text):07d}")
    assert name == "iter_0000020" and (local / TRACKER_FILE).read_text() == "20"
    assert tree(local / "iter_0000020") == {k: v for k, v in saved.items() if "rank_" not in k}
    verify_checkpoint(str(local / "iter_0000020"))  # the late files included


def s3_remote_at(bucket, prefix):
    return open_remote(TierConfig(**bucket.tier(prefix)))


def test_restore_all_ranks_in_one_process_restores_and_raises_what_restore_raises(tmp_path):
    local, tier = tmp_path / "local", tmp_path / "tier"
    ck = make(tiers=[{"url": str(tier)}])
    save_steps(ck, str(local), [1])
    ck.close()
    shutil.rmtree(local)
    ck = make(tiers=[{"url": str(tier)}])
    ck.tiers.restore_all_ranks(ck, str(local), pointer_name="latest")
    verify_checkpoint(str(local / "step1"))
    shutil.rmtree(local)
    flip_byte(tier / "step1" / "model.pt")
    with pytest.raises(IntegrityError, match="step1/model.pt: xxh128"):
        ck.tiers.restore_all_ranks(ck, str(local), pointer_name="latest")
    ck.close()
