"""The pure pool rules (iop_edge.core.routing.pool): eligibility, admission, ranking, passive
health.

No Trio here: every rule is a function of immutable views, so the tests just call it.
"""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

import pytest
from msgspec.structs import replace

from iop_edge.core.routing.pool import (
    Grant,
    PassiveHealth,
    ProviderView,
    Refuse,
    Wait,
    decide,
    ineligibility,
    is_admissible,
)

ROTATION = ("a", "b", "c")


def views(*items: ProviderView) -> dict[str, ProviderView]:
    return {view.id: view for view in items}


def chosen(decision: Grant | Wait | Refuse) -> str:
    assert isinstance(decision, Grant), decision
    return decision.provider.id


# -- ranking ---------------------------------------------------------------------------


def test_lower_load_ratio_wins_sdd_example() -> None:
    # 1/3 beats 2/3 even though the busier provider has the better priority
    busy = ProviderView(id="a", capacity=3, in_flight=2, priority=1)
    light = ProviderView(id="b", capacity=3, in_flight=1, priority=100)
    assert chosen(decide("m", ("a", "b"), views(busy, light), long=False)) == "b"


def test_load_ratio_is_relative_to_capacity() -> None:
    # 3/8 beats 1/2: a big provider with more runs can still be the lighter one
    big = ProviderView(id="a", capacity=8, in_flight=3)
    small = ProviderView(id="b", capacity=2, in_flight=1)
    assert chosen(decide("m", ("a", "b"), views(big, small), long=False)) == "a"


def test_equal_ratios_compare_exactly_then_priority_breaks_the_tie() -> None:
    # 1/3 and 2/6 are the same ratio, so priority decides
    a = ProviderView(id="a", capacity=3, in_flight=1, priority=50)
    b = ProviderView(id="b", capacity=6, in_flight=2, priority=10)
    assert chosen(decide("m", ("a", "b"), views(a, b), long=False)) == "b"


def _reference_pick(pool: list[ProviderView], last: str | None) -> str | None:
    """Rule 4 spelled out with `Fraction`s: the admissible provider of lowest load ratio,
    then lowest priority, then first in the rotation after `last`."""
    start = ROTATION.index(last) + 1 if last in ROTATION else 0
    admissible = [view for view in pool if is_admissible(view, long=False)]
    if not admissible:
        return None
    best = min(
        admissible,
        key=lambda view: (
            Fraction(view.in_flight, view.capacity),
            view.priority,
            (ROTATION.index(view.id) - start) % len(ROTATION),
        ),
    )
    return best.id


def test_ranking_compares_load_ratios_exactly_over_unrelated_capacities() -> None:
    """Ranking avoids `Fraction`s on the hot path; it must still agree with them."""
    rng = random.Random(7)
    for _ in range(200):
        pool = []
        for pid in ROTATION:
            capacity = rng.choice([0, 1, 2, 3, 5, 6, 7, 9, 12, 64, 97])
            in_flight = rng.randint(0, capacity) if capacity else 0
            priority = rng.choice([1, 2])
            pool.append(
                ProviderView(id=pid, capacity=capacity, in_flight=in_flight, priority=priority)
            )
        last = rng.choice([None, *ROTATION])
        decision = decide("m", ROTATION, views(*pool), long=False, last=last)
        expected = _reference_pick(pool, last)
        if expected is None:
            assert isinstance(decision, Wait), decision
        else:
            assert chosen(decision) == expected


def test_no_capacity_counts_as_full() -> None:
    # a provider without capacity ranks like a full one: after any provider with room
    pool = views(ProviderView(id="a", capacity=0), ProviderView(id="b", capacity=5, in_flight=4))
    assert chosen(decide("m", ("a", "b"), pool, long=False)) == "b"
    assert isinstance(decide("m", ("a",), pool, long=False), Wait)


def test_priority_tie_break_between_idle_providers() -> None:
    pool = [
        ProviderView(id="a", capacity=4, priority=30),
        ProviderView(id="b", capacity=4, priority=10),
        ProviderView(id="c", capacity=4, priority=20),
    ]
    picks = []
    for _ in pool:  # fill the best provider, then ask again: the order of preference
        pick = chosen(decide("m", ROTATION, views(*pool), long=False))
        picks.append(pick)
        pool = [replace(view, capacity=0) if view.id == pick else view for view in pool]
    assert picks == ["b", "c", "a"]


def test_round_robin_starts_after_the_last_pick() -> None:
    idle = views(*(ProviderView(id=pid, capacity=4) for pid in ROTATION))
    assert chosen(decide("m", ROTATION, idle, long=False, last=None)) == "a"
    assert chosen(decide("m", ROTATION, idle, long=False, last="a")) == "b"
    assert chosen(decide("m", ROTATION, idle, long=False, last="b")) == "c"
    assert chosen(decide("m", ROTATION, idle, long=False, last="c")) == "a"
    # a last pick that is no longer in the rotation restarts at the front
    assert chosen(decide("m", ROTATION, idle, long=False, last="gone")) == "a"


