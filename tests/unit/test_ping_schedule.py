"""When a Node pings its Edge (`schemas.heartbeat`): once per interval, at an instant of a
wall-clock grid picked by its node id, so a fleet's pings arrive in batches."""

from __future__ import annotations

import math

from schemas.heartbeat import HEARTBEAT_SLOTS, seconds_to_next_ping

INTERVAL_S = 5.0
STEP_S = INTERVAL_S / HEARTBEAT_SLOTS


def _ping_instant(node_id: str, now_unix: float) -> float:
    return now_unix + seconds_to_next_ping(node_id, INTERVAL_S, now_unix)


def test_the_wait_is_never_zero_nor_longer_than_the_interval() -> None:
    for tick in range(2_000):
        now = 1_700_000_000.0 + tick * 0.0137
        wait = seconds_to_next_ping("node-7", INTERVAL_S, now)
        assert 0 < wait <= INTERVAL_S


def test_a_node_pings_at_the_same_instant_of_every_interval() -> None:
    now = 1_700_000_123.4
    first = _ping_instant("node-7", now)
    second = _ping_instant("node-7", first)
    third = _ping_instant("node-7", second + 0.001)  # woke a little late
    assert math.isclose(second - first, INTERVAL_S)
    assert math.isclose(third - second, INTERVAL_S)
    # The instant is one of the grid's: a whole number of steps into the interval.
    offset = first % INTERVAL_S / STEP_S
    assert math.isclose(offset, round(offset), abs_tol=1e-6)


def test_a_fleet_spreads_over_the_slots_and_shares_them() -> None:
    now = 1_700_000_000.0
    slots: dict[int, int] = {}
    for index in range(1_000):
        slot = round(_ping_instant(f"node-{index}", now) % INTERVAL_S / STEP_S) % HEARTBEAT_SLOTS
        slots[slot] = slots.get(slot, 0) + 1
    # Every slot is used, none by many more than the fleet's share (1000 / 50 = 20).
    assert len(slots) == HEARTBEAT_SLOTS
    assert max(slots.values()) <= 3 * 1_000 // HEARTBEAT_SLOTS
