"""Restore from memory in one process: which checkpoint the chooser takes (memory against the
checkpoint directory and the tiers, by commit time, then step), and a real keeper's
checkpoint laid out on tmpfs byte for byte with its manifest and pointer, removed after; a
keeper that is gone, a corrupted copy or a missing file fall back with one line naming why."""

import logging
import os
import shutil

import pytest
import torch

from _memory import CONFIG, corrupt_in_memory, fill_keeper, kill_keepers, restore_dirs
from deepspeed_async_ckpt.commit.verify import verify_checkpoint
from deepspeed_async_ckpt.memory import segment
from deepspeed_async_ckpt.memory.client import KeeperClient
from deepspeed_async_ckpt.memory.restore import Held, laid_out, memory_is_newer, restore_from_memory
from deepspeed_async_ckpt.tiers.choose import newest_committed
from helpers import make, save_small

MEMORY = Held("global_step8", "sid8", 800.0)


def test_memory_newer_than_disk_is_taken():
    assert memory_is_newer(MEMORY, (600.0, "global_step6")) is None
    assert memory_is_newer(MEMORY, None) is None


def test_disk_newer_than_memory_is_taken_and_says_so():
    assert memory_is_newer(MEMORY, (900.0, "global_step9")) == "global_step9 on disk is newer than global_step8 in memory"


def test_a_tie_in_commit_time_goes_by_the_step_then_to_memory():
    assert memory_is_newer(MEMORY, (800.0, "global_step9")) is not None
    assert memory_is_newer(MEMORY, (800.0, "global_step7")) is None
    assert memory_is_newer(MEMORY, (800.0, "global_step8")) is None  # the same save persisted: memory reads faster


def test_no_committed_slot_is_not_taken():
    assert memory_is_newer(None, (1.0, "global_step1")) == "the keeper holds no committed checkpoint"


def test_a_tag_asked_for_is_taken_from_memory_only_where_the_keeper_holds_it():
    assert memory_is_newer(MEMORY, (900.0, "global_step9"), tag="global_step8") is None
    assert memory_is_newer(MEMORY, (900.0, "global_step9"), tag="global_step9") == \
        "the keeper's newest is global_step8, not the global_step9 asked for"
    assert memory_is_newer(MEMORY, (900.0, "global_step8"), tag="global_step8") == \
        "the checkpoint directory holds a later commit of global_step8"


