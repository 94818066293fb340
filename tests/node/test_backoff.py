"""The reconnect backoff rules (`iop_node.backoff`), tested synchronously."""

from __future__ import annotations

import random

import pytest

from iop_node.backoff import Backoff, BackoffPolicy


class _Highest(random.Random):
    """Always draws the upper bound, so a delay equals its ceiling."""

    def uniform(self, a: float, b: float) -> float:
        return b


class _Lowest(random.Random):
    def uniform(self, a: float, b: float) -> float:
        return a


def test_ceiling_grows_exponentially_from_base_to_cap() -> None:
    backoff = Backoff(BackoffPolicy(base_s=0.5, factor=2, cap_s=30), _Highest())
    delays = [backoff.after_failure() for _ in range(10)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]
    assert backoff.statistics().failures == 10


def test_full_jitter_draws_between_zero_and_the_ceiling() -> None:
    backoff = Backoff(BackoffPolicy(), random.Random(7))
    for _ in range(50):
        ceiling = backoff.ceiling()
        assert 0 <= backoff.after_failure() <= ceiling
    assert Backoff(rng=_Lowest()).after_failure() == 0.0


def test_same_seed_same_delays() -> None:
    first = Backoff(rng=random.Random(42))
    second = Backoff(rng=random.Random(42))
    assert [first.after_failure() for _ in range(8)] == [second.after_failure() for _ in range(8)]


def test_many_failures_never_overflow() -> None:
    backoff = Backoff(BackoffPolicy(base_s=0.5, factor=2, cap_s=30), _Highest())
    for _ in range(5000):
        backoff.after_failure()
    assert backoff.after_failure() == 30.0


def test_stable_session_resets_the_failure_count() -> None:
    backoff = Backoff(BackoffPolicy(base_s=1, cap_s=64, stable_after_s=10), _Highest())
    for _ in range(5):
        backoff.after_failure()
    assert backoff.after_session(uptime_s=10.0) == 1.0
    assert backoff.statistics().failures == 1


def test_short_session_keeps_backing_off() -> None:
    backoff = Backoff(BackoffPolicy(base_s=1, cap_s=64, stable_after_s=10), _Highest())
    for _ in range(3):
        backoff.after_failure()
    assert backoff.after_session(uptime_s=9.9) == 8.0


def test_reject_waits_near_the_cap_and_keeps_the_count_there() -> None:
    policy = BackoffPolicy(base_s=0.5, factor=2, cap_s=30)
    assert Backoff(policy, _Lowest()).after_reject() == 15.0
    backoff = Backoff(policy, _Highest())
    assert backoff.after_reject() == 30.0
    # A connect failure right after a reject does not fall back to a fast retry.
    assert backoff.after_failure() == 30.0
    for _ in range(3):
        assert 15.0 <= Backoff(policy, random.Random()).after_reject() <= 30.0


def test_reject_then_stable_session_resets() -> None:
    backoff = Backoff(BackoffPolicy(base_s=1, cap_s=8, stable_after_s=5), _Highest())
    backoff.after_reject()
    assert backoff.after_session(uptime_s=6) == 1.0


def test_factor_one_is_a_constant_ceiling() -> None:
    backoff = Backoff(BackoffPolicy(base_s=2, factor=1, cap_s=10), _Highest())
    assert [backoff.after_failure() for _ in range(3)] == [2.0, 2.0, 2.0]
    assert backoff.after_reject() == 10.0


@pytest.mark.parametrize(
    "policy",
    [
        {"base_s": 0},
        {"base_s": 2, "cap_s": 1},
        {"factor": 0.5},
        {"stable_after_s": -1},
    ],
)
def test_invalid_policies_are_refused(policy: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BackoffPolicy(**policy)
