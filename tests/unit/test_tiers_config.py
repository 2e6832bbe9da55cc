"""The tier schema: bad values name their key and what is allowed; tiers lie apart from each
other and from the checkpoint directory; no credential is kept or shown; a tier that cannot be
reached fails the engine build with a ConfigError naming it (and nothing secret)."""

import logging
import os
import time

import pytest

from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.errors import ConfigError
from deepspeed_async_ckpt.tiers import config as tier_config
from deepspeed_async_ckpt.tiers.config import TierConfig, refuse_overlap, without_credentials

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
    ([{"url": "/a", "endpoint_url": "http://x"}], "async_checkpoint.tiers[0].endpoint_url is for s3://"),
    ([{"url": "s3://bkt", "endpoint_url": "x"}], "async_checkpoint.tiers[0].endpoint_url must be an http(s) URL"),
    ([{"url": "/a", "colour": 1}], "unknown key(s) async_checkpoint.tiers[0].colour"),
    ([{"url": "/a"}, {"url": "/a/"}], "async_checkpoint.tiers[1].url '/a/' names the same place as "
                                      "async_checkpoint.tiers[0].url '/a'"),
    # S3's part limits (5 MiB to 5 GiB), a bound on the parts in flight
    ([{"url": "s3://bkt/p", "part_size_mb": 6000}],
     "async_checkpoint.tiers[0].part_size_mb must be an integer in [5, 5120], got 6000"),
    ([{"url": "s3://bkt/p", "part_size_mb": 4}], "async_checkpoint.tiers[0].part_size_mb must be an integer in [5, 5120]"),
    ([{"url": "/a", "concurrency": 1000000}],
     "async_checkpoint.tiers[0].concurrency must be an integer in [1, 256], got 1000000"),
    # the root, '.', '..' and empty segments
    ([{"url": "/"}], "async_checkpoint.tiers[0].url '/' is the filesystem root"),
    ([{"url": "/tmp/.."}], "async_checkpoint.tiers[0].url '/tmp/..' is the filesystem root"),
    ([{"url": "/a/../b"}], "async_checkpoint.tiers[0].url '/a/../b' has an empty, '.' or '..' segment"),
    ([{"url": "/a/./b"}], "async_checkpoint.tiers[0].url '/a/./b' has an empty, '.' or '..' segment"),
    ([{"url": "/a//b"}], "async_checkpoint.tiers[0].url '/a//b' has an empty, '.' or '..' segment"),
    ([{"url": "s3://bkt/../p"}], "async_checkpoint.tiers[0].url 's3://bkt/../p' has an empty, '.' or '..' segment"),
    ([{"url": "s3://bkt//p"}], "async_checkpoint.tiers[0].url 's3://bkt//p' has an empty, '.' or '..' segment"),
    ([{"url": "s3://bkt/p/./q"}], "async_checkpoint.tiers[0].url 's3://bkt/p/./q' has an empty, '.' or '..' segment"),
    # S3's bucket naming rules, at parse rather than as botocore's error at engine build
    ([{"url": "s3://Bad_Bucket!/p"}], "async_checkpoint.tiers[0].url 's3://Bad_Bucket!/p': bucket "
                                      "'Bad_Bucket!' is not a valid S3 bucket name (3 to 63 characters"),
    ([{"url": "s3://b/p"}], "bucket 'b' is not a valid S3 bucket name"),
    ([{"url": f"s3://{'a' * 64}/p"}], "is not a valid S3 bucket name"),
    ([{"url": "s3://-bkt/p"}], "bucket '-bkt' is not a valid S3 bucket name"),
    ([{"url": "s3://my..bkt/p"}], "bucket 'my..bkt' is not a valid S3 bucket name"),
    ([{"url": "s3://192.168.1.1/p"}], "bucket '192.168.1.1' is not a valid S3 bucket name"),
    # tiers nested in each other
    ([{"url": "/x"}, {"url": "/x/sub"}], "async_checkpoint.tiers[1].url '/x/sub' lies inside "
                                         "async_checkpoint.tiers[0].url '/x'"),
    ([{"url": "/x/sub"}, {"url": "/x"}], "async_checkpoint.tiers[1].url '/x' contains "
                                         "async_checkpoint.tiers[0].url '/x/sub'"),
    ([{"url": "s3://bkt/p"}, {"url": "s3://bkt/p/q"}], "async_checkpoint.tiers[1].url 's3://bkt/p/q' lies "
                                                       "inside async_checkpoint.tiers[0].url 's3://bkt/p'"),
    ([{"url": "s3://bkt/p/q"}, {"url": "s3://bkt"}], "async_checkpoint.tiers[1].url 's3://bkt' contains"),
])
def test_bad_tier_values_raise_config_error_naming_the_key(tiers, key):
    with pytest.raises(ConfigError) as err:
        AsyncCheckpointConfig.from_dict({"tiers": tiers})
    assert key in str(err.value)


