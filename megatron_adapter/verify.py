"""Checking a Megatron checkpoint before a load: every file against the engine's manifest,
split across ranks, and only the items the load reads where it reads some.

Collective when ``world_size > 1``: every rank calls :func:`verify_checkpoint_dir` with the
same checkpoint directory; rank ``r`` hashes files ``r, r + world_size, ...``; all ranks raise
or none (the ranks' requested names through :func:`~deepspeed_async_ckpt.agreement.gather`,
the outcome through :func:`~deepspeed_async_ckpt.agreement.outcome`, keyed by the directory:
the :class:`~deepspeed_async_ckpt.errors.IntegrityError` every rank raises is raised ``from``
the :class:`~deepspeed_async_ckpt.errors.AgreementError` whose ``failures`` name each rank's).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

from deepspeed_async_ckpt.agreement import KEY_DIFFERS, alone, gather, outcome
from deepspeed_async_ckpt.commit import META_DIR, read_manifest, verify_checkpoint
from deepspeed_async_ckpt.errors import AgreementError, IntegrityError
from deepspeed_async_ckpt.memory.restore import agreement_key

from . import torch_dist

#: What :func:`verify_checkpoint_dir` can be told a load skips, by its top-level names.
SKIPPABLE = {"optimizer": torch_dist.is_optimizer_name, "rng_state": lambda name: name == "rng_state"}


def _reads_of_load(ckpt_dir: str, wanted: Callable[[str], bool]
                   ) -> Callable[[str], list[tuple[int, int]] | None]:
    """For ``verify_checkpoint``: of a .distcp file, the items the load can read; of any other
    file (``common.pt``), all of it."""
    by_file = torch_dist.reads_of_load(ckpt_dir, wanted)
    return lambda rel: by_file.get(rel, []) if rel.endswith(".distcp") else None


def verify_checkpoint_dir(ckpt_dir: str, *, rank: int = 0, world_size: int = 1,
                          request: dict | None = None, skip: Iterable[str] = ()) -> None:
    """Collective when ``world_size > 1``. For a checkpoint this engine wrote: it must be
    committed and finalized, and every file must match the manifest; rank ``r`` hashes files
    ``r, r + world_size, ...``. With the sharded state dict a load will ``request``, only the
    items some rank's load can read are hashed (the ranks' requests differ: pipeline stages;
    see :func:`~.torch_dist.reads_of_load`: without the optimizer state, none of its bytes); or, where the caller knows only what the load leaves
    out (Megatron-LM's ``--no-load-optim``, ``--finetune``), all but the items of ``skip``
    (names of :data:`SKIPPABLE`). A checkpoint megatron-core wrote itself (``metadata.json``,
    no engine records) is accepted as it is; a directory that is neither raises."""
    skip = tuple(skip)
    unknown = [name for name in skip if name not in SKIPPABLE]
    if unknown:  # the same on every rank: raised before the collective
        raise ValueError(f"verify_checkpoint_dir: cannot skip {', '.join(map(repr, unknown))} "
                         f"(knows {', '.join(map(repr, SKIPPABLE))})")
    together = world_size > 1
    wanted: Callable[[str], bool] | None = None
    if request is not None:
        # Ranks request different parts (pipeline stages, say) but split the files between
        # them: each checks, in the files it was given, what any rank reads.
        part = lambda: sorted(torch_dist.requested_names(request))  # noqa: E731
        try:
            every = gather("reading the names the load requests", part) if together else [part()]
        except AgreementError as exc:
            raise IntegrityError(f"{ckpt_dir!r} cannot be checked: {exc}") from exc
        except Exception as exc:  # one process: as the ranks would tell it
            raise IntegrityError(f"{ckpt_dir!r} cannot be checked: {type(exc).__name__}: {exc}") from exc
        wanted = set().union(*every).__contains__
    elif skip:
        wanted = lambda name: not any(SKIPPABLE[s](name) for s in skip)  # noqa: E731
    own: BaseException | None = None
    try:
        _verify_here(ckpt_dir, rank, world_size, wanted)
    except Exception as exc:  # any kind: a rank that skipped the exchange would hang the rest
        own = exc
    # Each rank checked a share of the files: together all of them only if every rank checked
    # the same checkpoint (ranks reading the tracker on either side of a commit do not): the
    # directory is the exchange's key.
    _, failed = outcome(f"checking {ckpt_dir!r}", None, own, key=agreement_key(ckpt_dir),
                        exchange=None if together else alone)
    if failed is not None:
        raise IntegrityError(_what_failed(failed)) from failed


def _what_failed(failed: AgreementError) -> str:
    """The message every rank raises: the ranks checking elsewhere first, then each failure
    once (an IntegrityError's message as it is: one checkpoint's, whichever rank found it)."""
    elsewhere = {r: f for r, f in failed.failures.items() if f.kind == KEY_DIFFERS}
    said = [f"the ranks are not checking the same checkpoint: "
            f"{', '.join(f'rank {r} {f.message}' for r, f in sorted(elsewhere.items()))}"] if elsewhere else []
    said += [f.message if f.kind == IntegrityError.__name__ else str(f)
             for r, f in sorted(failed.failures.items()) if r not in elsewhere]
    return "; ".join(dict.fromkeys(said))


def _verify_here(ckpt_dir: str, rank: int, world_size: int, wanted: Callable[[str], bool] | None) -> None:
    """This rank's part of :func:`verify_checkpoint_dir`."""
    if not os.path.isdir(os.path.join(ckpt_dir, META_DIR)):
        if not os.path.exists(os.path.join(ckpt_dir, torch_dist.CONFIG_FILE)):
            raise IntegrityError(f"{ckpt_dir!r} is not a complete checkpoint: neither this "
                                 f"engine's manifest nor megatron's {torch_dist.CONFIG_FILE}")
        return
    manifest = read_manifest(ckpt_dir)
    missing = [n for n in torch_dist.MARKER_FILES if not os.path.exists(os.path.join(ckpt_dir, n))]
    if missing:
        raise IntegrityError(f"checkpoint {ckpt_dir!r} was persisted but never finalized "
                             f"({', '.join(missing)} missing): load the one the tracker names")
    reads = None
    if wanted is not None:
        try:  # from .metadata, which the check below has not yet verified
            reads = _reads_of_load(ckpt_dir, wanted)
        except Exception as exc:  # damaged (unpickling it fails in any way), or unreadable
            why = "" if isinstance(exc, OSError) else ": file truncated or corrupted"
            raise IntegrityError(f"{os.path.join(ckpt_dir, torch_dist.DCP_METADATA_FILE)} cannot "
                                 f"be read ({type(exc).__name__}: {exc}){why}") from exc
    verify_checkpoint(ckpt_dir, rank=rank, world_size=world_size, manifest=manifest, reads=reads)
