"""Exceptions raised by the engine.

Every failure the engine can report derives from :class:`AsyncCheckpointError`, so callers
can catch one type. Background failures are stored and re-raised (``from`` the original
cause) at the next save, wait or optimizer-step fence: they never pass silently.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


class AsyncCheckpointError(RuntimeError):
    """Base class of every error this package raises."""


class ConfigError(AsyncCheckpointError, ValueError):
    """An ``async_checkpoint`` config key is unknown or has a bad value."""


def refuse_unknown_keys(where: str, raw: Mapping[str, Any], allowed: Sequence[str]) -> None:
    """:class:`ConfigError` naming the keys of the JSON object ``where`` (``async_checkpoint``,
    ``async_checkpoint.tiers[0]``) that are not in ``allowed``, and the allowed ones."""
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}; "
                          f"allowed keys: {', '.join(allowed)}")


class SnapshotError(AsyncCheckpointError):
    """A tensor could not be staged to host memory (e.g. larger than the pool)."""


class PersistError(AsyncCheckpointError):
    """A background writer failed (disk full, permission denied, ...)."""


class CommitError(AsyncCheckpointError):
    """A checkpoint could not be committed (a rank never finished, pointer write failed)."""


class DurabilityError(CommitError):
    """A checkpoint was committed and put in place (where loads look), but a step after that
    failed (the pointer's write, an fsync): it is loadable now, yet a crash may undo it."""

    def __init__(self, message: str, *, pointer_moved: bool = False) -> None:
        super().__init__(message)
        self.pointer_moved = pointer_moved
        """Whether the pointer names the new checkpoint (retention must keep it)."""

    def __reduce__(self):  # copied and pickled with its field (the base takes args alone)
        return (_durability_error, (str(self), self.pointer_moved))


def _durability_error(message: str, pointer_moved: bool) -> DurabilityError:
    return DurabilityError(message, pointer_moved=pointer_moved)


class IntegrityError(AsyncCheckpointError):
    """A checkpoint file does not match its manifest (size or checksum), or is uncommitted."""


def describe(exc: BaseException) -> str:
    """An error's message for another's, never blank: ``KeyboardInterrupt()`` prints as ''."""
    return str(exc) or type(exc).__name__
