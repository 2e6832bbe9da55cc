"""Hugging Face ``transformers.Trainer`` with this engine: rotation, resume and Hub pushes that
know a save may still be in flight.

Trainer saves a DeepSpeed checkpoint into ``<output_dir>/checkpoint-N`` with
``engine.save_checkpoint``, which with this engine returns once the save is enqueued. In the
same call Trainer then deletes older ``checkpoint-*`` directories down to ``save_total_limit``,
always keeping the newest; ``train(resume_from_checkpoint=True)`` resumes from the
highest-numbered one; and with ``hub_strategy="checkpoint"`` (or ``"all_checkpoints"``) it
uploads ``checkpoint-N`` in the background right away. Unadapted, none of them knows that the
newest may not be committed yet: rotation would delete the last committed checkpoint while the
new one is still being written (with ``save_total_limit=1``, a crash then leaves nothing to
resume from) and directories that earlier saves are still writing into; after a crash
mid-persist, resume would pick the ``checkpoint-N`` whose save it cut short; the Hub would get
a checkpoint without ``latest``, with temporary files.

- :mod:`.rotation`: ``transformers.trainer_utils``' rotation and resume, wrapped when that
  module is imported;
- :mod:`.trainer_methods`: Trainer's uploads, model export and just-in-time checkpoint,
  wrapped when this engine is built;
- :mod:`.beside`: the weights export (``model.safetensors``), written beside the DeepSpeed
  checkpoint on the engine's writer threads and committed with it;
- :mod:`.in_flight`: what this process is saving, as both ask about it;
- :mod:`.credentials`: the tiers' endpoint credentials out of the DeepSpeed configs Trainer
  pickles into ``training_args.bin`` and logs.

:mod:`deepspeed_async_ckpt.integrations.activation` installs and uninstalls them.
"""
