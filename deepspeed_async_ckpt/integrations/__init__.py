"""Framework integrations: :mod:`.deepspeed` (DeepSpeed's checkpoint engine), :mod:`.hf_trainer`
(Hugging Face Trainer's rotation, resume and uploads with saves in flight), and
:mod:`.activation`, which installs and uninstalls both.

Importing this package imports nothing else: each integration imports its framework."""
