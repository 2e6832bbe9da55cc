"""Loading a checkpoint of this engine: checked once across the ranks, then read file by file.

Call order, every rank: :meth:`Loader.verify_all_ranks` (collective: each rank hashes a share of
the files), then, inside :meth:`Loader.collective_load` (collective at its end), the framework's
load, which reads each file with :meth:`Loader.load`. All of it runs on the training thread.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch

from ..agreement import Exchange, by_rank, outcome
from ..commit import META_DIR, find_checkpoint_dir, read_manifest, verify_checkpoint, verify_file
from ..errors import Failure, IntegrityError
from ..memory.restore import agreement_key


class Loader:
    """The load path of one rank. ``exchange``: the transport of its agreements across ranks
    (see :func:`~..agreement.exchange_across_ranks`); ``verify_on_load``: check a file that no
    :meth:`verify_all_ranks` covered against its manifest before reading it."""

    def __init__(self, *, rank: int, world_size: int,
                 exchange: Exchange, verify_on_load: bool) -> None:
        self.rank, self.world_size = rank, world_size
        self.exchange = exchange
        self.verify_on_load = verify_on_load
        # checkpoint dir -> (save id, include, the paths its manifest lists) of the last
        # verify_all_ranks that passed
        self._verified: dict[str, tuple[str, Callable[[str], bool] | None, frozenset[str]]] = {}
        self._replaced_seen: list[str] | None = None
        """Inside :meth:`collective_load`: what :meth:`load` found replaced, for its end."""

    def forget(self, ckpt_dir: str) -> None:
        """``ckpt_dir`` is being saved again: its files will change, its check counts no more."""
        self._verified.pop(ckpt_dir, None)

    def verify_all_ranks(self, ckpt_dir: str | None, *, action: str = "load",
                         include: Callable[[str], bool] | None = None) -> None:
        """Collective: check a checkpoint of this engine before any rank loads from it, each
        rank hashing a disjoint share of its files (rank ``r``: files ``r, r + world_size, ...``
        of the manifest), and raise on every rank if any file is bad or the checkpoint was
        never committed: the rank that found it with its :class:`IntegrityError` naming the
        file, the others naming that rank. Every file is read once across the ranks, where
        checking each file on every rank that loads it reads a file all ranks load (DeepSpeed's
        model states) once per rank. :meth:`load` then skips the files of this checkpoint. A
        directory without this engine's records (another engine's checkpoint) passes as it is;
        a missing one is refused.
        ``include``: only the files (by path within the checkpoint) it accepts, those the load
        will read; :meth:`load` still checks any other file it is asked for. ``None``: this
        rank has nothing to load (no ``latest`` yet): it still takes part, so that ranks which
        read ``latest`` on either side of its first write all raise, none waiting for the rest.
        """
        if ckpt_dir is None:
            _, failed = outcome(action, action, exchange=self.exchange, key="")
            if failed is not None:
                raise IntegrityError(f"{action} refused on every rank, because of rank(s) "
                                     f"{by_rank(failed.failures)}") from failed
            return
        ckpt_dir = os.path.abspath(ckpt_dir)
        self._verified.pop(ckpt_dir, None)  # an earlier pass counts no more if this one fails
        error: Exception | None = None
        manifest = None
        try:
            if not os.path.isdir(ckpt_dir):  # a tag, or a `latest`, naming nothing: the framework
                # would fail on each rank in its own words (DeepSpeed: a bare AssertionError)
                raise IntegrityError(f"no checkpoint directory at {ckpt_dir!r}")
            if os.path.isdir(os.path.join(ckpt_dir, META_DIR)):
                manifest = verify_checkpoint(ckpt_dir, rank=self.rank, world_size=self.world_size,
                                             include=include)
        except Exception as exc:  # any kind: a rank that skipped the exchange would hang the rest
            error = exc
        detail = None if error is None else f"{type(error).__name__}: {error}"
        # key: each rank checks a share of the files, which covers them all only if every
        # rank checks the same checkpoint (ranks that read `latest` on either side of a commit
        # would each check part of a different one, and load the rest unchecked)
        _, failed = outcome(action, action, error, exchange=self.exchange, key=agreement_key(ckpt_dir))
        if error is not None:
            raise IntegrityError(f"{action} refused on every rank: {detail}") from error
        if failed is not None:
            raise IntegrityError(f"{action} refused on every rank, because of rank(s) "
                                 f"{by_rank(failed.failures)}") from failed
        if manifest is not None:
            listed = frozenset([*manifest["files"], *manifest.get("late_files", ())])
            self._verified[ckpt_dir] = (manifest["save_id"], include, listed)

    def load(self, path: str, map_location: Any = None) -> Any:
        """``torch.load`` after checking the file against its checkpoint's committed manifest
        (unless :meth:`verify_all_ranks` checked that checkpoint, as it still is)."""
        verified = self._verified_check(path)
        if verified is None:
            if self.verify_on_load:
                verify_file(path)
            return torch.load(path, map_location=map_location, weights_only=False)
        self._check_still(verified, path)  # before: not verified against another commit
        state = torch.load(path, map_location=map_location, weights_only=False)
        self._check_still(verified, path)  # after: not read from the one that replaced it
        return state

    @contextlib.contextmanager
    def collective_load(self, action: str = "load"):
        """Collective (every rank): a framework's load, whose files :meth:`load` reads. If a
        rank finds inside it that the checkpoint was saved again since :meth:`verify_all_ranks`
        (:meth:`load` raises that at once outside it), it goes on, since the other ranks would
        wait for it in the framework's collectives, and at the end every rank raises
        ``IntegrityError``, naming ``action`` and the ranks that saw it. An exception inside
        the block propagates as it is."""
        self._replaced_seen = []
        try:
            yield
        except BaseException:
            self._replaced_seen = None
            raise
        seen, self._replaced_seen = self._replaced_seen, None
        _, failed = outcome(action, action, exchange=self.exchange,
                            failure=Failure(IntegrityError.__name__, seen[0]) if seen else None)
        if failed is not None:
            raise IntegrityError(f"{action} refused on every rank: on rank(s) "
                                 f"{by_rank(failed.failures)}") from failed

    def _verified_check(self, path: str) -> tuple[str, str] | None:
        """``(checkpoint directory, save id)`` of the check by :meth:`verify_all_ranks` that
        covers ``path``, if any: not one of a file its manifest does not list (a stray file, or
        one carried over from a checkpoint this one replaced), which that check never read."""
        ckpt_dir = find_checkpoint_dir(os.path.abspath(path))
        if ckpt_dir is None or ckpt_dir not in self._verified:
            return None
        save_id, include, listed = self._verified[ckpt_dir]
        rel = os.path.relpath(os.path.abspath(path), ckpt_dir)
        if rel not in listed or (include is not None and not include(rel)):
            return None  # left out of that check: not read by the load it was made for
        return ckpt_dir, save_id

    def _check_still(self, verified: tuple[str, str], path: str) -> None:
        """The checkpoint a load verified is still the one there: a save of the same tag (the
        trainer, while an evaluation job loads) may have replaced it since, and the files this
        load read before came from the old one. Inside :meth:`collective_load`, noted for the
        end of it instead of raised."""
        ckpt_dir, save_id = verified
        try:
            now = read_manifest(ckpt_dir).get("save_id")
        except (IntegrityError, OSError) as exc:
            now = f"unreadable ({exc})"
        if now == save_id:
            return
        message = (f"checkpoint {ckpt_dir!r} was saved again while it was being loaded (save "
                   f"{save_id} verified, now {now}), before {os.path.relpath(path, ckpt_dir)} "
                   "was read: load it again")
        if self._replaced_seen is None:
            raise IntegrityError(message)
        self._replaced_seen.append(message)
