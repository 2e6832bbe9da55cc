"""The memory tier's save path in one process, with a real keeper: a memory-only save writes
nothing under the save directory and commits a slot whose files are byte for byte a disk
save's of the same state; every persist_every-th save also goes to disk; the keeper ends
with the checkpointer when the last save persisted, leaving no segment."""

import os

import pytest
import torch

from deepspeed_async_ckpt.commit import Pointer, read_manifest
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.core.figures import commit_events
from deepspeed_async_ckpt.memory.address import KeeperAddress
from deepspeed_async_ckpt.memory.client import KeeperClient

from _memory import keeper_pids
from test_memory_keeper import wait_for


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g), "step": step, "b": torch.arange(100) + step}


def _config(persist_every: int) -> AsyncCheckpointConfig:
    return AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, memory={
        "enabled": True, "persist_every": persist_every, "keep_last": 2, "idle_timeout_s": 60})


def _save(ck: AsyncCheckpointer, save_dir: str, step: int) -> None:
    tag = f"global_step{step}"
    ck.begin(os.path.join(save_dir, tag), tag=tag, pointer=Pointer(os.path.join(save_dir, "latest"), tag))
    ck.save(_state(step), os.path.join(save_dir, tag, "model.pt"))
    ck.save({"opt": _state(step + 1000)}, os.path.join(save_dir, tag, "sub", "optim.pt"))
    ck.end()
    ck.fence()


@pytest.fixture
def save_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))  # the keepers' logs: the test's
    (tmp_path / "run").mkdir()
    path = str(tmp_path / "ckpts")
    yield path
    client = KeeperClient.find(path)
    if client is not None:
        client.shutdown()


def test_a_memory_only_save_writes_nothing_on_disk_and_its_slot_holds_a_disk_saves_bytes(save_dir, tmp_path):
    events = []
    ck = AsyncCheckpointer(_config(persist_every=2), on_commit=lambda info: events.append(info))
    try:
        _save(ck, save_dir, 1)  # the first save of a run persists
        ck.wait()
        before = sorted(os.listdir(save_dir))
        _save(ck, save_dir, 2)  # memory only
        ck.wait()
        assert sorted(os.listdir(save_dir)) == before  # nothing new, not even records
        assert not os.path.exists(os.path.join(save_dir, "global_step2"))
        with open(os.path.join(save_dir, "latest")) as f:
            assert f.read() == "global_step1"  # the pointer names the newest on disk
        copy = KeeperClient.find(save_dir).newest()
        assert (copy.name, copy.manifest["tag"]) == ("global_step2", "global_step2")
        assert KeeperClient.newest_name(save_dir) == "global_step2"
        assert KeeperClient.newest_name(str(tmp_path / "no-such-job")) is None  # no keeper there
        assert sorted(copy.files(0)) == ["model.pt", os.path.join("sub", "optim.pt")]
    finally:
        ck.close()
    # the same state saved to disk without the tier: the same bytes, the same manifest entries
    plain_dir = str(tmp_path / "plain")
    plain = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    _save(plain, plain_dir, 2)
    plain.close()
    disk_manifest = read_manifest(os.path.join(plain_dir, "global_step2"))
    for rel in ("model.pt", os.path.join("sub", "optim.pt")):
        with open(os.path.join(plain_dir, "global_step2", rel), "rb") as f:
            assert bytes(copy.read(0, rel)) == f.read(), rel
        assert copy.manifest["files"][rel] == disk_manifest["files"][rel]
    copy.close()
    assert torch.equal(torch.load(os.path.join(plain_dir, "global_step2", "model.pt"))["w"], _state(2)["w"])
    assert [(e.tag, e.memory_only) for e in events] == [("global_step1", False), ("global_step2", True)]
    names = {name: value for name, value, _ in commit_events(events[1], 2)}
    assert names["async-ckpt/memory-only"] == 1 and names["async-ckpt/memory-committed-s"] > 0


def test_every_persist_every_th_save_goes_to_disk_and_the_keeper_ends_with_the_job(save_dir):
    address = KeeperAddress.of(save_dir)
    ck = AsyncCheckpointer(_config(persist_every=3))
    try:
        for step in range(1, 8):  # saves 0..6: 0, 3 and 6 persist
            _save(ck, save_dir, step)
        ck.wait()
        on_disk = sorted(n for n in os.listdir(save_dir) if n.startswith("global_step"))
        assert on_disk == ["global_step1", "global_step4", "global_step7"]
        copy = KeeperClient.find(save_dir).newest()
        assert copy.name == "global_step7"
        assert copy.manifest == read_manifest(os.path.join(save_dir, "global_step7"))
        data = copy.read(0, "model.pt")
        assert torch.equal(torch.load(_Bytes(data))["w"], _state(7)["w"])
        data.release()
        copy.close()
        pids = keeper_pids(save_dir)
        assert len(pids) == 1 and address.segments_on_node()
    finally:
        ck.close()
    wait_for(lambda: not keeper_pids(save_dir))
    assert address.segments_on_node() == []
    assert KeeperClient.find(save_dir) is None


def _Bytes(view):
    import io
    return io.BytesIO(bytes(view))


