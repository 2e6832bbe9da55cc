"""Trainer's copies of the DeepSpeed config lose the tiers' endpoint user information
(deepspeed_async_ckpt/integrations/hf_trainer/credentials.py), on real ``TrainingArguments``
with their accelerate plugin: what ``training_args.bin`` pickles holds none, the config as given
is left as it is."""

import copy
import io
import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from deepspeed_async_ckpt.integrations.hf_trainer.credentials import forget_credentials  # noqa: E402

SECRET = "SECRETPASSWORD"
ENDPOINT = "http://127.0.0.1:9000"


def ds_config():
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "zero_optimization": {"stage": 2},
            "async_checkpoint": {"enabled": True, "tiers": [
                {"url": "s3://bucket/run", "endpoint_url": f"http://user:{SECRET}@127.0.0.1:9000"}]}}


def trainer_with(tmp_path, deepspeed):
    """What Trainer holds once accelerate built DeepSpeed's engine: its arguments, and an
    accelerator holding the arguments' plugin and the plugin's config."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), deepspeed=deepspeed, use_cpu=True, report_to=[])
    plugin = args.deepspeed_plugin
    plugin.set_deepspeed_weakref()  # as the Accelerator does: its own copy, plugin.dschf
    return SimpleNamespace(args=args, accelerator=SimpleNamespace(
        deepspeed_config=plugin.deepspeed_config, state=SimpleNamespace(deepspeed_plugins={"default": plugin})))


def pickled(args) -> bytes:
    buffer = io.BytesIO()
    torch.save(args, buffer)  # as Trainer saves training_args.bin
    return buffer.getvalue()


def test_the_config_given_as_a_dict_is_replaced_by_a_copy_and_every_other_copy_cleaned(tmp_path):
    given = ds_config()
    trainer = trainer_with(tmp_path, given)
    assert SECRET.encode() in pickled(trainer.args) and SECRET in trainer.args.to_json_string()
    shared = trainer.args.hf_deepspeed_config.config
    forget_credentials(trainer)
    assert SECRET.encode() not in pickled(trainer.args) and SECRET not in trainer.args.to_json_string()
    assert given == ds_config()  # the caller's dict, as given
    assert trainer.args.deepspeed["async_checkpoint"]["tiers"][0]["endpoint_url"] == ENDPOINT
    # transformers' copy, cleaned in place: accelerate and DeepSpeed hold the same dict
    assert trainer.args.hf_deepspeed_config.config is shared is trainer.accelerator.deepspeed_config
    assert shared["async_checkpoint"]["tiers"][0]["endpoint_url"] == ENDPOINT
    before = copy.deepcopy(vars(trainer.args))
    forget_credentials(trainer)  # again: nothing left to change
    assert json.dumps(before["deepspeed"]) == json.dumps(trainer.args.deepspeed)


def test_a_config_file_keeps_its_path_and_the_copies_read_from_it_are_cleaned(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config()))
    trainer = trainer_with(tmp_path, str(path))
    assert SECRET.encode() in pickled(trainer.args)
    forget_credentials(trainer)
    assert SECRET.encode() not in pickled(trainer.args)
    assert trainer.args.deepspeed == str(path) and SECRET in path.read_text()
    plugin = trainer.args.deepspeed_plugin
    for config in (plugin.deepspeed_config, plugin.hf_ds_config.config, plugin.dschf.config):
        assert config["async_checkpoint"]["tiers"][0]["endpoint_url"] == ENDPOINT
