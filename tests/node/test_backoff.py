"""The reconnect backoff rules (`iop_node.uplink.backoff`), tested synchronously."""

from __future__ import annotations

import random

import pytest

from iop_node.uplink.backoff import Backoff, BackoffPolicy


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
    backoff = Backoff(
        BackoffPolicy(base_s=1, cap_s=64, stable_after_s=10, fast_retries=0), _Highest()
    )
    for _ in range(5):
        backoff.after_failure()
    assert backoff.after_session(uptime_s=10.0) == 1.0
    assert backoff.statistics().failures == 1


def test_after_a_healthy_session_retries_stay_fast_then_grow() -> None:
    """Rule 4: an Edge restart's downtime does not grow the delay for `fast_retries`
    attempts; a Node that started before its Edge (count at the cap) is back at once."""
    policy = BackoffPolicy(base_s=0.5, factor=2, cap_s=30, stable_after_s=2, fast_retries=3)
    backoff = Backoff(policy, _Highest())
    for _ in range(20):
        backoff.after_failure()  # the Edge was not up yet: the count reached the cap
    assert backoff.ceiling() == 30.0
    delays = [backoff.after_session(uptime_s=2.0)]
    delays += [backoff.after_failure() for _ in range(5)]
    assert delays == [0.5, 0.5, 0.5, 0.5, 1.0, 2.0]


def test_an_edge_going_away_arms_the_fast_retries_however_short_the_session() -> None:
    """Rule 6: after a `goaway` the Edge (or its successor) is about to be back; the
    dials that fail meanwhile stay fast."""
    policy = BackoffPolicy(base_s=0.5, factor=2, cap_s=30, stable_after_s=60, fast_retries=3)
    backoff = Backoff(policy, _Highest())
    for _ in range(20):
        backoff.after_failure()
    backoff.after_goaway()
    delays = [backoff.after_failure() for _ in range(5)]
    assert delays == [0.5, 0.5, 0.5, 0.5, 1.0]


def test_default_policy_reconnects_within_seconds_of_a_restart() -> None:
    """With the defaults, the first ten attempts after a healthy link dropped wait at most
    half a second each (the restart the issue measured took 12 s to notice)."""
    backoff = Backoff(BackoffPolicy(), _Highest())
    for _ in range(20):
        backoff.after_failure()
    waits = [backoff.after_session(uptime_s=60)] + [backoff.after_failure() for _ in range(9)]
    assert max(waits) == 0.5 and sum(waits) == 5.0


def test_short_session_keeps_backing_off() -> None:
    backoff = Backoff(BackoffPolicy(base_s=1, cap_s=64, stable_after_s=10), _Highest())
    for _ in range(3):
        backoff.after_failure()
    assert backoff.after_session(uptime_s=9.9) == 8.0


def test_reject_waits_the_reject_delay_then_gives_up() -> None:
    """Rule 5: permanent rejections wait `uniform(delay/2, delay)`; the third in a row
    means give up (None)."""
    policy = BackoffPolicy(reject_delay_s=6, max_rejections=3)
    assert Backoff(policy, _Lowest()).after_reject() == 3.0
    backoff = Backoff(policy, _Highest())
    assert [backoff.after_reject(), backoff.after_reject()] == [6.0, 6.0]
    assert backoff.after_reject() is None
    for _ in range(3):
        delay = Backoff(policy, random.Random()).after_reject()
        assert delay is not None and 3.0 <= delay <= 6.0


def test_failures_between_rejections_do_not_reset_the_count() -> None:
    backoff = Backoff(BackoffPolicy(max_rejections=2), _Highest())
    backoff.after_reject()
    backoff.after_failure()  # the Edge was briefly unreachable
    assert backoff.after_reject() is None


def test_healthy_session_forgives_rejections() -> None:
    backoff = Backoff(BackoffPolicy(base_s=1, cap_s=8, stable_after_s=5, max_rejections=2))
    backoff.after_reject()
    backoff.after_session(uptime_s=6)
    assert backoff.rejections == 0
    assert backoff.after_reject() is not None


def test_a_long_session_ended_by_a_rejection_starts_a_new_count() -> None:
    """Two Nodes sharing an id knock each other off within seconds; a Node replaced after
    days of service is not fighting anyone."""
    policy = BackoffPolicy(max_rejections=2, forget_rejections_after_s=600)
    backoff = Backoff(policy, _Highest())
    assert backoff.after_reject(uptime_s=3) is not None
    assert backoff.after_reject(uptime_s=3) is None
    backoff = Backoff(policy, _Highest())
    assert backoff.after_reject(uptime_s=3) is not None
    assert backoff.after_reject(uptime_s=3600) is not None


def test_factor_one_is_a_constant_ceiling() -> None:
    backoff = Backoff(BackoffPolicy(base_s=2, factor=1, cap_s=10), _Highest())
    assert [backoff.after_failure() for _ in range(3)] == [2.0, 2.0, 2.0]


@pytest.mark.parametrize(
    "policy",
    [
        {"base_s": 0},
        {"base_s": 2, "cap_s": 1},
        {"factor": 0.5},
        {"stable_after_s": -1},
        {"fast_retries": -1},
        {"reject_delay_s": -1},
        {"max_rejections": 0},
    ],
)
def test_invalid_policies_are_refused(policy: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BackoffPolicy(**policy)
