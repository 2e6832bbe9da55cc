"""Retention policies: which committed checkpoints to keep, as small composable types.

Retention (:func:`.retire.retire_checkpoints`, rank 0 only) lists the checkpoints of a save
directory as :class:`CheckpointInfo` values, the committed ones newest first, then those that
can never be loaded, and asks a policy which to keep; it removes the rest. A policy only
states a preference: what a pointer or a symbolic link names, and the directory of a save still
in flight, stay whatever the policy answers. ::

    KeepLast(3)                              the three newest committed checkpoints
    KeepAny(KeepLast(1), KeepEvery(1000))    Megatron-LM's --save-retain-interval 1000
    KeepAny(KeepLast(2), KeepIf(lambda name: name.startswith("best")))
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint a policy decides about."""

    name: str
    """Its directory's name in the save directory (DeepSpeed's tag, ``iter_0000100``)."""
    step: int | None = None
    """The training step (iteration) it holds, where its name tells; None where not."""
    loadable: bool = True
    """False for a checkpoint that can never be loaded: begun and never committed, or
    committed with its late files never recorded."""


class RetentionPolicy(abc.ABC):
    """Which checkpoints to keep. :meth:`should_keep` is called on rank 0 after a commit moved
    the pointer, with every checkpoint of the save directory that retention may remove."""

    @abc.abstractmethod
    def should_keep(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        """One answer per checkpoint, in the order given: the loadable ones newest first (by
        commit time), then the unloadable ones. True keeps it."""


def _check_count(owner: str, field: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{owner}: {field} must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True)
class KeepLast(RetentionPolicy):
    """Keep the ``n`` newest loadable checkpoints (``n=0`` keeps none); never one that cannot
    be loaded."""

    n: int
    """How many to keep (>= 0)."""

    def __post_init__(self) -> None:
        _check_count("KeepLast", "n", self.n, 0)

    def should_keep(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        answers, left = [], self.n
        for c in checkpoints:
            answers.append(c.loadable and left > 0)
            left -= c.loadable
        return answers


@dataclass(frozen=True)
class KeepEvery(RetentionPolicy):
    """Keep every checkpoint whose step is a multiple of ``n`` (step 0 included), as
    Megatron-LM's ``--save-retain-interval`` does; one whose step is unknown is not kept.
    Megatron-LM also keeps the newest: combine with :class:`KeepLast` in :class:`KeepAny`."""

    n: int
    """The interval, in steps (>= 1)."""

    def __post_init__(self) -> None:
        _check_count("KeepEvery", "n", self.n, 1)

    def should_keep(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        return [c.step is not None and c.step % self.n == 0 for c in checkpoints]


@dataclass(frozen=True)
class KeepIf(RetentionPolicy):
    """Keep every checkpoint whose name ``predicate`` accepts."""

    predicate: Callable[[str], bool]
    """Called with a checkpoint's name; true keeps it."""

    def __post_init__(self) -> None:
        if not callable(self.predicate):
            raise ValueError(f"KeepIf: predicate must be callable, got {self.predicate!r}")

    def should_keep(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        return [bool(self.predicate(c.name)) for c in checkpoints]


class KeepAny(RetentionPolicy):
    """Keep what any of ``policies`` keeps."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ValueError("KeepAny: policies must name at least one policy")
        for p in policies:
            if not isinstance(p, RetentionPolicy):
                raise ValueError(f"KeepAny: policies must be retention policies, got {p!r}")
        self.policies: tuple[RetentionPolicy, ...] = policies

    def should_keep(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        answers = [False] * len(checkpoints)
        for p in self.policies:
            answers = [a or b for a, b in zip(answers, p.should_keep(checkpoints))]
        return answers

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeepAny) and other.policies == self.policies

    def __hash__(self) -> int:
        return hash(self.policies)

    def __repr__(self) -> str:
        return f"KeepAny({', '.join(map(repr, self.policies))})"
