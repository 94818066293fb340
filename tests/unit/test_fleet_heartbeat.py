"""An idle fleet's pings cost the Edge in proportion to their rate, so the heartbeat
interval an Edge announces grows with its fleet (`runtime.nodes.heartbeat`)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import trio
import trio.testing

from iop_edge.core.configuration.config import parse_config
from iop_edge.edge import Edge
from iop_edge.runtime.nodes.heartbeat import PINGS_PER_S, HeartbeatGrid, fleet_interval
from schemas.heartbeat import HEARTBEAT_STEP_S


@pytest.mark.parametrize("nodes", [0, 1, 100, PINGS_PER_S * 5, 7_500, 10_000, 50_000])
def test_an_idle_fleet_pings_at_most_the_budget_and_never_faster_than_asked(nodes: int) -> None:
    interval = fleet_interval(5.0, nodes)
    assert interval >= 5.0
    assert nodes / interval <= PINGS_PER_S


def test_small_fleets_keep_the_configured_interval_large_ones_stretch_it() -> None:
    assert fleet_interval(5.0, 2000) == 5.0
    assert fleet_interval(5.0, 10_000) == 20.0


async def test_the_edge_announces_its_fleets_interval(tmp_path: Path) -> None:
    nodes = "".join(
        f"  - id: n{i}\n    token_hash_sha256: {'a' * 64}\n" for i in range(PINGS_PER_S * 8)
    )
    text = (
        f"edge: {{id: e, listen: '127.0.0.1:0', state_dir: '{tmp_path}'}}\n"
        "admin: {listen: '127.0.0.1:0'}\n"
        "openai: {listen: '127.0.0.1:0'}\n"
        f"nodes:\n{nodes}"
    )
    edge = Edge(parse_config(text), heartbeat_s=2.0)
    assert edge.hub.heartbeat_s == 8.0
    assert edge.hub.heartbeats.interval_s == 8.0


class _Session:
    def __init__(self) -> None:
        self.looks: list[float] = []

    def look(self, now: float, quiet_s: float) -> None:
        self.looks.append(now)


class _GridSteps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name == "grid":
            self.steps += 1


async def test_the_grid_wakes_at_its_sessions_beats_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A slot nobody joined costs no wake-up, and a grid without sessions sleeps until one
    joins: an Edge with one Node wakes once an interval for it, not at every beat."""
    grid = HeartbeatGrid(interval_s=5.0, timeout_s=10.0)
    counter = _GridSteps()
    trio.lowlevel.add_instrument(counter)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(grid.run, name="grid")
            await trio.sleep(60)
            assert counter.steps == 1  # started, then asleep: no session, no beat
            session = _Session()
            joined = trio.current_time()
            grid.join(session)
            await trio.sleep(20.5)
            assert len(session.looks) == 4
            assert session.looks[0] - joined == pytest.approx(5.0, abs=HEARTBEAT_STEP_S)
            assert [b - a for a, b in itertools.pairwise(session.looks)] == pytest.approx([5.0] * 3)
            assert counter.steps == 1 + 4  # the join set the wait to its beat: a wake a look
            grid.leave(session)
            steps = counter.steps
            await trio.sleep(60)
            assert counter.steps <= steps + 1  # the beat it was waiting for, then asleep
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(counter)
