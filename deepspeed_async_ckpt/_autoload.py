"""Run at interpreter start by ``deepspeed_async_ckpt.pth``: when ``deepspeed.runtime.engine``
is first imported, patch it so the ``"async_checkpoint"`` config key takes effect. Nothing heavy
is imported here. Set ``DS_ASYNC_CKPT_AUTOLOAD=0`` to turn this off (then call
``deepspeed_async_ckpt.install()`` yourself, or not at all)."""

import os

ENV_SWITCH = "DS_ASYNC_CKPT_AUTOLOAD"


def _on_engine_import(module) -> None:
    from .deepspeed_plugin import install

    install()


def register() -> None:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    try:
        import wrapt
    except ImportError:  # a broken environment must not break every Python start
        return
    wrapt.register_post_import_hook(_on_engine_import, "deepspeed.runtime.engine")


register()
