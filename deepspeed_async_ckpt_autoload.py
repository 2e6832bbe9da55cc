"""Run at interpreter start by ``deepspeed_async_ckpt.pth`` (a regular ``pip install .``).

When ``deepspeed.runtime.engine`` is first imported, patch it so the ``"async_checkpoint"``
config key takes effect; no code change is needed in the training script. When
``transformers.trainer_utils`` is first imported, adapt Trainer's checkpoint rotation and
resume to saves still in flight. Both are done by ``deepspeed_async_ckpt.integrations.activation``,
named here by string. This module imports nothing heavy, and not the package itself, so the
package is resolved only when DeepSpeed or Trainer is actually used (a working tree on
``PYTHONPATH`` then wins over an installed copy).

Set ``DS_ASYNC_CKPT_AUTOLOAD=0`` to turn auto-activation off; ``deepspeed_async_ckpt.install()``
then activates it explicitly.
"""

import os
import sys

ENV_SWITCH = "DS_ASYNC_CKPT_AUTOLOAD"
ACTIVATION = "deepspeed_async_ckpt.integrations.activation"


def _activation():
    import importlib  # here, not at interpreter start: it is not imported there otherwise

    return importlib.import_module(ACTIVATION)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _on_engine_import(module) -> None:
    try:
        _activation().install()
    except Exception as exc:  # never break `import deepspeed` for everyone in the environment
        print(f"deepspeed_async_ckpt: auto-activation failed, DeepSpeed runs without this engine "
              f"(an 'async_checkpoint' config key is ignored): {type(exc).__name__}: {exc}. "
              f"Call deepspeed_async_ckpt.install() to see the error; {ENV_SWITCH}=0 turns "
              "auto-activation off.", file=sys.stderr)


def _on_trainer_utils_import(module) -> None:
    try:
        _activation().adapt_trainer(module)
    except Exception as exc:  # never break `import transformers`
        print(f"deepspeed_async_ckpt: adapting transformers' Trainer to asynchronous saves failed "
              f"(its save_total_limit rotation and resume_from_checkpoint=True do not know about "
              f"saves in flight): {type(exc).__name__}: {exc}. {ENV_SWITCH}=0 turns "
              "auto-activation off.", file=sys.stderr)


class _PostImportHook:
    """A ``sys.meta_path`` finder that runs ``hook(module)`` once ``target`` has been imported
    (executed): it asks the finders after it for the module's spec and wraps its loader's
    ``exec_module``; it then takes itself off ``sys.meta_path``. The package keeps its own
    (in ``activation``): this one must work before the package may be imported, and the
    package must not import this module. Hand-written rather than
    ``wrapt.register_post_import_hook`` because this runs at every interpreter start in the
    environment (data-loader workers, tools): importing wrapt 2.x takes 43 ms of the 50 ms of
    ``python -c pass``, this module about 1 ms."""

    def __init__(self, target: str, hook) -> None:
        self.target, self.hook = target, hook

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        finders = sys.meta_path[sys.meta_path.index(self) + 1:] if self in sys.meta_path else []
        for finder in finders:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # not one we can wrap (a namespace package): imported without the hook
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        exec_module, hook = loader.exec_module, self.hook

        def exec_then_hook(module):
            exec_module(module)
            hook(module)

        loader.exec_module = exec_then_hook  # this loader instance serves this module only
        return spec


def _hook_import(target: str, hook) -> None:
    """Run ``hook(module)`` once ``target`` is imported: now if it already is."""
    if target in sys.modules:
        hook(sys.modules[target])
    else:
        sys.meta_path.insert(0, _PostImportHook(target, hook))


def register() -> None:
    if not enabled():
        return
    _hook_import("deepspeed.runtime.engine", _on_engine_import)
    _hook_import("transformers.trainer_utils", _on_trainer_utils_import)


register()
