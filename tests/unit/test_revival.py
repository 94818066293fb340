"""Probes on demand (`iop_edge.runtime.runs.revival`): a refusal because every provider
is down waits for a probe; one probe in flight and one a second per provider, whatever
the number of callers. Time is virtual; a fake hub stands in for the Nodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from iop_edge.runtime.nodes.hub import NodeHub
from iop_edge.runtime.runs.admission_errors import NoProvider
from iop_edge.runtime.runs.revival import PROBE_GAP_S, PROBE_WAIT_S, Revival
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas import wire

from .test_scheduler import make_snapshot, provider


@dataclass
class FakeSession:
    features: frozenset[str] = frozenset({wire.FEATURE_PROBE})
    probes: list[tuple[float, list[str]]] = field(default_factory=list)

    def send_nowait(self, message: wire.Message) -> None:
        assert isinstance(message, wire.Probe)
        self.probes.append((trio.current_time(), message.providers))


@dataclass
class FakeHub:
    sessions: dict[str, FakeSession]

    def session(self, node_id: str) -> FakeSession | None:
        return self.sessions.get(node_id)


def _down_pool(session: FakeSession) -> tuple[Scheduler, Revival]:
    snapshot = make_snapshot({"n1": [provider("p1")]}, {"m": ["p1"]})
    scheduler = Scheduler(snapshot)
    scheduler.node_connected("n1")
    scheduler.provider_status("p1", "unavailable", [], detail="connection refused")
    return scheduler, Revival(scheduler, cast(NodeHub, FakeHub({"n1": session})))


async def _acquire(revival: Revival, outcomes: list[str]) -> None:
    kwargs: dict[str, Any] = {"long": False, "exclude": frozenset(), "protocol": "chat"}
    try:
        lease = await revival.acquire("m", "r", principal="anonymous", **kwargs)
    except NoProvider:
        outcomes.append("refused")
    else:
        lease.release()
        outcomes.append("served")


async def test_a_provider_the_probe_finds_back_takes_the_request(
    autojump_clock: trio.abc.Clock,
) -> None:
    session = FakeSession()
    scheduler, revival = _down_pool(session)
    outcomes: list[str] = []
    async with trio.open_nursery() as nursery:
        for _ in range(6):  # a storm of callers: one probe
            nursery.start_soon(_acquire, revival, outcomes)
        await wait_all_tasks_blocked()
        assert session.probes == [(0, ["p1"])] and outcomes == []
        scheduler.provider_status("p1", "available", ["p1-served"])
        revival.answered(["p1"])
    assert outcomes == ["served"] * 6


async def test_still_down_is_refused_once_the_probe_says_so_and_probes_wait_a_gap(
    autojump_clock: trio.abc.Clock,
) -> None:
    session = FakeSession()
    _, revival = _down_pool(session)
    outcomes: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_acquire, revival, outcomes)
        await wait_all_tasks_blocked()
        revival.answered(["p1"])  # the probe found it down
    assert outcomes == ["refused"] and trio.current_time() == 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_acquire, revival, outcomes)  # at once: the next probe waits
        await wait_all_tasks_blocked()
        assert len(session.probes) == 1
        await trio.sleep(PROBE_GAP_S)
        await wait_all_tasks_blocked()
        assert session.probes[-1] == (PROBE_GAP_S, ["p1"])
        revival.answered(["p1"])
    assert outcomes == ["refused", "refused"]


async def test_an_unanswered_probe_holds_a_caller_for_a_bounded_time(
    autojump_clock: trio.abc.Clock,
) -> None:
    session = FakeSession()
    _, revival = _down_pool(session)
    outcomes: list[str] = []
    await _acquire(revival, outcomes)
    assert outcomes == ["refused"] and trio.current_time() == pytest.approx(PROBE_WAIT_S)


@pytest.mark.parametrize("features", [frozenset(), frozenset({"something-else"})])
async def test_a_node_that_takes_no_probe_is_not_sent_one(features: frozenset[str]) -> None:
    session = FakeSession(features=features)
    _, revival = _down_pool(session)
    outcomes: list[str] = []
    await _acquire(revival, outcomes)
    assert outcomes == ["refused"] and session.probes == []