@pytest.fixture
def save_dir(tmp_path, monkeypatch):
    """A save directory holding step1 and step2 (``latest``: step2); its keepers killed and
    their segments removed at teardown."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    path = str(tmp_path / "ckpt")
    ck = make(mode="sync")
    try:
        for tag in ("step1", "step2"):
            save_small(ck, path, tag)
            ck.wait()
    finally:
        ck.close()
    yield path
    kill_keepers(path)


def restore(save_dir, **kw):
    return restore_from_memory(save_dir, CONFIG, rank=0, world_size=1, pointer_name="latest",
                               on_disk=lambda: newest_committed(save_dir, [], pointer_name="latest"), **kw)


def roll_back_to_step1(save_dir):
    """step2 only in memory: its disk copy removed, ``latest`` back at step1."""
    shutil.rmtree(os.path.join(save_dir, "step2"))
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write("step1")


def test_a_newer_memory_checkpoint_is_laid_out_bytewise_and_removed_after(save_dir):
    original = open(os.path.join(save_dir, "step2", "model.pt"), "rb").read()
    fill_keeper(save_dir, os.path.join(save_dir, "step2")).close()
    roll_back_to_step1(save_dir)
    before = os.listdir(save_dir)
    memory = restore(save_dir)
    assert memory is not None and memory.name == "step2"
    ckpt = os.path.join(memory.load_dir, "step2")
    assert open(os.path.join(ckpt, "model.pt"), "rb").read() == original
    client = KeeperClient.find(save_dir)
    held = {f.name: f.segment for part in client.newest().ranks.values() for f in part.files}
    client.close()
    # no byte copied: the file is the keeper's segment, hard-linked, read-only
    assert os.stat(os.path.join(ckpt, "model.pt")).st_ino == os.stat(segment.path_of(held["model.pt"])).st_ino
    assert os.stat(os.path.join(ckpt, "model.pt")).st_mode & 0o777 == 0o400
    assert open(os.path.join(memory.load_dir, "latest")).read() == "step2"
    verify_checkpoint(ckpt)  # the disk manifest's checksums, over the laid-out copy
    assert torch.load(os.path.join(ckpt, "model.pt"))["w"].shape == (16,)
    assert sorted(os.listdir(save_dir)) == sorted(before)  # the save directory untouched
    assert laid_out(os.path.join(ckpt, "model.pt")) and not laid_out(os.path.join(save_dir, "step1", "model.pt"))
    memory.close()
    assert restore_dirs(save_dir) == [] and not laid_out(os.path.join(ckpt, "model.pt"))


def test_late_files_the_keeper_holds_are_laid_out_and_recorded(save_dir):
    with open(os.path.join(save_dir, "step2", "metadata.json"), "w") as f:
        f.write('{"sharded_backend": "torch_dist"}')
    fill_keeper(save_dir, os.path.join(save_dir, "step2"), late=["metadata.json"]).close()
    memory = restore(save_dir)
    ckpt = os.path.join(memory.load_dir, "step2")
    assert open(os.path.join(ckpt, "metadata.json")).read() == '{"sharded_backend": "torch_dist"}'
    verify_checkpoint(ckpt)  # the late files' record made from the keeper's verified bytes
    memory.close()


def test_memory_older_than_disk_is_not_taken(save_dir, caplog):
    fill_keeper(save_dir, os.path.join(save_dir, "step1")).close()
    with caplog.at_level(logging.INFO, "deepspeed_async_ckpt.memory.restore"):
        assert restore(save_dir) is None
    assert "step2 on disk is newer than step1 in memory" in caplog.text


def test_a_tag_asked_for_loads_from_memory(save_dir):
    fill_keeper(save_dir, os.path.join(save_dir, "step2")).close()
    memory = restore(save_dir, tag="step2")
    assert memory is not None and memory.name == "step2"
    memory.close()
    assert restore(save_dir, tag="step1") is None


def test_a_killed_keeper_falls_back_in_one_line(save_dir, caplog):
    fill_keeper(save_dir, os.path.join(save_dir, "step2")).close()
    roll_back_to_step1(save_dir)
    kill_keepers(save_dir)
    with caplog.at_level(logging.WARNING):
        assert restore(save_dir) is None
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "no memory keeper runs for" in lines[0] and "checkpoint directory" in lines[0]


def test_a_first_start_without_keeper_or_checkpoint_says_so_below_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO, "deepspeed_async_ckpt.memory.restore"):
        assert restore(str(tmp_path / "fresh")) is None
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "no memory keeper runs for" in caplog.text


def test_a_corrupted_copy_falls_back_naming_the_file_and_leaves_no_directory(save_dir, caplog):
    client = fill_keeper(save_dir, os.path.join(save_dir, "step2"))
    corrupt_in_memory(client, "model.pt")
    client.close()
    roll_back_to_step1(save_dir)
    with caplog.at_level(logging.WARNING):
        assert restore(save_dir) is None
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "not loading step2 from the memory tier" in lines[0]
    assert "model.pt of rank 0 in memory checkpoint step2" in lines[0] and "corrupted" in lines[0]
    assert restore_dirs(save_dir) == []


def test_a_file_the_node_lacks_falls_back_naming_it(save_dir, caplog):
    fill_keeper(save_dir, os.path.join(save_dir, "step2")).close()
    roll_back_to_step1(save_dir)
    with caplog.at_level(logging.WARNING):
        memory = restore(save_dir, required=lambda manifest, node: [*manifest["files"], "extra.pt"])
    assert memory is None and "keeper lacks extra.pt of step2" in caplog.text
    assert restore_dirs(save_dir) == []


def test_a_directory_a_killed_load_left_is_removed_by_the_next(save_dir):
    from deepspeed_async_ckpt.memory.restore import restore_dir

    fill_keeper(save_dir, os.path.join(save_dir, "step2")).close()
    stale = restore_dir(save_dir, "an-older-save")
    os.makedirs(os.path.join(stale, "step0"))
    memory = restore(save_dir, tag="step2")
    assert not os.path.exists(stale)
    memory.close()
    assert restore_dirs(save_dir) == []


def test_a_restore_across_nodes_fetches_each_lacking_file_from_the_lowest_node_holding_it():
    from deepspeed_async_ckpt.errors import IntegrityError
    from deepspeed_async_ckpt.memory.fetch import transfers

    offers = [{"node": 0, "held": {"a.pt": (3, "ca"), "m.pt": (5, "cm")}, "lacking": ["b.pt"]}, None,
              {"node": 1, "held": {"b.pt": (4, "cb"), "m.pt": (5, "cm")}, "lacking": ["a.pt"]}, None]
    assert transfers(offers) == [("b.pt", 2, 0, 4, "cb"), ("a.pt", 0, 2, 3, "ca")]
    offers[2]["lacking"].append("c.pt")  # held by no node: the restore falls back, naming it
    with pytest.raises(IntegrityError, match=r"no node's keeper holds c.pt \(node 1 reads it\)"):
        transfers(offers)


def test_ranks_checking_a_memory_checkpoint_agree_on_the_save_not_on_their_nodes_directory(tmp_path):
    from deepspeed_async_ckpt.memory.restore import MemoryRestore, agreement_key

    on_node = [MemoryRestore(str(tmp_path / f"load{n}"), "step2", "sid2", owns=False) for n in (0, 1)]
    try:
        keys = {agreement_key(str(tmp_path / f"load{n}" / "step2")) for n in (0, 1)}
        assert keys == {"<memory save sid2>/step2"}
        assert agreement_key(str(tmp_path / "other" / "step2")) == str(tmp_path / "other" / "step2")
    finally:
        for restore in on_node:
            restore.close()
