"""The Megatron-LM hook (``megatron_adapter.megatron_lm``). Needs a Megatron-LM checkout on
``PYTHONPATH`` (``megatron.training`` is not pip-installable): skipped otherwise. Megatron-LM's
``initialize_megatron`` asserts CUDA, so the end-to-end run also needs a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

training = pytest.importorskip("megatron.training.training", reason="no Megatron-LM checkout")

from megatron_adapter import megatron_lm  # noqa: E402

from conftest import REPO  # noqa: E402


@pytest.fixture
def installed():
    assert megatron_lm.install()
    yield
    megatron_lm.uninstall()


def test_install_hooks_save_load_and_pretrain(installed):
    import megatron.training as mt
    from megatron.training import checkpointing

    assert checkpointing.save_checkpoint is megatron_lm.save_checkpoint
    assert training.save_checkpoint is megatron_lm.save_checkpoint
    assert training.load_checkpoint is megatron_lm.load_checkpoint
    assert mt.pretrain is training.pretrain
    assert not megatron_lm.install()  # idempotent


def test_uninstall_restores():
    from megatron.training import checkpointing

    before = checkpointing.save_checkpoint
    megatron_lm.install()
    megatron_lm.uninstall()
    assert checkpointing.save_checkpoint is before


def test_pretrain_gets_the_flags(installed, monkeypatch):
    import argparse

    seen = {}

    def fake_pretrain(datasets_provider, model_provider, model_type, forward_step,
                      process_non_loss_data_func=None, extra_args_provider=None, **kwargs):
        parser = extra_args_provider(argparse.ArgumentParser())
        seen.setdefault("args", []).append(parser.parse_args(["--async-ckpt"]))

    monkeypatch.setitem(megatron_lm._ORIGINALS, "pretrain", fake_pretrain)
    training.pretrain(None, None, None, None)  # no provider of its own
    training.pretrain(None, None, None, None, extra_args_provider=lambda p: p)
    training.pretrain(None, None, None, None, None, lambda p: p)  # passed positionally
    assert [a.async_ckpt for a in seen["args"]] == [True] * 3


@pytest.mark.gpu
@pytest.mark.slow
def test_megatron_lm_pretrain_gpt_end_to_end(tmp_path):
    import torch

    script = os.environ.get("MEGATRON_LM_PRETRAIN_GPT")
    if not torch.cuda.is_available() or not script:
        pytest.skip("needs a GPU and MEGATRON_LM_PRETRAIN_GPT=/path/to/Megatron-LM/pretrain_gpt.py")
    save = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "-m", "megatron_adapter.megatron_lm", script, "--mock-data", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "64",
           "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "4",
           "--lr", "1e-3", "--ckpt-format", "torch_dist", "--save", str(save),
           "--save-interval", "2", "--async-ckpt"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.dirname(script),
                                                       os.environ.get("PYTHONPATH", "")]))
    subprocess.run(cmd, check=True, env=env, timeout=600)
    from megatron_adapter.checkpointer import read_tracker, verify_checkpoint_dir

    assert read_tracker(str(save)) == 4
    verify_checkpoint_dir(str(save / "iter_0000004"))