def test_tiers_parse_into_frozen_configs_and_round_trip():
    cfg = AsyncCheckpointConfig.from_dict({"tiers": [{"url": "s3://bkt/run", "every": 2, "keep_last": 5}]})
    assert cfg.tiers == (TierConfig(url="s3://bkt/run", every=2, keep_last=5),)
    assert AsyncCheckpointConfig.from_dict(cfg.to_dict()) == cfg
    assert AsyncCheckpointConfig().tiers == ()


def test_endpoint_password_never_shown_in_a_config_error():
    with pytest.raises(ConfigError) as err:
        AsyncCheckpointConfig.from_dict({"tiers": [{"url": "s3://bkt", "endpoint_url": "ftp://user:s3cret@host"}]})
    assert "s3cret" not in str(err.value) and "ftp://host" in str(err.value)


@pytest.mark.parametrize("tiers", [
    [{"url": "/a/", "part_size_mb": 5, "concurrency": 1}],
    [{"url": "s3://bkt/p", "part_size_mb": 5120, "concurrency": 256}],
    [{"url": "s3://my.bucket-1/run/a/"}, {"url": "s3://my.bucket-1/run/b"}],  # siblings
    [{"url": "/x/a"}, {"url": "/x/ab"}],  # a name that starts like another is not inside it
    # the same bucket and prefix on two servers are two places
    [{"url": "s3://bkt/p", "endpoint_url": "http://a:9000"}, {"url": "s3://bkt/p", "endpoint_url": "http://b:9000"}],
])
def test_tier_values_at_their_limits_and_tiers_apart_are_accepted(tiers):
    assert len(AsyncCheckpointConfig.from_dict({"tiers": tiers}).tiers) == len(tiers)


def test_tiers_nested_through_a_symlink_are_refused(tmp_path):
    (tmp_path / "real" / "sub").mkdir(parents=True)
    os.symlink(tmp_path / "real" / "sub", tmp_path / "link")
    with pytest.raises(ConfigError) as err:
        AsyncCheckpointConfig.from_dict({"tiers": [{"url": str(tmp_path / "real")},
                                                   {"url": str(tmp_path / "link")}]})
    assert (f"async_checkpoint.tiers[1].url '{tmp_path / 'link'}' (resolved: {tmp_path / 'real' / 'sub'}) "
            f"lies inside async_checkpoint.tiers[0].url '{tmp_path / 'real'}'") in str(err.value)
    os.symlink("/", tmp_path / "root")
    with pytest.raises(ConfigError, match="is the filesystem root"):
        AsyncCheckpointConfig.from_dict({"tiers": [{"url": str(tmp_path / "root")}]})


