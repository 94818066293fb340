"""The Edge's heartbeats: one grid looks at every session, a look pings only a peer the
Edge has not heard from, and a peer that leaves a ping unanswered is dropped (session
Rule 5, `runtime/heartbeat.py`).

A thousand sessions pinging on independent timers woke the Edge 200 times a second; on
the grid, the sessions due at the same instant ping in one scheduling pass, a Node that
pings the Edge itself (as every Node does) needs no ping back, and no session keeps a
timer of its own. Driven by Trio's autojump clock, so no test here waits in real time."""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import trio
from trio.testing import MockClock
from trio_websocket import WebSocketConnection

from iop_edge.runtime.nodes.heartbeat import HeartbeatGrid
from iop_edge.runtime.nodes.session import NodeSession
from schemas.heartbeat import heartbeat_slots

INTERVAL_S = 5.0
TIMEOUT_S = 15.0
STEP_S = INTERVAL_S / heartbeat_slots(INTERVAL_S)


class _Peer:
    """A websocket whose peer answers each ping after `answer_s` (never, when None) and
    sends nothing else."""

    def __init__(self, answer_s: float | None = 0.0) -> None:
        self.answer_s = answer_s
        self.pings: list[float] = []

    async def ping(self) -> None:
        self.pings.append(trio.current_time())
        if self.answer_s is None:
            await trio.sleep_forever()
        await trio.sleep(self.answer_s)

    async def get_message(self) -> bytes:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send_message(self, message: bytes) -> None:
        pass


def _session(peer: _Peer) -> NodeSession:
    return NodeSession(
        "n1",
        cast(WebSocketConnection, peer),
        applied_revision=1,
        on_status=lambda node_id, status: None,
    )


@asynccontextmanager
async def _grid() -> AsyncIterator[HeartbeatGrid]:
    """A heartbeat grid keeping its time for the block (as the Edge's nursery does)."""
    grid = HeartbeatGrid(INTERVAL_S, TIMEOUT_S)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(grid.run)
        yield grid
        nursery.cancel_scope.cancel()


def _gaps(moments: list[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(moments)]


def _on_grid(moment: float) -> bool:
    return math.isclose(moment / STEP_S, round(moment / STEP_S), abs_tol=1e-6)


async def test_sessions_started_apart_ping_every_interval_on_the_shared_grid(
    autojump_clock: MockClock,
) -> None:
    peers = [_Peer(), _Peer(answer_s=0.01)]
    started: list[float] = []
    with trio.move_on_after(60):
        async with _grid() as grid, trio.open_nursery() as nursery:
            for delay, peer in zip((0.013, 2.718), peers, strict=True):
                await trio.sleep(delay)
                started.append(trio.current_time())
                nursery.start_soon(_session(peer).serve, grid)
    for start, peer in zip(started, peers, strict=True):
        assert len(peer.pings) >= 10
        assert all(_on_grid(moment) for moment in peer.pings), peer.pings
        gaps = _gaps(peer.pings)
        assert all(math.isclose(gap, INTERVAL_S) for gap in gaps), gaps
        assert INTERVAL_S <= peer.pings[0] - start < INTERVAL_S + STEP_S  # no ping early


async def test_a_slow_answer_moves_the_next_look_to_the_next_beat_after_it(
    autojump_clock: MockClock,
) -> None:
    peer = _Peer(answer_s=7.0)  # slower than the interval, within the timeout
    with trio.move_on_after(50):
        async with _grid() as grid:
            await _session(peer).serve(grid)
    # Ping at 0, answer at 7; the look at 10 finds the peer heard from 3 s ago, the
    # one at 15 pings again.
    assert len(peer.pings) >= 3
    gaps = _gaps(peer.pings)
    assert all(math.isclose(gap, 3 * INTERVAL_S) for gap in gaps), gaps
    assert all(_on_grid(moment) for moment in peer.pings)


async def test_a_peer_heard_from_every_interval_is_not_pinged_until_it_falls_silent(
    autojump_clock: MockClock,
) -> None:
    """A Node pings the Edge every interval on its own: that is proof enough of life."""
    peer = _Peer()
    session = _session(peer)
    quiet_from = 42.0
    async with _grid() as grid, trio.open_nursery() as nursery:
        nursery.start_soon(session.serve, grid)
        while trio.current_time() < quiet_from:
            await trio.sleep(INTERVAL_S - 0.3)  # the peer's own ping, a bit off the grid
            session.heard()
        await trio.sleep(3 * INTERVAL_S)
        nursery.cancel_scope.cancel()
    assert peer.pings, "a silent peer is pinged"
    assert peer.pings[0] > quiet_from
    assert peer.pings[0] - quiet_from <= 2 * INTERVAL_S


async def test_a_peer_that_never_answers_is_dropped_after_the_timeout(
    autojump_clock: MockClock,
) -> None:
    peer = _Peer(answer_s=None)
    session = _session(peer)
    async with _grid() as grid:
        await session.serve(grid)
    assert len(peer.pings) == 1
    assert math.isclose(trio.current_time() - peer.pings[0], TIMEOUT_S)
    assert session.end_reason == f"no heartbeat answer within {TIMEOUT_S:g}s"
    assert session.closed.is_set()