def test_sequential_requests_rotate_over_identical_idle_providers() -> None:
    """Each request finishes before the next: load ratio alone would always pick `a`."""
    pool = views(*(ProviderView(id=pid, capacity=4) for pid in ROTATION))
    picks: list[str] = []
    last: str | None = None
    for _ in range(9):
        last = chosen(decide("m", ROTATION, pool, long=False, last=last))
        picks.append(last)
    assert picks == ["a", "b", "c"] * 3


def test_concurrent_requests_spread_evenly() -> None:
    """Runs that stay in flight spread by load ratio: nothing collapses onto one provider."""
    pool = views(*(ProviderView(id=pid, capacity=4) for pid in ROTATION))
    last: str | None = None
    for _ in range(12):
        last = chosen(decide("m", ROTATION, pool, long=False, last=last))
        pool[last] = replace(pool[last], in_flight=pool[last].in_flight + 1)
    assert Counter({pid: view.in_flight for pid, view in pool.items()}) == Counter(
        {"a": 4, "b": 4, "c": 4}
    )
    assert isinstance(decide("m", ROTATION, pool, long=False, last=last), Wait)


def test_round_robin_only_among_equals() -> None:
    # `b` is next in turn but has the higher load ratio: never preferred
    a = ProviderView(id="a", capacity=4, in_flight=1)
    b = ProviderView(id="b", capacity=4, in_flight=2)
    assert chosen(decide("m", ("a", "b"), views(a, b), long=False, last="a")) == "a"


# -- eligibility and admission ------------------------------------------------------------


@pytest.mark.parametrize(
    ("view", "cause", "reason"),
    [
        (
            ProviderView(id="a", capacity=2, connected=False),
            "disconnected",
            "no provider of model 'm' is connected",
        ),
        (
            ProviderView(id="a", capacity=2, enabled=False),
            "disabled",
            "every provider of model 'm' is disabled",
        ),
        (
            ProviderView(id="a", capacity=2, health="unavailable"),
            "unavailable",
            "no provider of model 'm' is available",
        ),
        (
            ProviderView(id="a", capacity=2, breaker="open", cooldown_remaining_s=4.0),
            "cooling_down",
            "every provider of model 'm' is cooling down after failures",
        ),
        (
            ProviderView(id="a", capacity=2, rest_remaining_s=9.0),
            "rate_limited",
            "every provider of model 'm' is rate-limited by its upstream",
        ),
    ],
)
def test_ineligible_providers_are_refused_with_a_reason(
    view: ProviderView, cause: str, reason: str
) -> None:
    assert ineligibility(view, long=False) == cause
    decision = decide("m", ("a",), views(view), long=False)
    assert isinstance(decision, Refuse)
    assert decision.reason == reason


def test_cooldown_refusal_suggests_when_to_retry() -> None:
    cooling = ProviderView(id="a", capacity=2, breaker="open", cooldown_remaining_s=4.0)
    gone = ProviderView(id="b", capacity=2, connected=False)
    decision = decide("m", ("a", "b"), views(cooling, gone), long=False)
    assert isinstance(decision, Refuse)
    assert decision.retry_after_s == 4.0
    assert decision.reason == (
        "no provider of model 'm' can serve this request now "
        "(1 cooling down after failures; 1 node disconnected)"
    )


def test_refusal_suggests_the_first_return_of_cooldowns_and_rests() -> None:
    cooling = ProviderView(id="a", capacity=2, breaker="open", cooldown_remaining_s=4.0)
    resting = ProviderView(id="b", capacity=2, rest_remaining_s=2.5)
    decision = decide("m", ("a", "b"), views(cooling, resting), long=False)
    assert isinstance(decision, Refuse)
    assert decision.retry_after_s == 2.5
    assert decision.reason == (
        "no provider of model 'm' can serve this request now "
        "(1 cooling down after failures; 1 rate-limited by its upstream)"
    )


def test_full_provider_means_wait_not_refuse() -> None:
    full = ProviderView(id="a", capacity=2, in_flight=2)
    assert ineligibility(full, long=False) is None
    assert not is_admissible(full, long=False)
    assert decide("m", ("a",), views(full), long=False) == Wait(("a",))


def test_capacity_shrunk_below_in_flight_admits_nothing() -> None:
    shrunk = ProviderView(id="a", capacity=1, in_flight=3)
    assert decide("m", ("a",), views(shrunk), long=False) == Wait(("a",))