def test_a_save_the_keeper_refuses_fails_naming_max_gb_and_leaves_nothing_held(save_dir):
    config = AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, memory={
        "enabled": True, "persist_every": 1, "max_gb": 16 / 2**20, "idle_timeout_s": 60})  # 16 KiB
    ck = AsyncCheckpointer(config)
    try:
        tag = "global_step1"
        ck.begin(os.path.join(save_dir, tag), tag=tag, pointer=Pointer(os.path.join(save_dir, "latest"), tag))
        ck.save(_state(1), os.path.join(save_dir, tag, "model.pt"))
        ck.end()
        with pytest.raises(Exception, match="async_checkpoint.memory.max_gb"):
            ck.wait()  # a background failure: raised at the next wait or begin
        assert not os.path.exists(os.path.join(save_dir, "latest"))  # never committed
        keeper = KeeperClient.find(save_dir)
        assert keeper.newest() is None and keeper.status().slots == ()  # nothing held
        keeper.close()
    finally:
        ck.close()


class _Marker:
    """A finalize step as Megatron's markers are one: a file written once every rank persisted."""
    files = ("marker.json",)

    def __call__(self, ctx):
        ctx.write_file("marker.json", f'{{"tag": "{ctx.tag}", "files": {len(ctx.manifest["files"])}}}')


def test_a_persist_saves_slot_holds_the_files_its_finalize_steps_wrote(save_dir):
    ck = AsyncCheckpointer(_config(persist_every=1))  # every save persists
    try:
        ck.begin(os.path.join(save_dir, "global_step1"), tag="global_step1",
                 pointer=Pointer(os.path.join(save_dir, "latest"), "global_step1"), finalize=[_Marker()])
        ck.save(_state(1), os.path.join(save_dir, "global_step1", "model.pt"))
        ck.end()
        ck.wait()
        with open(os.path.join(save_dir, "global_step1", "marker.json"), "rb") as f:
            on_disk = f.read()
        copy = KeeperClient.find(save_dir).newest()
        assert copy.name == "global_step1" and copy.late == {"marker.json": on_disk}
        assert on_disk == b'{"tag": "global_step1", "files": 1}'
        copy.close()
    finally:
        ck.close()


def test_a_memory_only_saves_finalize_steps_write_into_the_keeper_and_a_restore_lays_their_files_out(save_dir):
    from deepspeed_async_ckpt.commit.layout import LATE_FILES, META_DIR
    from deepspeed_async_ckpt.commit.manifest import read_manifest as manifest_of
    from deepspeed_async_ckpt.commit.verify import verify_checkpoint
    from deepspeed_async_ckpt.memory.restore import restore_from_memory

    ck = AsyncCheckpointer(_config(persist_every=2))
    try:
        for step in (1, 2):  # the second stays in memory only
            tag = f"global_step{step}"
            ck.begin(os.path.join(save_dir, tag), tag=tag, pointer=Pointer(os.path.join(save_dir, "latest"), tag),
                     finalize=[_Marker()])
            ck.save(_state(step), os.path.join(save_dir, tag, "model.pt"))
            ck.end()
            ck.wait()
        assert not os.path.exists(os.path.join(save_dir, "global_step2"))  # its marker too
        copy = KeeperClient.find(save_dir).newest()
        assert copy.name == "global_step2" and copy.manifest["late_files"] == ["marker.json"]
        assert copy.late == {"marker.json": b'{"tag": "global_step2", "files": 1}'}
        copy.close()
        restored = restore_from_memory(save_dir, ck.config.memory, rank=0, world_size=1, pointer_name="latest",
                                       on_disk=lambda: None, exchange=ck.exchange)
        assert restored is not None
        try:
            ckpt = os.path.join(restored.load_dir, "global_step2")
            with open(os.path.join(ckpt, "marker.json"), "rb") as f:
                assert f.read() == b'{"tag": "global_step2", "files": 1}'
            assert os.path.exists(os.path.join(ckpt, META_DIR, LATE_FILES))  # recorded: verify covers it
            verify_checkpoint(ckpt, manifest=manifest_of(ckpt))
        finally:
            restored.close()
    finally:
        ck.close()


def test_closing_after_a_memory_only_last_save_warns_that_the_disk_holds_an_older_one(save_dir, caplog):
    ck = AsyncCheckpointer(_config(persist_every=2))
    for step in (1, 2):  # the second stays in memory only
        _save(ck, save_dir, step)
    with caplog.at_level("WARNING", logger="deepspeed_async_ckpt"):
        ck.close()
    warned = [r.getMessage() for r in caplog.records if "in the memory tier only" in r.getMessage()]
    assert len(warned) == 1 and "global_step2" in warned[0] and "idle_timeout_s (60 s)" in warned[0]
    assert KeeperClient.find(save_dir) is not None  # kept for a restart
    caplog.clear()
    ck = AsyncCheckpointer(_config(persist_every=2))
    _save(ck, save_dir, 3)  # the first save of a run persists: no warning, the keeper ends
    with caplog.at_level("WARNING", logger="deepspeed_async_ckpt"):
        ck.close()
    assert not [r for r in caplog.records if "in the memory tier only" in r.getMessage()]