@pytest.mark.parametrize("layout, how", [
    ("{d}/tier", "lies inside"),  # a tier inside the checkpoint directory
    ("{d}", "is"),  # the checkpoint directory itself
    ("{d}/..", "contains"),  # the checkpoint directory inside the tier
    ("{link}", "is"),  # the checkpoint directory through a symlink
])
def test_a_tier_that_is_contains_or_lies_inside_the_checkpoint_directory_is_refused(tmp_path, layout, how):
    save_dir = tmp_path / "run" / "ckpt"
    save_dir.mkdir(parents=True)
    os.symlink(save_dir, tmp_path / "link")
    url = os.path.normpath(layout.format(d=save_dir, link=tmp_path / "link"))
    tiers = AsyncCheckpointConfig.from_dict({"tiers": [{"url": "s3://bkt/p"}, {"url": url}]}).tiers
    with pytest.raises(ConfigError) as err:
        refuse_overlap(tiers, str(save_dir))
    assert f"async_checkpoint.tiers[1].url '{url}'" in str(err.value)
    assert f"{how} the checkpoint directory '{save_dir}'" in str(err.value)
    refuse_overlap(tiers, str(tmp_path / "elsewhere"))  # apart


def test_a_save_or_load_into_a_tier_is_refused_before_anything_is_written(tmp_path):
    """The core refuses to begin a checkpoint whose directory a tier is, contains or lies in."""
    from helpers import save_one, sample_state

    save_dir = tmp_path / "ckpt"
    ck = make(tiers=[{"url": str(save_dir / "tier")}])  # the tier's own directory is made here
    try:
        with pytest.raises(ConfigError, match=r"tiers\[0\]\.url .* lies inside the checkpoint directory"):
            save_one(ck, str(save_dir), sample_state())
        assert sorted(os.listdir(save_dir)) == ["tier"] and os.listdir(save_dir / "tier") == []
        assert not ck.is_open
    finally:
        ck.close()


def test_a_password_in_the_endpoint_is_dropped_at_parse_and_from_saved_configs(caplog, monkeypatch):
    """The user information of ``endpoint_url`` is never used (requests are signed with
    boto3's credentials): dropped at parse with one warning that does not show it, and
    :func:`without_credentials` removes it from the raw config a framework saves or logs."""
    raw = {"train_batch_size": 2, "async_checkpoint": {"enabled": True, "tiers": [
        {"url": "/a"}, {"url": "s3://bkt/p", "endpoint_url": "http://user:PASSW0RDSECRET@127.0.0.1:9000/x"}]}}
    monkeypatch.setattr(tier_config, "_WARNED", set())  # warned once per process
    with caplog.at_level(logging.WARNING):
        cfg = AsyncCheckpointConfig.from_dict(raw["async_checkpoint"])
    assert cfg.tiers[1].endpoint_url == "http://127.0.0.1:9000/x"
    assert "PASSW0RDSECRET" not in repr(cfg) + str(cfg.to_dict()) + caplog.text
    assert "endpoint_url holds a user name or password, which is not used" in caplog.text
    safe = without_credentials(raw)
    assert safe["async_checkpoint"]["tiers"][1]["endpoint_url"] == "http://127.0.0.1:9000/x"
    assert "PASSW0RDSECRET" not in repr(safe) and "PASSW0RDSECRET" in repr(raw)  # a copy
    assert safe["train_batch_size"] == 2 and safe["async_checkpoint"]["tiers"][0] == {"url": "/a"}
    assert without_credentials(raw["async_checkpoint"])["tiers"][1]["endpoint_url"] == "http://127.0.0.1:9000/x"
    assert without_credentials(safe) is safe and without_credentials("cfg.json") == "cfg.json"
    with pytest.raises(ConfigError) as err:  # nor in a URL that cannot be parsed
        AsyncCheckpointConfig.from_dict({"tiers": [{"url": "s3://bkt", "endpoint_url": "http://u:PASSW0RDSECRET@h:x"}]})
    assert "PASSW0RDSECRET" not in str(err.value) and "endpoint_url must be an http(s) URL" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a credential put in the s3:// URL is not echoed
        AsyncCheckpointConfig.from_dict({"tiers": [{"url": "s3://AKIAKEY:PASSW0RDSECRET@bkt/p"}]})
    assert "PASSW0RDSECRET" not in str(err.value) and "s3://bkt/p" in str(err.value)


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
