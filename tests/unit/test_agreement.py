"""Agreement across ranks (``agreement.py``) in one process, with exchanges standing in for the
other ranks: typed failures by rank, the same error on every rank, never a message parsed.
Real process groups: tests/integration/test_collectives.py."""

import pickle

import pytest

from deepspeed_async_ckpt.agreement import KEY_DIFFERS, agree, alone, gather, outcome
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import (AgreementError, AsyncCheckpointError, CommitError,
                                         DurabilityError, Failure, PersistError)


def _others(failures):
    """An exchange in which the other ranks report ``failures``, and rank 0's value is this one's."""
    def exchange(value, failure, key=""):
        mine = {} if failure is None else {0: failure}
        return value, {**mine, **failures}
    return exchange


def test_agree_returns_rank_0s_value_and_raises_one_typed_error_for_any_rank():
    assert agree("step", lambda: ("id", True), exchange=alone) == ("id", True)
    with pytest.raises(AgreementError) as info:
        agree("save", lambda: "v", exchange=_others({2: Failure("PersistError", "disk full"),
                                                      1: Failure(KEY_DIFFERS, "works in '/b'")}))
    exc = info.value
    assert isinstance(exc, AsyncCheckpointError) and exc.own is None and exc.step == "save"
    assert exc.failures == {1: Failure(KEY_DIFFERS, "works in '/b'"), 2: Failure("PersistError", "disk full")}
    assert str(exc) == "save failed on rank(s) 1: key differs: works in '/b'; 2: PersistError: disk full"


def test_a_rank_whose_part_raised_shares_its_exception_type_and_gets_it_back_as_the_cause():
    sent = []

    def part():
        raise PersistError("")  # a blank message still says what failed

    with pytest.raises(AgreementError) as info:
        agree("save", part, exchange=lambda v, f, key="": (sent.append(f), alone(v, f))[1])
    assert sent == [Failure("PersistError", "PersistError")]
    assert isinstance(info.value.own, PersistError) and info.value.__cause__ is info.value.own


def test_outcome_says_whether_every_failure_is_of_one_kind():
    _, failed = outcome("wait", None, exchange=_others({1: Failure("DurabilityError", "fsync"),
                                                        3: Failure("DurabilityError", "rename")}))
    assert failed.only_durability and failed.only("DurabilityError")
    _, failed = outcome("wait", None, exchange=_others({1: Failure("DurabilityError", "x"),
                                                        2: Failure("CommitError", "DurabilityError: x")}))
    assert not failed.only_durability  # the kind decides, not what a message begins with
    assert outcome("wait", "v", exchange=alone) == ("v", None)


def test_an_agreement_error_pickles_with_its_failures():
    exc = AgreementError("begin('t1')", {1: Failure("OSError", "[Errno 28] No space left on device")})
    back = pickle.loads(pickle.dumps(exc))
    assert (back.step, back.failures, str(back)) == (exc.step, exc.failures, str(exc))


def test_wait_all_ranks_raises_durability_only_when_every_rank_failed_so():
    """``wait_all_ranks`` on a rank whose own saves are fine: the others' failures decide the
    error type by their kind, and the ``AgreementError`` behind it names them."""
    for failures, expected in (({1: Failure("DurabilityError", "pointer fsync")}, DurabilityError),
                               ({1: Failure("DurabilityError", "a"), 2: Failure("PersistError", "b")},
                                CommitError)):
        ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), world_size=3,
                               exchange=_others(failures))
        with pytest.raises(expected, match=r"load refused on every rank, because of rank\(s\) 1: ") as info:
            ck.wait_all_ranks(action="load")
        assert type(info.value) is expected and info.value.__cause__.failures == failures
        ck.close()


def test_gather_in_one_process_gives_its_value_or_its_typed_failure():
    assert gather("names", lambda: ["embedding"]) == [["embedding"]]

    def part():
        raise KeyError("decoder")

    with pytest.raises(AgreementError) as info:
        gather("names", part)
    assert info.value.failures == {0: Failure("KeyError", "'decoder'")}
    assert isinstance(info.value.own, KeyError) and info.value.__cause__ is info.value.own
