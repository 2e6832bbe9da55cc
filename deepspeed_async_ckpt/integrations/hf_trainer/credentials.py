"""The tiers' endpoint credentials out of what Trainer saves and logs.

Trainer pickles its ``TrainingArguments`` into every ``checkpoint-N/training_args.bin`` (and
into ``output_dir`` when it saves the model or pushes a checkpoint), and reporting callbacks
log ``args.to_json_string()``: both hold the DeepSpeed config, twice. A user name or password
in a tier's ``endpoint_url`` is never used (requests are signed with boto3's credentials, and
the engine dropped it when it parsed the tiers), so :func:`forget_credentials` drops it from
every copy Trainer and accelerate hold once the engine is built, before the callbacks'
``on_train_begin`` and the first of those saves (:mod:`.trainer_methods` calls it).
"""

from __future__ import annotations

from typing import Any, Mapping

from ...tiers.config import without_credentials


def forget_credentials(trainer: Any) -> None:
    """Drop the tiers' endpoint user information from ``trainer``'s DeepSpeed configs.
    ``args.deepspeed``, the config as given, is replaced by a copy without it (the caller's
    dict is left as it is). The others are copies of transformers' and accelerate's own (deep
    copies of the given dict, or the file's content), cleaned in place so that every holder
    sees the same: each dict, and each ``HfDeepSpeedConfig``'s ``config``, held by the
    arguments (``hf_deepspeed_config``), by accelerate's ``DeepSpeedPlugin`` (``deepspeed_config``,
    ``hf_ds_config``, ``dschf``; the arguments' plugin and the accelerator state's) and by the
    ``Accelerator`` (``deepspeed_config``, which DeepSpeed was built from). Cheap where none
    holds any: called once the engine is built and before each of Trainer's saves of
    ``training_args.bin``."""
    args = getattr(trainer, "args", None)
    given = getattr(args, "deepspeed", None)
    if isinstance(given, Mapping):
        safe = without_credentials(given)
        if safe is not given:
            args.deepspeed = safe
    accelerator = getattr(trainer, "accelerator", None)
    in_state = getattr(getattr(accelerator, "state", None), "deepspeed_plugins", None)  # one, or by name
    holders = [args, getattr(args, "deepspeed_plugin", None),
               *(in_state.values() if isinstance(in_state, Mapping) else [in_state])]
    configs = [getattr(accelerator, "deepspeed_config", None)]
    for holder in holders:
        for value in (vars(holder).values() if hasattr(holder, "__dict__") else ()):
            configs.append(value if isinstance(value, dict) else
                           vars(value).get("config") if hasattr(value, "__dict__") else None)
    for config in configs:
        if isinstance(config, dict):
            safe = without_credentials(config)
            if safe is not config:
                config.update(safe)  # its async_checkpoint block, replaced by the clean copy
