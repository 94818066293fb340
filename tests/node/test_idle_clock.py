"""When a model has been idle long enough to unload (`iop_node.idle_clock`): pure rules."""

from __future__ import annotations

import math

from iop_node.idle_clock import IdleClock
from schemas.config import IdleRule

A = ("p", "a")
B = ("p", "b")


def _clock(*rules: tuple[tuple[str, str], float]) -> IdleClock:
    clock = IdleClock()
    clock.configure(
        IdleRule(provider_id=key[0], model=key[1], idle_unload_s=seconds) for key, seconds in rules
    )
    return clock


def test_a_held_model_no_run_used_falls_due_idle_unload_s_after_it_was_first_reported() -> None:
    clock = _clock((A, 60.0))
    clock.observe("p", ["a"], now=10.0)
    assert clock.next_due() == 70.0
    assert clock.due(69.9) == []
    assert clock.due(70.0) == [A]
    # asked for: not due again until a probe reports it held anew (Rule 5)
    assert clock.due(500.0) == []
    assert clock.next_due() == math.inf
    clock.observe("p", [], now=71.0)
    clock.observe("p", ["a"], now=100.0)
    assert clock.next_due() == 160.0


def test_runs_stop_the_clock_and_the_last_one_ending_starts_it_again() -> None:
    clock = _clock((A, 60.0))
    clock.observe("p", ["a"], now=0.0)
    clock.started(A)
    clock.started(A)
    assert clock.due(1000.0) == []  # in flight: never idle (Rule 1)
    clock.ended(A, now=1000.0)
    assert clock.next_due() == math.inf  # one still runs
    clock.ended(A, now=1010.0)
    assert clock.next_due() == 1070.0


def test_only_models_with_a_rule_and_held_by_the_runtime_are_ever_due() -> None:
    clock = _clock((A, 60.0))
    clock.observe("p", ["b"], now=0.0)  # b has no rule, a is not held
    assert clock.next_due() == math.inf
    assert clock.due(1e9) == []
    clock.observe("p", ["a", "b"], now=5.0)
    assert clock.due(1e9) == [A]


def test_a_pin_holds_a_model_until_every_link_that_pinned_it_let_go() -> None:
    clock = _clock((A, 60.0), (B, 30.0))
    clock.observe("p", ["a", "b"], now=0.0)
    clock.pin(A, link=1)
    clock.pin(A, link=2)
    assert clock.due(100.0) == [B]
    clock.unpin(A, link=1)
    assert clock.due(100.0) == []
    clock.drop_link(2)  # its Edge went away: its pins end (Rule 4)
    assert clock.due(100.0) == [A]


def test_a_refresh_that_changes_a_rule_keeps_the_clock_and_one_that_drops_it_stops_it() -> None:
    clock = _clock((A, 60.0))
    clock.observe("p", ["a"], now=0.0)
    clock.configure([IdleRule(provider_id="p", model="a", idle_unload_s=10.0)])
    assert clock.next_due() == 10.0  # the clock started at 0 goes on
    clock.configure([])
    assert clock.next_due() == math.inf


def test_an_unload_that_failed_starts_the_clock_over() -> None:
    clock = _clock((A, 60.0))
    clock.observe("p", ["a"], now=0.0)
    assert clock.due(60.0) == [A]
    clock.unload_failed(A, now=61.0)
    assert clock.next_due() == 121.0


def test_room_is_made_by_the_unpinned_model_idle_longest_only_where_a_pin_needs_it() -> None:
    clock = IdleClock()
    clock.observe("p", ["kept", "old", "new"], now=0.0, max_loaded=3)
    clock.started(("p", "new"))
    clock.ended(("p", "new"), now=50.0)
    assert clock.victim(("p", "other")) is None  # nothing pinned: the runtime chooses
    clock.pin(("p", "kept"), link=1)
    assert clock.victim(("p", "other")) == "old"  # idle since 0, `new` since 50
    assert clock.victim(("p", "old")) is None  # held already: nothing to load
    clock.started(("p", "old"))
    assert clock.victim(("p", "other")) == "new"
    clock.started(("p", "new"))
    assert clock.victim(("p", "other")) is None  # only the pin is idle: the runtime chooses
    clock.observe("p", ["kept", "old", "new"], now=60.0, max_loaded=4)
    assert clock.victim(("p", "other")) is None  # room: nothing to unload
    clock.observe("p", ["kept", "old", "new"], now=60.0)
    assert clock.victim(("p", "other")) is None  # the runtime does not say how many


def test_a_run_s_model_counts_as_held_until_a_probe_after_it_says_otherwise() -> None:
    clock = IdleClock()
    clock.observe("p", ["kept"], now=0.0, max_loaded=2)
    clock.pin(("p", "kept"), link=1)
    assert clock.started(("p", "b")) is None  # room: the runtime loads b itself
    clock.observe("p", ["kept"], now=1.0, max_loaded=2)  # probed before b was loaded
    clock.ended(("p", "b"), now=2.0)
    # b is held (its run loaded it): a run of c needs room, and b makes it
    assert clock.started(("p", "c")) == "b"
    assert clock.started(("p", "d")) is None  # c runs, kept is pinned: the runtime chooses
    clock.observe("p", ["kept"], now=3.0, max_loaded=2)  # c and d still running: held
    clock.ended(("p", "c"), now=4.0)
    clock.ended(("p", "d"), now=4.0)
    clock.observe("p", ["kept", "d"], now=5.0, max_loaded=2)
    assert clock.started(("p", "e")) == "d"


def test_a_probe_begun_before_the_node_s_own_change_does_not_undo_it() -> None:
    """Rule 7: a probe that was under way before a run ended, or before Rule 6's unload
    returned, reports the runtime as it was; the Node's word stands until a probe begun
    later."""
    clock = IdleClock()
    clock.observe("p", ["kept", "b"], now=0.0, max_loaded=2)
    clock.pin(("p", "kept"), link=1)
    assert clock.started(("p", "c"), now=10.0) == "b"  # b is unloaded to make room
    clock.observe("p", ["kept", "b"], now=10.4, max_loaded=2, probed_at=10.2)  # mid-unload
    clock.unloaded(("p", "b"), now=10.5)
    clock.unloaded(("p", "b"), now=10.9)  # once per choice
    clock.ended(("p", "c"), now=11.0)
    clock.observe("p", ["kept", "b"], now=12.0, max_loaded=2, probed_at=10.45)  # stale
    assert clock.started(("p", "b"), now=13.0) == "c"  # b is not held: c makes room
    clock.unloaded(("p", "c"), now=13.2)
    clock.ended(("p", "b"), now=14.0)
    # begun while b's run ran, before it reached the runtime: b is held all the same
    clock.observe("p", ["kept", "c"], now=15.0, max_loaded=2, probed_at=13.5)
    assert clock.victim(("p", "d")) == "b"  # b's run loaded it; c went for it
    clock.observe("p", ["kept", "c"], now=16.0, max_loaded=2, probed_at=15.5)  # fresh
    assert clock.victim(("p", "d")) == "c"  # the runtime's word, begun after the Node's
