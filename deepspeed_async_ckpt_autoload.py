"""Run at interpreter start by ``deepspeed_async_ckpt.pth`` (a regular ``pip install .``).

When ``deepspeed.runtime.engine`` is first imported, patch it so the ``"async_checkpoint"``
config key takes effect; no code change is needed in the training script. This module imports
nothing heavy, and not the package itself, so the package is resolved only when DeepSpeed is
actually used (a working tree on ``PYTHONPATH`` then wins over an installed copy).

Set ``DS_ASYNC_CKPT_AUTOLOAD=0`` to turn auto-activation off; ``deepspeed_async_ckpt.install()``
then activates it explicitly.
"""

import os
import sys

ENV_SWITCH = "DS_ASYNC_CKPT_AUTOLOAD"
PLUGIN = "deepspeed_async_ckpt.deepspeed_plugin"

#: Set when DeepSpeed's engine finished importing while our plugin module was itself being
#: imported (it imports DeepSpeed); the plugin then installs at the end of its own import.
install_when_ready = False


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _on_engine_import(module) -> None:
    global install_when_ready
    plugin = sys.modules.get(PLUGIN)
    if plugin is not None and not hasattr(plugin, "install"):
        install_when_ready = True
        return
    from deepspeed_async_ckpt.deepspeed_plugin import install

    install()


def register() -> None:
    if not enabled():
        return
    try:
        import wrapt
    except ImportError:  # a broken environment must not break every Python start
        return
    wrapt.register_post_import_hook(_on_engine_import, "deepspeed.runtime.engine")


register()
