"""Agreement across ranks: every step of a save or a load that all ranks pass or all ranks
fail goes through :func:`agree` or :func:`outcome` (every rank, the training thread, in the
same order), as torch DCP's ``_DistWrapper`` does.

:func:`agree` runs this rank's part of a step, then makes one exchange: it returns rank 0's
value on every rank, or raises on every rank one :class:`~.errors.AgreementError` whose
``failures`` map each rank that failed to its :class:`~.errors.Failure` (``kind``: the type
name of the exception it raised, or a kind the step names, such as :data:`KEY_DIFFERS`;
``message``). :func:`outcome` is the same exchange for a step whose part already ran: it
returns the error instead of raising it, for call sites that raise their own (the failing
rank its own exception, the others a :class:`~.errors.CommitError` naming it). Call sites read
those fields, never a message's text.

:func:`gather` is the one step whose every rank's value matters, not rank 0's alone (the
names every rank's load reads, the shards every rank holds): it returns them all, in rank
order, or raises the same :class:`~.errors.AgreementError` on every rank.

Rank 0's value may be any picklable value (a save id, a tag or None, a tuple of them); it
travels in a fixed-size all-reduce when it pickles into 64 bytes, else with the failures in
one ``all_gather_object``. :func:`exchange_across_ranks` is that transport, the only one; an
:data:`Exchange` of the same signature stands in for it (a test's; :func:`alone` in a single
process).
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, TypeVar

import torch
import xxhash

from .errors import AgreementError, Failure, by_rank  # noqa: F401 - by_rank: for the call sites

T = TypeVar("T")

_EXCHANGE_VALUE_BYTES = 64


KEY_DIFFERS = "key differs"
"""The kind of a rank's failure whose ``key`` differs from rank 0's (no exception type has a
space in its name)."""

Exchange = Callable[[Any, "Failure | None", str], "tuple[Any, dict[int, Failure]]"]
"""``exchange(value, failure, key) -> (rank 0's value, {rank: failure})``: one collective,
see :func:`exchange_across_ranks`."""


def outcome(step: str, value: T, own: BaseException | None = None, *, exchange: Exchange | None = None,
            key: str = "", failure: Failure | None = None) -> tuple[T, AgreementError | None]:
    """Collective (every rank, in the same order): the one exchange of ``step``, whose part ran
    on this rank already: ``value`` its result, ``own`` its exception (None: it passed),
    ``failure`` what to tell the others of it (default ``Failure.of(own)``). Returns rank 0's
    value and, if any rank failed (or a rank's ``key`` differs from rank 0's:
    :data:`KEY_DIFFERS`), the :class:`AgreementError` every rank gets, for the call site to
    raise as it is or as its own error ``from`` it; else None. ``exchange``: the transport
    (default :func:`exchange_across_ranks`)."""
    if failure is None and own is not None:
        failure = Failure.of(own)
    value, failures = (exchange or exchange_across_ranks)(value, failure, key)
    if not failures:
        return value, None
    error = AgreementError(step, failures, own)
    error.__cause__ = own
    return value, error


def agree(step: str, fn: Callable[[], T], *, exchange: Exchange | None = None, key: str = "") -> T:
    """Collective (every rank, in the same order): run ``fn`` (this rank's part of ``step``),
    then one exchange (:func:`outcome`). Returns rank 0's value on every rank, or raises the
    same :class:`AgreementError` on every rank if ``fn`` raised on any (any exception, Ctrl-C
    included: a rank that left would leave the others waiting in the exchange)."""
    own: BaseException | None = None
    value: Any = None
    try:
        value = fn()
    except BaseException as exc:  # noqa: BLE001 - shared below, raised on every rank
        own = exc
    value, failed = outcome(step, value, own, exchange=exchange, key=key)
    if failed is not None:
        raise failed
    return value


def gather(step: str, fn: Callable[[], T], *, group: Any = None) -> list[T]:
    """Collective over ``group`` (None: every rank; each in the same order): run ``fn`` (this
    rank's part of ``step``), then one ``all_gather_object`` of its value or failure. Returns
    every rank's value, in group rank order, on every rank; or raises on every rank the same
    :class:`AgreementError` (``failures`` by group rank) if ``fn`` raised on any. Without an
    initialized process group (or with one rank): ``[fn()]``, or that error for rank 0.

    For a step whose every value matters; one whose ranks need rank 0's alone agrees through
    :func:`agree`, in a fixed-size all-reduce."""
    import torch.distributed as dist

    together = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    own: BaseException | None = None
    value: Any = None
    try:
        value = fn()
        if together:  # a value that cannot travel fails the step here, on every rank
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001 - shared below, raised on every rank
        value, own = None, exc
    failure = None if own is None else Failure.of(own)
    if not together:
        every = [(value, failure)]
    else:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, (value, failure), group=group)
    failures = {r: f for r, (_, f) in enumerate(every) if f is not None}
    if failures:
        error = AgreementError(step, failures, own)
        raise error from own
    return [v for v, _ in every]


def alone(value: Any, failure: Failure | None, key: str = "") -> tuple[Any, dict[int, Failure]]:
    """The exchange of a single process: its own value and failure."""
    return value, ({0: failure} if failure is not None else {})


def without_key(exchange: Callable[[Any, "Failure | None"], tuple[Any, dict[int, Failure]]], value: Any,
                failure: Failure | None, key: str = "") -> tuple[Any, dict[int, Failure]]:
    """``exchange``, which takes no ``key`` (a test's, say), called as one that does: the key
    is not checked."""
    return exchange(value, failure)


def collective_device(group: Any = None) -> torch.device:
    """Where a collective's tensors go: the current CUDA device under NCCL, else the CPU."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def exchange_across_ranks(value: Any, failure: Failure | None,
                          key: str = "") -> tuple[Any, dict[int, Failure]]:
    """Collective: rank 0's ``value`` (any picklable value), and every rank's failure (rank ->
    :class:`Failure`) so that a failure on one rank is raised on all of them instead of leaving
    the others waiting in the next collective. Without an initialized process group (or with
    one rank): :func:`alone`. ``key``: what every rank must agree on (``begin``'s checkpoint
    directory); a rank whose key differs from rank 0's gets a :data:`KEY_DIFFERS` failure
    naming both (it would persist elsewhere, and rank 0 wait for its record until
    ``commit_timeout_s`` and then blame it for not finishing).

    One all-reduce of a fixed-size tensor (how many ranks failed, rank 0's pickled value in up
    to 64 bytes, the sum of a 20-bit hash of ``key`` and of its square, which are n * h and
    n * h^2 only if every rank's hash is h) on the training thread of every save: O(log
    ranks), where an ``all_gather_object`` moves every rank's object to every rank (two
    collectives). Only when a rank failed, the keys differ (or rank 0's value pickles longer)
    do the values and failures follow, gathered as objects."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return alone(value, failure)
    encoded = b""
    if dist.get_rank() == 0:
        try:  # a value that cannot travel fails the step on every rank, not rank 0 alone
            encoded = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - shared below
            value, failure = None, failure or Failure(type(exc).__name__, f"rank 0's value cannot be "
                                                                           f"pickled: {exc}")
    device = collective_device()
    # [ranks that failed, length of rank 0's pickled value (-1: too long), sum of key hashes,
    # sum of their squares, rank 0's value's bytes...]: a sum over ranks in which only rank 0
    # contributes the value
    msg = torch.zeros(4 + _EXCHANGE_VALUE_BYTES, dtype=torch.int64)
    msg[0] = failure is not None
    h = xxhash.xxh3_64_intdigest(key.encode()) & 0xFFFFF
    msg[2], msg[3] = h, h * h
    if dist.get_rank() == 0:
        if len(encoded) <= _EXCHANGE_VALUE_BYTES:
            msg[1] = len(encoded)
            msg[4:4 + len(encoded)] = torch.tensor(list(encoded), dtype=torch.int64)
        else:
            msg[1] = -1
    msg = msg.to(device)
    dist.all_reduce(msg)
    failed, length, hashes, squares, *data = msg.tolist()
    if not failed and length >= 0 and hashes * hashes == dist.get_world_size() * squares:
        return pickle.loads(bytes(data[:length])), {}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (value, failure, key))
    failures = {r: f for r, (_, f, _) in enumerate(gathered) if f is not None}
    first = gathered[0][2]
    for r, (_, _, other) in enumerate(gathered):
        if other != first and r not in failures:
            failures[r] = Failure(KEY_DIFFERS, f"works in {other!r}, rank 0 in {first!r}")
    return gathered[0][0], failures
