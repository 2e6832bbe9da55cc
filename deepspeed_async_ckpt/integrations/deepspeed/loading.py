"""What ``DeepSpeedEngine.load_checkpoint`` will read, decided the way DeepSpeed decides it:
the checkpoint directory (``latest``, or ``latest_universal``, read once for every rank), the
files of it that the load opens, and, under ZeRO-3, the other checkpoint the module's weights
come from. The load wrapper (:mod:`.patches`) verifies exactly those before DeepSpeed reads."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from ...core import by_rank, outcome
from ...errors import CommitError

logger = logging.getLogger(__name__)

POINTER_NAMES = ("latest", "latest_universal")
"""DeepSpeed's pointer files in a save directory: ``latest``, and ``ds_to_universal``'s."""


def checkpoint_to_load(arguments: dict, latest: str = "latest") -> str | None:
    """The directory ``load_checkpoint(load_dir, tag=None, ...)`` will read: ``load_dir/tag``,
    with the tag from ``load_dir/<latest>`` when none is given (as DeepSpeed reads it); None
    when there is no tag (DeepSpeed then loads nothing)."""
    load_dir, tag = arguments.get("load_dir"), arguments.get("tag")
    if load_dir is None:
        return None
    if tag is None:
        try:
            with open(os.path.join(load_dir, latest), encoding="utf-8") as f:
                tag = f.read().strip()
        except FileNotFoundError:
            return None
    return os.path.join(load_dir, str(tag))


def is_optimizer_file(rel: str) -> bool:
    """Whether a file of a DeepSpeed checkpoint (its path in it) holds optimizer state under
    ZeRO (``*optim_states.pt``: the fp32 partitions and the optimizer's moments)."""
    return os.path.basename(rel).endswith("optim_states.pt")


def agreed_latest_tag(checkpointer: Any, load_dir: str, latest: str = "latest") -> str | None:
    """Collective: the tag ``load_dir/<latest>`` names as rank 0 read it (None: there is no such
    file), the same on every rank. A rank that cannot read its own copy (not UTF-8, a
    directory) makes every rank raise, as does an empty one: DeepSpeed raises there too, where
    "no checkpoint" would let a script start over from scratch."""
    path = os.path.join(load_dir, latest)
    mine: str | None = None  # None: there is no such file
    error: Exception | None = None
    try:
        with open(path, encoding="utf-8") as f:
            mine = f.read().strip()
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        error = exc
    value, failed = outcome("load_checkpoint", mine, error, exchange=checkpointer.exchange)
    if failed is not None:
        first = failed.failures[min(failed.failures)]
        raise CommitError(f"load_checkpoint refused on every rank: cannot read {path}: {first.message} "
                          f"(rank(s) {by_rank(failed.failures)})") from failed
    if value == "":
        raise CommitError(f"load_checkpoint refused on every rank: {path} is empty (on rank 0): it "
                          "names no checkpoint")
    return value


def takes_module_from_latest(ds_engine: Any, arguments: dict) -> bool:
    """Whether this load rebuilds the module from the checkpoint ``latest`` names, whichever
    the tag (see :func:`zero3_module_source`): the same answer on every rank."""
    partitioned = getattr(ds_engine, "zero_optimization_partition_weights", None)
    return not (arguments.get("tag") is None or arguments.get("load_optimizer_states", True)
                or getattr(ds_engine, "has_moe_layers", False) or not callable(partitioned)
                or not partitioned())


def zero3_module_source(ds_engine: Any, arguments: dict) -> str | None:
    """The checkpoint DeepSpeed will take the module's weights from when that is not the one
    asked for, else None: under ZeRO-3 (without MoE), ``load_checkpoint(load_dir, tag=X,
    load_optimizer_states=False)`` rebuilds the module with
    ``get_fp32_state_dict_from_zero_checkpoint(load_dir)``, which reads the optimizer files of
    the checkpoint ``latest`` names, not X's (DeepSpeed's own engine does the same). Every
    rank gets the same answer (one ``latest`` file); an unreadable ``latest`` gives None
    (DeepSpeed's own read of it reports that)."""
    if not takes_module_from_latest(ds_engine, arguments):
        return None
    try:
        asked, latest = checkpoint_to_load(arguments), checkpoint_to_load(dict(arguments, tag=None))
    except (OSError, ValueError) as exc:  # not UTF-8, a directory, unreadable
        logger.debug("async checkpoint: cannot read %s's latest: %s", arguments.get("load_dir"), exc)
        return None
    if asked is None or latest is None or os.path.abspath(asked) == os.path.abspath(latest):
        return None
    return latest


def files_read_by_load(ds_engine: Any, arguments: dict) -> Callable[[str], bool] | None:
    """Which files of a checkpoint ``load_checkpoint`` will read, as DeepSpeed decides it
    (``DeepSpeedEngine.load_checkpoint``): under ZeRO, the optimizer files
    (``*optim_states.pt``) only when optimizer states are loaded (or for a universal
    checkpoint; under ZeRO-3, also for MoE and for a load without optimizer states, which
    rebuilds the module from the fp32 partitions in the optimizer files). A fine-tuning load
    with ``load_optimizer_states=False`` under ZeRO-1/2 then hashes the model states (2 bytes
    per parameter in bf16) and not the optimizer's 12. None: every file (without ZeRO the
    model-states file holds the optimizer state too)."""
    def asks(name: str) -> bool:
        method = getattr(ds_engine, name, None)
        return bool(method()) if callable(method) else True  # unknown: as if it read them

    zero = getattr(ds_engine, "zero_optimization", None)
    if not callable(zero) or not zero() or asks("zero_nvme_offload_optimizer"):
        return None
    optimizer = arguments.get("load_optimizer_states", True) and not arguments.get("load_module_only", False)
    universal = getattr(ds_engine, "load_universal_checkpoint", lambda: False)()
    # Under ZeRO-3, a load without optimizer states takes the module from the fp32 partitions
    # of every rank's optimizer file (DeepSpeed's _load_checkpoint calls zero_to_fp32's
    # get_fp32_state_dict_from_zero_checkpoint, with plain torch.load), and MoE loads read them
    zero3_reads = asks("zero_optimization_partition_weights") and (
        getattr(ds_engine, "has_moe_layers", False) or not arguments.get("load_optimizer_states", True))
    if optimizer or universal or zero3_reads:
        return None
    return lambda rel: not is_optimizer_file(rel)


def restore_from_tiers(checkpointer: Any, arguments: dict, latest: str = "latest", *,
                       node_local: bool = False) -> None:
    """Collective, before the load reads ``load_dir``: with durable tiers configured, bring the
    checkpoint to load into it from them (the tag asked for; else the one ``latest`` names
    where a user edited it, or the newest committed on any tier, or where that cannot be made
    whole the newest that can, ``latest`` moved to it), every file missing or damaged there
    fetched and verified (see :func:`~...tiers.restore.restore`); every rank raises if that
    fails. Without tiers or a ``load_dir``: nothing."""
    tiers = getattr(checkpointer, "tiers", None)
    if tiers is None or arguments.get("load_dir") is None:
        return
    tag = arguments.get("tag")
    tiers.restore_all_ranks(checkpointer, arguments["load_dir"], pointer_name=latest,
                            tag=None if tag is None else str(tag), node_local=node_local)


def no_file(rel: str) -> bool:
    """``include`` for a check of the manifest alone (``verify_on_load`` off)."""
    return False


def restore_from_memory(checkpointer: Any, arguments: dict, latest: str = "latest") -> Any:
    """Collective, before the load reads ``load_dir``: with the memory tier on, the keeper's
    checkpoint laid out on tmpfs where it is newer than what ``load_dir`` and the tiers hold
    (or is the tag asked for) and every node can make it whole: a
    :class:`~...memory.restore.MemoryRestore` whose ``load_dir`` and ``name`` the load then
    takes; None: load as without it (see :mod:`...memory.restore`)."""
    memory = getattr(checkpointer.config, "memory", None)
    load_dir = arguments.get("load_dir")
    if memory is None or not memory.enabled or load_dir is None:
        return None
    from ...memory.restore import restore_from_memory as restore
    from ...tiers.choose import newest_committed

    tiers = getattr(checkpointer, "tiers", None)
    remotes = tiers.remotes if tiers is not None else []
    tag = arguments.get("tag")
    return restore(load_dir, memory, rank=checkpointer.rank, world_size=checkpointer.world_size,
                   pointer_name=latest, tag=None if tag is None else str(tag),
                   on_disk=lambda: newest_committed(load_dir, remotes, pointer_name=latest),
                   exchange=checkpointer.exchange)


def finish_memory_load(checkpointer: Any, memory: Any, result: Any, load_dir: str) -> Any:
    """Collective, after every rank's load from ``memory`` returned: its directory removed
    (once every rank of the node read it) and ``load_checkpoint``'s path given as the
    checkpoint's in ``load_dir`` (the tmpfs copy is gone)."""
    try:
        outcome("load_checkpoint", None, exchange=checkpointer.exchange)
    finally:
        memory.close()
    if isinstance(result, tuple) and result and isinstance(result[0], str):
        path = result[0]
        if path.startswith(memory.load_dir + os.sep):
            path = os.path.join(load_dir, os.path.relpath(path, memory.load_dir))
        result = (path, *result[1:])
    return result
