"""The tier schema: bad values name their key; a tier that cannot be reached fails the engine
build with a ConfigError naming it (and nothing secret)."""

import time

import pytest

from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.errors import ConfigError
from deepspeed_async_ckpt.tiers.config import TierConfig

from helpers import make
from s3server import free_port, s3, s3_server  # noqa: F401  (fixtures)


@pytest.mark.parametrize("tiers, key", [
    ("s3://b", "async_checkpoint.tiers must be a list"),
    ([{"every": 2}], "async_checkpoint.tiers[0].url is required"),
    ([{"url": "relative/dir"}], "async_checkpoint.tiers[0].url must be an absolute path"),
    ([{"url": "gs://bucket"}], "async_checkpoint.tiers[0].url 'gs'://"),
    ([{"url": "s3:///prefix"}], "async_checkpoint.tiers[0].url 's3:///prefix' names no bucket"),
    ([{"url": "/a"}, {"url": "/b", "every": 0}], "async_checkpoint.tiers[1].every must be an integer >= 1"),
    ([{"url": "/a", "keep_last": -1}], "async_checkpoint.tiers[0].keep_last must be an integer >= 0"),
    ([{"url": "/a", "keep_last": True}], "async_checkpoint.tiers[0].keep_last must be an integer"),
    ([{"url": "/a", "retry_delay_s": 0}], "async_checkpoint.tiers[0].retry_delay_s must be a finite"),
    ([{"url": "/a", "part_size_mb": 1}], "async_checkpoint.tiers[0].part_size_mb must be an integer >= 5"),
    ([{"url": "/a", "endpoint_url": "http://x"}], "async_checkpoint.tiers[0].endpoint_url is for s3://"),
    ([{"url": "s3://b", "endpoint_url": "x"}], "async_checkpoint.tiers[0].endpoint_url must be an http(s) URL"),
    ([{"url": "/a", "colour": 1}], "unknown key(s) async_checkpoint.tiers[0].colour"),
    ([{"url": "/a"}, {"url": "/a/"}], "async_checkpoint.tiers[1].url '/a' names the same place"),
])
def test_bad_tier_values_raise_config_error_naming_the_key(tiers, key):
    with pytest.raises(ConfigError) as err:
        AsyncCheckpointConfig.from_dict({"tiers": tiers})
    assert key in str(err.value)


def test_tiers_parse_into_frozen_configs_and_round_trip():
    cfg = AsyncCheckpointConfig.from_dict({"tiers": [{"url": "s3://b/run", "every": 2, "keep_last": 5}]})
    assert cfg.tiers == (TierConfig(url="s3://b/run", every=2, keep_last=5),)
    assert AsyncCheckpointConfig.from_dict(cfg.to_dict()) == cfg
    assert AsyncCheckpointConfig().tiers == ()


def test_endpoint_password_never_shown_in_a_config_error():
    with pytest.raises(ConfigError) as err:
        AsyncCheckpointConfig.from_dict({"tiers": [{"url": "s3://b", "endpoint_url": "ftp://user:s3cret@host"}]})
    assert "s3cret" not in str(err.value) and "ftp://host" in str(err.value)


def test_unreachable_endpoint_fails_the_build_naming_the_tier(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDSECRETVALUE1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "verysecretkey")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        make(tiers=[{"url": "s3://ckpts/run1", "endpoint_url": f"http://u:pw@127.0.0.1:{port}",
                     "connect_timeout_s": 1}])
    assert time.monotonic() - t0 < 30
    message = str(err.value)
    assert "async_checkpoint.tiers[0] s3://ckpts/run1" in message and f"127.0.0.1:{port}" in message
    for secret in ("AKIDSECRETVALUE1", "verysecretkey", "u:pw"):
        assert secret not in message


def test_missing_bucket_fails_the_build_naming_the_tier(s3):
    with pytest.raises(ConfigError) as err:
        make(tiers=[{"url": "s3://no-such-bucket-here/run", "endpoint_url": s3.endpoint}])
    assert "async_checkpoint.tiers[0] s3://no-such-bucket-here/run" in str(err.value)


def test_unwritable_path_tier_fails_the_build(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as err:
        make(tiers=[{"url": str(blocker / "tier")}])
    assert f"async_checkpoint.tiers[0] {blocker / 'tier'}" in str(err.value)
