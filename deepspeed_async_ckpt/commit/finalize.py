"""Finalize steps: what a framework adds to a checkpoint once every rank has persisted it.

A save may carry finalize steps (``AsyncCheckpointer.begin(..., finalize=[step, ...])``), as
nvidia-resiliency-ext's ``AsyncRequest.finalize_fns`` are "called synchronously after async_fn
is done on all ranks". Megatron's marker files (``.metadata``, ``metadata.json``) are one.

Call order, rank 0 only, on its committer thread (a sync save: on the training thread, inside
``end``), as one commit (:func:`.sequence.commit`)::

    manifest written (it lists every step's ``files`` as late files)
    step(ctx) for each step, in order        # ctx.write_file(...) for each file it declared
    late files recorded (sizes, checksums)   # :func:`.manifest.record_late_files`
    a re-saved checkpoint swapped in
    the pointer moved
    retention

A step that raises fails the save: the pointer stays on the previous checkpoint, and the error
is recorded in the failure ledger, raised at the next ``begin`` or ``wait`` on every rank. The
other ranks' steps, if they pass any, are not run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

from ..storage import Storage
from .atomic import write_text_atomic


@dataclass(frozen=True)
class FinalizeContext:
    """What a finalize step gets: the checkpoint, and a way to write into it."""

    storage: Storage
    write_dir: str
    """Where the checkpoint's files are now: its directory, or the staging directory beside it
    that replaces it once the steps are done (a re-save)."""
    ckpt_dir: str
    """Where the checkpoint is once committed (``<save_dir>/<tag>``, ``iter_NNNNNNN``)."""
    tag: str
    save_id: str
    manifest: dict
    """The committed manifest (``files``: every file the ranks wrote, with its size and, for a
    packed file, the offset and length of each part)."""
    files: frozenset[str]
    """The files the steps declared (paths in the checkpoint): the only ones :meth:`write_file`
    writes."""
    written: dict[str, bytes] = field(default_factory=dict, compare=False)
    """What :meth:`write_file` wrote, by path in the checkpoint: the commit records and passes on
    these bytes (to other nodes, to the memory tier) without reading them back."""

    def write_file(self, rel: str, data: str | bytes) -> None:
        """Write ``rel`` (a path in the checkpoint, declared in a step's ``files``) whole:
        temporary name, fsync, rename (its directories made if missing). The commit records its size and checksum after the last
        step, so that ``verify`` and loads check it as any other file."""
        if rel not in self.files:
            raise ValueError(f"finalize step: {rel!r} is not among the files the steps declared "
                             f"({', '.join(sorted(self.files)) or 'none'}); a step lists what it "
                             "writes in its `files`")
        path = os.path.join(self.write_dir, rel)
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):  # made, and its entries durable before the pointer moves
            self.storage.makedirs(parent)
            while parent != self.write_dir:
                self.storage.sync_dir(os.path.dirname(parent))
                parent = os.path.dirname(parent)
        data = data.encode() if isinstance(data, str) else bytes(data)
        write_text_atomic(self.storage, path, data)
        self.written[rel] = data


@runtime_checkable
class FinalizeStep(Protocol):
    """A callable run once per save with a :class:`FinalizeContext`. ``files``: the paths in
    the checkpoint it writes (optional on a plain function: none), listed in the manifest
    before it runs, so that a checkpoint whose steps never finished does not verify."""

    def __call__(self, ctx: FinalizeContext) -> None: ...


def declared_files(steps: Sequence[FinalizeStep]) -> tuple[str, ...]:
    """Every file ``steps`` declare, in order, each once; ``ValueError`` for a step that is
    not callable or a file outside the checkpoint."""
    files: dict[str, None] = {}
    for step in steps:
        if not callable(step):
            raise ValueError(f"finalize: {step!r} is not callable (a step is called with a "
                             "FinalizeContext)")
        names = getattr(step, "files", ())
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"finalize: {step!r}'s files must be a sequence of paths, got {names!r}")
        for rel in names:
            if not rel or os.path.isabs(rel) or os.pardir in rel.split("/"):
                raise ValueError(f"finalize: {step!r} declares {rel!r}, a path outside the checkpoint")
            files[rel] = None
    return tuple(files)


def step_name(step: FinalizeStep) -> str:
    """How an error names ``step``: its function's or class's name."""
    return getattr(step, "__qualname__", None) or type(step).__qualname__