def test_unknown_health_waits_for_the_first_status() -> None:
    fresh = ProviderView(id="a", capacity=2, health="unknown")
    assert decide("m", ("a",), views(fresh), long=False) == Wait(("a",))


def test_full_provider_is_skipped_for_a_free_one() -> None:
    full = ProviderView(id="a", capacity=2, in_flight=2, priority=1)
    free = ProviderView(id="b", capacity=8, in_flight=7)
    assert chosen(decide("m", ("a", "b"), views(full, free), long=False)) == "b"


def test_excluded_providers_are_not_candidates() -> None:
    pool = views(ProviderView(id="a", capacity=2), ProviderView(id="b", capacity=2))
    assert chosen(decide("m", ("a", "b"), pool, long=False, exclude=frozenset({"a"}))) == "b"
    decision = decide("m", ("a", "b"), pool, long=False, exclude=frozenset({"a", "b"}))
    assert decision == Refuse("every provider of model 'm' was already tried")


def test_unconfigured_and_empty_models_are_refused() -> None:
    assert decide("m", ("ghost",), {}, long=False) == Refuse(
        "no provider of model 'm' is configured"
    )
    assert decide("m", (), {}, long=False) == Refuse("model 'm' has no providers")


def test_long_slots_null_means_a_regular_slot_is_enough() -> None:
    view = ProviderView(id="a", capacity=2, in_flight=1, long_in_flight=5)
    assert is_admissible(view, long=True)


def test_long_slots_zero_takes_no_long_runs() -> None:
    view = ProviderView(id="a", capacity=4, long_context_slots=0)
    assert ineligibility(view, long=True) == "no_long_runs"
    assert ineligibility(view, long=False) is None
    assert decide("m", ("a",), views(view), long=True) == Refuse(
        "no provider of model 'm' accepts long-context runs"
    )


def test_long_slots_n_bound_long_runs_and_need_a_regular_slot_too() -> None:
    long_free = ProviderView(id="a", capacity=4, in_flight=1, long_context_slots=2)
    long_full = replace(long_free, long_in_flight=2)
    regular_full = replace(long_free, in_flight=4, long_in_flight=1)
    assert is_admissible(long_free, long=True)
    assert not is_admissible(long_full, long=True)
    assert is_admissible(long_full, long=False)
    assert not is_admissible(regular_full, long=True)


def test_long_run_goes_where_long_runs_are_taken() -> None:
    no_long = ProviderView(id="a", capacity=4, long_context_slots=0, priority=1)
    long_ok = ProviderView(id="b", capacity=4, in_flight=3, long_context_slots=1)
    assert chosen(decide("m", ("a", "b"), views(no_long, long_ok), long=True)) == "b"


def test_breaker_states_gate_admission() -> None:
    base = ProviderView(id="a", capacity=4)
    assert is_admissible(replace(base, breaker="half_open"), long=False)
    probing = replace(base, breaker="probing")
    assert ineligibility(probing, long=False) is None
    assert not is_admissible(probing, long=False)


# -- passive health ----------------------------------------------------------------------


def test_consecutive_failures_open_the_breaker_at_the_threshold() -> None:
    health = PassiveHealth()
    health = health.after_failure(now=0.0, threshold=3, seconds=5.0)
    health = health.after_failure(now=1.0, threshold=3, seconds=5.0)
    assert health.breaker(now=1.0, probing=False) == "closed"
    health = health.after_failure(now=2.0, threshold=3, seconds=5.0)
    assert health == PassiveHealth(consecutive_failures=3, cooldown_until=7.0)
    assert health.breaker(now=6.9, probing=False) == "open"
    assert health.breaker(now=7.0, probing=False) == "half_open"
    assert health.breaker(now=7.0, probing=True) == "probing"


def test_success_resets_the_failure_count() -> None:
    health = PassiveHealth().after_failure(now=0.0, threshold=2, seconds=5.0)
    health = health.after_success(now=1.0)
    health = health.after_failure(now=2.0, threshold=2, seconds=5.0)
    assert health == PassiveHealth(consecutive_failures=1)


def test_outcomes_during_the_cooldown_change_nothing() -> None:
    cooling = PassiveHealth(consecutive_failures=3, cooldown_until=10.0)
    assert cooling.after_failure(now=5.0, threshold=3, seconds=5.0) is cooling
    assert cooling.after_success(now=5.0) is cooling


def test_trial_verdict_closes_or_reopens() -> None:
    cooled = PassiveHealth(consecutive_failures=3, cooldown_until=10.0)
    assert cooled.after_success(now=11.0) == PassiveHealth()
    reopened = cooled.after_failure(now=11.0, threshold=3, seconds=5.0)
    assert reopened == PassiveHealth(consecutive_failures=4, cooldown_until=16.0)
    assert reopened.breaker(now=12.0, probing=False) == "open"
