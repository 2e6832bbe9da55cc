"""Real DeepSpeed runs (one rank, CPU) with tiers configured: no credential of a tier reaches
a file, an object or a log line (DeepSpeed alone, with the engine enabled or not, and under
Hugging Face Trainer), and a tier that is, contains or lies inside the checkpoint directory is
refused before anything is written."""

import json
import os
from urllib.parse import urlsplit

import pytest
import torch

from conftest import REPO
from deepspeed_async_ckpt.tools.launch import launch
from s3server import s3, s3_server  # noqa: F401  (fixtures)

WORKER = os.path.join(REPO, "tests", "integration", "workers", "tiers_config_ds_worker.py")
HF_WORKER = os.path.join(REPO, "tests", "integration", "workers", "hf_worker.py")
SECRET = b"SECRETPASSWORD"

pytestmark = pytest.mark.slow


def test_no_file_object_or_log_line_of_a_run_holds_the_endpoints_password(tmp_path, s3, repo_env):
    """``endpoint_url`` with a user name and password: DeepSpeed saves its whole config into the
    model and optimizer states, and logs it at INFO (with ``dump_state``, its engine's
    attributes too, the raw config among them). Every file of the save directory, every
    object of the bucket and every log line is searched for the password; the saved config
    keeps the endpoint without it, and the drain worked (requests are signed with the
    environment's credentials)."""
    env = dict(repo_env, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")
    parts = urlsplit(s3.endpoint)
    endpoint = f"{parts.scheme}://user:{SECRET.decode()}@{parts.netloc}"
    out = tmp_path / "out"
    out.mkdir()
    log = str(tmp_path / "log")
    assert launch(WORKER, ["secret", "--out", str(out), "--url", s3.url("job"), "--endpoint", endpoint],
                  1, timeout=300, env=env, log_prefix=log) == [0]
    assert json.load(open(out / "drained.json")) == ["global_step1", "global_step2"]
    logs = open(f"{log}.rank0.log", "rb").read()
    assert b"DeepSpeedEngine configuration" in logs and b"async_checkpoint" in logs  # its config, logged
    files = [os.path.join(d, n) for d, _, names in os.walk(out) for n in names]
    keys = s3.keys()
    assert len(files) > 6 and any(k.endswith("optim_states.pt") for k in keys)
    holding = [f for f in files if SECRET in open(f, "rb").read()]
    holding += [f"s3://{s3.name}/{k}" for k in keys if SECRET in s3.get(k)]
    holding += ["the log"] if SECRET in logs else []
    assert holding == []
    model = torch.load(out / "ckpt" / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
    assert model["ds_config"]["async_checkpoint"]["tiers"][0]["endpoint_url"] == s3.endpoint


def test_with_the_engine_disabled_deepspeeds_own_checkpoints_and_logs_hold_no_endpoint_password(tmp_path,
                                                                                                repo_env):
    """The same config with ``"enabled": false``: DeepSpeed's own checkpoint engine saves, and
    it too puts the whole config into every model and optimizer state file and logs it. Every
    file of the save directory and every log line is searched for the password (the tier is
    never reached: nothing is drained)."""
    endpoint = f"http://user:{SECRET.decode()}@127.0.0.1:9"
    out = tmp_path / "out"
    out.mkdir()
    log = str(tmp_path / "log")
    assert launch(WORKER, ["secret", "--disabled", "--out", str(out), "--url", "s3://bucket/job",
                           "--endpoint", endpoint], 1, timeout=300, env=repo_env, log_prefix=log) == [0]
    assert json.load(open(out / "engine.json")) == "TorchCheckpointEngine"
    logs = open(f"{log}.rank0.log", "rb").read()
    assert b"DeepSpeedEngine configuration" in logs and b"async_checkpoint" in logs
    files = [os.path.join(d, n) for d, _, names in os.walk(out) for n in names]
    assert sum(f.endswith(".pt") for f in files) == 4  # model and optimizer states, two saves
    holding = [f for f in files if SECRET in open(f, "rb").read()] + (["the log"] if SECRET in logs else [])
    assert holding == []
    model = torch.load(out / "ckpt" / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
    assert model["ds_config"]["async_checkpoint"]["tiers"][0]["endpoint_url"] == "http://127.0.0.1:9"


@pytest.mark.parametrize("enabled", [True, False])
def test_no_file_trainer_writes_holds_a_tiers_endpoint_password(tmp_path, s3, repo_env, enabled):
    """Under Hugging Face Trainer: it pickles its ``TrainingArguments`` (the DeepSpeed config as
    given, and transformers' and accelerate's copies of it) into every
    ``checkpoint-N/training_args.bin``, and reporting integrations log ``args.to_json_string()``
    when training begins (the worker writes it to ``args.json``). Every file of the output
    directory and every object of the bucket is searched for the password; every save
    committed (and drained, the engine enabled), and the config given to ``TrainingArguments``
    is left as it was. With ``"enabled": false`` (DeepSpeed's own engine saves) too."""
    pytest.importorskip("transformers")
    env = dict(repo_env, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")
    parts = urlsplit(s3.endpoint)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--out", str(out), "--max-steps", "4", "--tier", s3.url("job"),
            "--endpoint", f"{parts.scheme}://user:{SECRET.decode()}@{parts.netloc}"]
    assert launch(HF_WORKER, args + ([] if enabled else ["--disabled"]), 1, timeout=300, env=env,
                  log_prefix=str(tmp_path / "log")) == [0]
    assert json.load(open(out / "drained.json")) == {
        "drained": ["global_step2", "global_step4"] if enabled else None, "given_config_kept": True}
    run = out / "run"
    assert sorted(os.listdir(run)) == ["checkpoint-2", "checkpoint-4"]
    for step in (2, 4):
        assert open(run / f"checkpoint-{step}" / "latest").read().strip() == f"global_step{step}"
    files = [os.path.join(d, n) for d, _, names in os.walk(out) for n in names]
    assert any(f.endswith("training_args.bin") for f in files) and (out / "args.json").exists()
    holding = [f for f in files if SECRET in open(f, "rb").read()]
    holding += [f"s3://{s3.name}/{k}" for k in s3.keys() if SECRET in s3.get(k)]
    assert holding == []
    saved = torch.load(run / "checkpoint-4" / "training_args.bin", weights_only=False)
    assert saved.deepspeed["async_checkpoint"]["tiers"][0]["endpoint_url"] == s3.endpoint
    assert saved.hf_deepspeed_config.config["async_checkpoint"]["tiers"][0]["endpoint_url"] == s3.endpoint


def test_a_tier_that_is_contains_or_lies_inside_the_checkpoint_directory_is_refused(tmp_path, repo_env):
    """``<save_dir>/tier`` as a tier, ``save_dir`` itself, and a tier holding ``save_dir``:
    save_checkpoint and load_checkpoint refuse each, naming the key and the directory, and
    nothing is written (the tier's own directory is made at engine build, when it is checked)."""
    save_dir = tmp_path / "ckpt"
    tiers = {str(save_dir / "tier"): "lies inside", str(save_dir): "is", str(tmp_path): "contains"}
    args = ["apart", "--out", str(tmp_path)] + [a for url in tiers for a in ("--tier", url)]
    assert launch(WORKER, args, 1, timeout=300, env=repo_env, log_prefix=str(tmp_path / "log")) == [0]
    errors = json.load(open(tmp_path / "apart.json"))
    for url, how in tiers.items():
        for call in ("save_checkpoint", "load_checkpoint"):
            message = errors[f"{url} {call}"]
            assert message is not None and message.startswith(
                f"async_checkpoint.tiers[0].url '{url}' {how} the checkpoint directory '{save_dir}'"), message
    assert [os.path.join(d, n) for d, _, names in os.walk(save_dir) for n in names] == []
    assert os.listdir(save_dir) == ["tier"]
