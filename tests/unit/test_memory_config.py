"""The memory tier's schema: bad values name their key, good ones parse into a frozen config."""

import dataclasses

import pytest

from deepspeed_async_ckpt.errors import ConfigError
from deepspeed_async_ckpt.memory.config import MemoryConfig, parse_memory


@pytest.mark.parametrize("raw, message", [
    ({"keep_last": 0}, "async_checkpoint.memory.keep_last must be an integer >= 1, got 0"),
    ({"keep_last": True}, "async_checkpoint.memory.keep_last must be an integer >= 1, got True"),
    ({"persist_every": 2.5}, "async_checkpoint.memory.persist_every must be an integer >= 1, got 2.5"),
    ({"enabled": "yes"}, "async_checkpoint.memory.enabled must be true or false, got 'yes'"),
    ({"max_gb": 0}, "async_checkpoint.memory.max_gb must be a finite number of GiB > 0"),
    ({"max_gb": float("inf")}, "async_checkpoint.memory.max_gb must be a finite number of GiB > 0"),
    ({"idle_timeout_s": -1}, "async_checkpoint.memory.idle_timeout_s must be a finite number of seconds > 0"),
    ({"keepers": 1}, "unknown key(s) async_checkpoint.memory.keepers"),
    ([1], "async_checkpoint.memory must be a JSON object"),
])
def test_bad_memory_values_raise_config_error_naming_the_key(raw, message):
    with pytest.raises(ConfigError) as err:
        parse_memory(raw)
    assert message in str(err.value)


def test_memory_block_parses_into_a_frozen_config():
    cfg = parse_memory({"enabled": True, "persist_every": 10, "keep_last": 2, "max_gb": 1.5})
    assert cfg == MemoryConfig(enabled=True, persist_every=10, keep_last=2, max_gb=1.5)
    assert cfg.max_bytes == 3 << 29
    assert parse_memory(cfg) is cfg
    assert parse_memory(None) == MemoryConfig() and not MemoryConfig().enabled
    assert MemoryConfig().max_bytes is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.keep_last = 3


def test_async_checkpoint_block_parses_memory_once_into_its_config():
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig

    cfg = AsyncCheckpointConfig.from_dict({"memory": {"enabled": True, "persist_every": 3}})
    assert cfg.memory == MemoryConfig(enabled=True, persist_every=3)
    assert AsyncCheckpointConfig().memory == MemoryConfig()  # off unless asked
    assert dataclasses.replace(cfg).memory is cfg.memory


@pytest.mark.parametrize("raw, message", [
    ({"memory": {"keep_last": 0}}, "async_checkpoint.memory.keep_last must be an integer >= 1"),
    ({"memory": {"enabled": True}, "mode": "sync"},
     "async_checkpoint.memory.enabled needs async_checkpoint.mode \"async\", got 'sync'"),
    ({"memory": {"enabled": True}, "persist_in": "process"},
     "async_checkpoint.memory.enabled needs async_checkpoint.persist_in \"thread\", got 'process'"),
    ({"memory": {"enabled": True}, "node_local": True},
     "async_checkpoint.memory.enabled with async_checkpoint.node_local"),
])
def test_memory_combinations_that_cannot_work_are_refused_naming_the_keys(raw, message):
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig

    with pytest.raises(ConfigError) as err:
        AsyncCheckpointConfig.from_dict(raw)
    assert message in str(err.value)


def test_memory_off_leaves_sync_mode_and_the_worker_process_alone():
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig

    cfg = AsyncCheckpointConfig.from_dict({"memory": {"persist_every": 2}, "mode": "sync",
                                           "persist_in": "process"})
    assert not cfg.memory.enabled


def test_each_node_writes_its_own_keeper_and_its_leader_awaits_rank_0s_commit(monkeypatch):
    from deepspeed_async_ckpt.core.memory_saves import MemorySaves
    from deepspeed_async_ckpt.memory.address import KeeperAddress
    from deepspeed_async_ckpt.memory.config import MemoryConfig

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    saves = {r: MemorySaves(MemoryConfig(enabled=True), rank=r, world_size=5, commit_timeout_s=1) for r in range(5)}
    assert [(s.node, s.node_ranks, s.awaits_commit) for s in saves.values()] == [
        (0, (0, 1), False), (0, (0, 1), False), (1, (2, 3), True), (1, (2, 3), False), (2, (4,), True)]
    # one keeper per node of a save directory: their names never meet, even on one host
    keys = {KeeperAddress.of("/ckpt", node=n).key for n in range(3)}
    assert len(keys) == 3 and KeeperAddress.of("/ckpt").key == KeeperAddress.of("/ckpt", node=0).key
