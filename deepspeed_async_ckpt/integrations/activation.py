"""Turning the integrations on and off: the one place that installs and uninstalls the
DeepSpeed patches (:mod:`.deepspeed.patches`) and the Trainer adaptation (:mod:`.hf_trainer`).

Two callers:

- ``deepspeed_async_ckpt_autoload`` (run at interpreter start by the ``.pth`` file) calls
  :func:`install` when ``deepspeed.runtime.engine`` has been imported, and
  :func:`adapt_trainer` when ``transformers.trainer_utils`` has; it names this module by
  string, and nothing here imports it;
- :func:`deepspeed_async_ckpt.install` (this module's :func:`install`) does the same
  explicitly, e.g. with ``DS_ASYNC_CKPT_AUTOLOAD=0``.

DeepSpeed's engine module may finish importing while the DeepSpeed integration itself is
being imported (a script importing it before DeepSpeed): the autoload then calls
:func:`install` from inside that import. The integration's package imports
``deepspeed.runtime.engine`` before any of its modules, so that :func:`install` finds them
unimported and imports them whole, rather than half-imported.

Importing this module imports no framework; :func:`install` imports DeepSpeed.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

logger = logging.getLogger(__name__)

_trainer_hook: Any = None
"""The finder :func:`adapt_trainer` left on ``sys.meta_path`` for transformers' import."""
_warned = False


def install() -> bool:
    """Patch DeepSpeed so the ``"async_checkpoint"`` config key takes effect, and adapt
    transformers' Trainer (now, or when it is imported: :func:`adapt_trainer`). Idempotent;
    returns True if it patched DeepSpeed."""
    from .deepspeed import patches  # imports DeepSpeed

    adapt_trainer()
    return patches.install(on_engine_built=check_installed, on_disabled=check_disabled)


def adapt_trainer(module: Any = None) -> bool:
    """Wrap ``transformers.trainer_utils``' rotation and resume (:mod:`.hf_trainer.rotation`):
    in ``module``, or in the one imported, or, if transformers is not imported yet, when it
    is. Idempotent; returns True if it wrapped them now."""
    global _trainer_hook
    from .hf_trainer import rotation

    if rotation.is_installed():
        return False
    if module is None:
        module = sys.modules.get(rotation.TARGET)
        if module is None:
            if _trainer_hook is None:
                _trainer_hook = _when_imported(rotation.TARGET, rotation.install)
            return False
    return rotation.install(module)


def check_installed() -> None:
    """When this engine is built (inside ``Trainer.train`` under Trainer): wrap Trainer's Hub
    uploads, its model export and its just-in-time checkpoint
    (:mod:`.hf_trainer.trainer_methods`) where transformers has imported them, and warn once
    if Trainer's helpers are imported without the rotation wrappers (transformers < 5, or
    auto-activation off without ``install()``)."""
    global _warned
    from .hf_trainer import rotation, trainer_methods

    trainer_methods.install()
    if _warned or rotation.is_installed() or rotation.TARGET not in sys.modules:
        return
    _warned = True
    logger.warning("async checkpoint: transformers' Trainer is imported, but its checkpoint "
                   "rotation (save_total_limit) and resume_from_checkpoint=True are not adapted "
                   "to asynchronous saves (transformers 5.x is, through the auto-activation hook "
                   "or deepspeed_async_ckpt.install()): rotation may delete the last committed "
                   "checkpoint while a new one is written, and resume may pick one a crash cut "
                   "short")


def check_disabled() -> None:
    """When DeepSpeed builds its own checkpoint engine for a config whose ``async_checkpoint``
    key says ``enabled: false``: wrap Trainer's methods all the same
    (:mod:`.hf_trainer.trainer_methods`, which without this engine do what Trainer does), so
    that the tiers' credentials leave the configs Trainer saves into ``training_args.bin``."""
    from .hf_trainer import trainer_methods

    trainer_methods.install()


def uninstall() -> None:
    """Undo :func:`install`, :func:`adapt_trainer`, :func:`check_installed` and
    :func:`check_disabled` (tests)."""
    global _trainer_hook
    from .deepspeed import patches  # imports DeepSpeed
    from .hf_trainer import rotation, trainer_methods

    rotation.uninstall()
    trainer_methods.uninstall()
    if _trainer_hook is not None and _trainer_hook in sys.meta_path:
        sys.meta_path.remove(_trainer_hook)
    _trainer_hook = None
    patches.uninstall()


class _PostImportHook:
    """A ``sys.meta_path`` finder that runs ``hook(module)`` once ``target`` has been imported
    (executed): it asks the finders after it for the module's spec and wraps its loader's
    ``exec_module``; it then takes itself off ``sys.meta_path``. (The autoload module has its
    own: it runs before this package may be imported.)"""

    def __init__(self, target: str, hook: Callable[[Any], Any]) -> None:
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


def _when_imported(target: str, hook: Callable[[Any], Any]) -> _PostImportHook:
    """Run ``hook(module)`` once ``target`` is imported (it is not yet); returns the finder left
    on ``sys.meta_path``."""
    finder = _PostImportHook(target, hook)
    sys.meta_path.insert(0, finder)
    return finder
