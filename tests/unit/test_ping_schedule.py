"""When a Node pings its Edge (`schemas.heartbeat`): once per interval, at an instant of a
wall-clock grid picked by its node id, so a fleet's pings arrive in batches."""

from __future__ import annotations

import math

import pytest

from schemas.heartbeat import HEARTBEAT_STEP_S, heartbeat_slots, seconds_to_next_ping

INTERVAL_S = 5.0
STEP_S = INTERVAL_S / heartbeat_slots(INTERVAL_S)


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
    assert math.isclose(offset, round(offset), abs_tol=1e-4)  # wall-clock floats: ~0.2 µs


def _batches(nodes: int, interval_s: float) -> dict[int, int]:
    """How many of `nodes` Nodes ping at each instant of the grid."""
    now = 1_700_000_000.0
    step = interval_s / heartbeat_slots(interval_s)
    slots: dict[int, int] = {}
    for index in range(nodes):
        instant = now + seconds_to_next_ping(f"node-{index}", interval_s, now)
        slot = round(instant % interval_s / step) % heartbeat_slots(interval_s)
        slots[slot] = slots.get(slot, 0) + 1
    return slots


def test_a_fleet_spreads_over_the_slots_and_shares_them() -> None:
    slots = _batches(1_000, INTERVAL_S)
    share = 1_000 / heartbeat_slots(INTERVAL_S)
    # Nearly every slot is used, none by many more than the fleet's share.
    assert len(slots) >= 0.95 * heartbeat_slots(INTERVAL_S)
    assert max(slots.values()) <= 3 * share


@pytest.mark.parametrize("interval_s", [5.0, 20.0, 60.0])
def test_a_batch_is_the_same_size_whatever_the_fleet(interval_s: float) -> None:
    """An Edge announces a longer interval to a larger fleet (at most 500 pings a second):
    the grid's step stays, so a batch stays a step's worth of pings (20), not a share of
    the fleet that grows with it."""
    nodes = round(500 * interval_s)
    assert math.isclose(interval_s / heartbeat_slots(interval_s), HEARTBEAT_STEP_S)
    assert max(_batches(nodes, interval_s).values()) <= 3 * 500 * HEARTBEAT_STEP_S


def test_an_interval_shorter_than_the_step_is_one_slot() -> None:
    assert heartbeat_slots(HEARTBEAT_STEP_S / 4) == 1
    assert seconds_to_next_ping("node-7", HEARTBEAT_STEP_S / 4, 1_700_000_000.0) > 0
