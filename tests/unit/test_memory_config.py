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
