"""DeepSpeed integration: the ``"async_checkpoint"`` config key selects
:class:`~.engine.AsyncCheckpointEngine`, DeepSpeed's ``CheckpointEngine`` over the core.

Modules: :mod:`.engine` (the engine), :mod:`.patches` (what is patched on ``DeepSpeedEngine``
and its factory), :mod:`.loading` (what ``load_checkpoint`` reads), :mod:`.replicas` (which
rank writes what), :mod:`.weight_editors` (DeepSpeed's in-place weight edits fence first).
:mod:`deepspeed_async_ckpt.integrations.activation` installs and uninstalls the patches.
"""

# DeepSpeed's engine module first, before any module here: when the auto-activation hook runs
# at the end of its import (deepspeed_async_ckpt_autoload), the hook imports this subpackage's
# modules, which must not be half-imported then. Imported here, it completes (hook included)
# before any of them starts.
import deepspeed.runtime.engine  # noqa: F401
