"""Exceptions raised by the engine.

Every failure the engine can report derives from :class:`AsyncCheckpointError`, so callers
can catch one type. Background failures are stored and re-raised (``from`` the original
cause) at the next save, wait or optimizer-step fence: they never pass silently.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Failure:
    """Why one rank failed a step the ranks take together (:func:`.agreement.agree`).
    ``kind``: the type name of the exception it raised (``"PersistError"``,
    ``"DurabilityError"``), or, for a failure that is no exception of that rank's, a kind the
    step names (its ``key`` differs from rank 0's; rank 0 refused the save directory); compared
    whole, never parsed. ``message``: what to tell the user, never blank. Picklable: it
    travels between ranks."""

    kind: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> "Failure":
        """The failure of a rank whose step raised ``exc``."""
        return cls(type(exc).__name__, describe(exc))

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class AgreementError(AsyncCheckpointError):
    """A step the ranks take together failed on some rank: raised on every rank alike (as
    torch DCP's ``CheckpointException``). ``step``: what the ranks were doing; ``failures``:
    each failed rank's :class:`Failure`, by rank; ``own``: this rank's own exception, if its
    part raised (also the ``__cause__``). The engine's call sites raise their own error from
    it (a :class:`CommitError` naming the ranks, the failing rank's own exception), so
    ``exc.__cause__.failures`` tells a caller which ranks failed and how."""

    def __init__(self, step: str, failures: Mapping[int, Failure], own: BaseException | None = None) -> None:
        super().__init__(f"{step} failed on rank(s) {by_rank(failures)}")
        self.step = step
        self.failures = dict(failures)
        self.own = own

    def __reduce__(self):  # pickled with its fields (the base takes the message alone)
        return (AgreementError, (self.step, self.failures, None))

    def only(self, kind: str) -> bool:
        """Whether every rank failed with ``kind`` (``"DurabilityError"``, say)."""
        return all(f.kind == kind for f in self.failures.values())

    @property
    def only_durability(self) -> bool:
        """Whether every failure is a :class:`DurabilityError` (the checkpoint is in place, a
        later step failed): then that is what every rank raises."""
        return self.only(DurabilityError.__name__)


def by_rank(failures: Mapping[int, Failure]) -> str:
    """``"1: PersistError: msg; 3: ..."``: ``failures``, in rank order."""
    return "; ".join(f"{r}: {f}" for r, f in sorted(failures.items()))


def describe(exc: BaseException) -> str:
    """An error's message for another's, never blank: ``KeyboardInterrupt()`` prints as ''."""
    return str(exc) or type(exc).__name__
