import json

import pytest

from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.errors import ConfigError
from deepspeed_async_ckpt.integrations.deepspeed.patches import parse_config


def test_defaults_and_round_trip():
    cfg = AsyncCheckpointConfig.from_dict({"enabled": True, "host_buffer_gb": 0.5, "writer_threads": 2})
    assert cfg.host_buffer_bytes == 512 * 1024**2
    assert cfg.is_async and cfg.checksum == "xxh128" and cfg.persist_in == "thread"
    assert AsyncCheckpointConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_key_is_named_with_allowed_keys():
    with pytest.raises(ConfigError) as e:
        AsyncCheckpointConfig.from_dict({"enabled": True, "host_bufer_gb": 8})
    assert "async_checkpoint.host_bufer_gb" in str(e.value)
    assert "host_buffer_gb" in str(e.value)


@pytest.mark.parametrize("key,value,fragment", [
    ("mode", "lazy", "'async', 'sync'"),
    ("checksum", "md5", "'xxh128', 'crc32', 'sha256', 'none'"),
    ("persist_in", "subprocess", "'thread', 'process'"),
    ("host_buffer_gb", 0, "> 0"),
    ("host_buffer_gb", "8", "> 0"),
    ("host_buffer_gb", float("inf"), "finite"),  # accepted before; the engine then overflowed
    ("host_buffer_gb", 1e-7, "at least one page"),  # 107 bytes: accepted, every save then failed
    ("host_buffer_gb", 1e-300, "at least one page"),
    ("writer_threads", 0, "[1, 64]"),
    ("writer_threads", 2.5, "[1, 64]"),
    ("enabled", "yes", "true or false"),
    ("commit_timeout_s", -1, "> 0"),
    ("keep_last", -1, "integer >= 0"),
    ("keep_last", 2.0, "integer >= 0"),
    ("keep_last", True, "integer >= 0"),
])
def test_bad_values_name_key_and_allowed(key, value, fragment):
    with pytest.raises(ConfigError) as e:
        AsyncCheckpointConfig.from_dict({key: value})
    assert f"async_checkpoint.{key}" in str(e.value)
    assert fragment in str(e.value)


def test_absent_or_disabled_key_means_deepspeed_unchanged():
    assert parse_config({"train_batch_size": 8}) is None
    assert parse_config({"async_checkpoint": {"enabled": False}}) is None
    assert parse_config({"async_checkpoint": {"enabled": True}}).enabled


@pytest.mark.parametrize("other,named", [
    ({"checkpoint": {"writer": {"decoupled": True}}}, "checkpoint.writer"),
    ({"checkpoint": {"writer": {}}}, "checkpoint.writer"),
    ({"datastates_ckpt": {"host_cache_size": 16}}, "datastates_ckpt"),
])
def test_deepspeeds_own_engine_choice_beside_the_key_is_a_config_error_naming_both(other, named):
    """DeepSpeed picks its decoupled, fast or DataStates engine from these keys; with
    ``async_checkpoint`` enabled too, one of the two choices would be silently ignored.
    Disabled, or DeepSpeed's own keys without a writer, they go together."""
    with pytest.raises(ConfigError, match=f"async_checkpoint and {named} both choose"):
        parse_config({"async_checkpoint": {"enabled": True}, **other})
    assert parse_config({"async_checkpoint": {"enabled": False}, **other}) is None
    assert parse_config({"async_checkpoint": {"enabled": True}, "datastates_ckpt": False,
                         "checkpoint": {"tag_validation": "Ignore", "writer": None}}).enabled


def test_from_file_accepts_block_or_wrapped(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"enabled": True, "mode": "sync"}))
    (tmp_path / "b.json").write_text(json.dumps({"async_checkpoint": {"enabled": True, "mode": "sync"}}))
    assert AsyncCheckpointConfig.from_file(tmp_path / "a.json") == AsyncCheckpointConfig.from_file(tmp_path / "b.json")
    with pytest.raises(ConfigError, match="missing.json"):
        AsyncCheckpointConfig.from_file(tmp_path / "missing.json")


def test_every_example_config_is_valid():
    import glob
    import os
    from conftest import REPO

    files = glob.glob(os.path.join(REPO, "configs", "*.json"))
    assert files
    for path in files:
        with open(path) as f:
            raw = json.load(f)
        block = raw.get("async_checkpoint", raw)
        assert AsyncCheckpointConfig.from_dict(block).enabled, path


def test_the_core_checkpointer_refuses_what_it_cannot_run_with_naming_the_argument(tmp_path):
    """``AsyncCheckpointer`` checked none of its own arguments:
    ``world_size=0`` committed a manifest listing no file, which ``verify`` called OK;
    ``rank=1, world_size=1`` never committed and ``wait`` returned; a dict as ``config`` failed
    with an ``AttributeError``; ``wait(timeout=inf)`` with an ``OverflowError``."""
    import torch

    from deepspeed_async_ckpt import AsyncCheckpointer
    from deepspeed_async_ckpt.commit import Pointer

    cfg = AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01)
    for kwargs, fragment in [({"world_size": 0}, "world_size=0"), ({"world_size": 1.0}, "world_size=1.0"),
                             ({"rank": -1}, "rank=-1"), ({"rank": True}, "rank=True"),
                             ({"rank": 1, "world_size": 1}, "rank must be below world_size")]:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
            AsyncCheckpointer(cfg, **kwargs)
    with pytest.raises(TypeError, match="an AsyncCheckpointConfig, got a dict"):
        AsyncCheckpointer({"enabled": True})
    ck = AsyncCheckpointer(cfg)
    for bad in (float("nan"), -1, "5"):
        with pytest.raises(ValueError, match="wait\\(timeout="):
            ck.wait(timeout=bad)
    for bad in (-5, 1.5):
        with pytest.raises(ValueError, match="reserve\\(nbytes="):
            ck.reserve(bad)
    d = str(tmp_path / "t")
    ck.begin(d, tag="t", pointer=Pointer(str(tmp_path / "latest"), "t"))
    ck.save({"w": torch.ones(4)}, str(tmp_path / "t" / "m.pt"))
    ck.end()
    ck.wait(timeout=float("inf"))  # no bound: waits for the commit
    assert (tmp_path / "latest").read_text() == "t"
    ck.close()
