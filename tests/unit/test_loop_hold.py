"""A refresh of a fleet's config never holds the Edge's event loop (design §5, §13).

The Refresher runs against a fake Edge whose pool is a real `Scheduler`, with a config
of thousands of Nodes, and its real worker process (`runtime.refresh.worker`). An
instrument measures every task step's CPU time on the event loop's thread: a caller's
request waits at most one step between two of its own, so the longest step bounds how
much a refresh can delay it. CPU time, not wall time: a busy machine that preempts the
test does not make the Edge hold its loop. The heap is frozen first (`settled_heap`),
as the Edge's heap keeper keeps it (`runtime.lifecycle.heap`): a full collection of the
test's own heap is the keeper's business (measured in bench/fleet.py), not the refresh's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import trio

from bench.many_nodes import ManyNodesShape, fleet_config, node_credentials
from bench.targets import FLEET_MAX_LOOP_HOLD_S
from iop_edge.core.configuration.config import parse_config
from iop_edge.core.refresh import refresh_plan
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.lifecycle.heap_keeper import HeapKeeper
from iop_edge.runtime.refresh.audit import AuditLog
from iop_edge.runtime.refresh.push import AckListener
from iop_edge.runtime.refresh.refresh import Refresher
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas.config import NodeConfig
from schemas.refresh import RefreshRequest
from schemas.wire import RefreshAck

NODES = 2000
PER_NODE = 3
#: The longest a refresh may hold the loop in one step (CPU seconds). The target itself
#: (50 ms at 10,000 Nodes) is the fleet bench's, `bench.targets.FLEET_MAX_LOOP_HOLD_S`;
#: here the bound guards the structure (a refresh's work on the loop stays cut into
#: steps: about 0.2 s of it at 2,000 Nodes, its longest step 25-35 ms on an idle 2-core
#: machine), twice the target, so that a loaded machine, whose contention for the cores
#: and their caches made that step 58 ms of CPU, does not fail it.
LOOP_HOLD_BOUND_S = 2 * FLEET_MAX_LOOP_HOLD_S


_SHAPE = ManyNodesShape(nodes=NODES, providers_per_node=PER_NODE, models=10)
#: One set of Node tokens for every version of the fleet's config: its changes are the
#: providers' alone.
_CREDENTIALS = node_credentials(NODES)


def _fleet(capacity: int) -> str:
    return fleet_config(_SHAPE, _CREDENTIALS, Path("./var"), capacity=capacity)


class FleetEdge:
    """A `RefreshTarget` whose pool is a real scheduler and whose Nodes all ack."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.scheduler = Scheduler(snapshot)
        self.nodes = frozenset(snapshot.nodes)
        self.applied = dict.fromkeys(self.nodes, snapshot.revision)

    def swap_snapshot(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.scheduler.apply_snapshot(snapshot)

    def connected_nodes(self) -> frozenset[str]:
        return self.nodes

    def applied_revisions(self) -> Mapping[str, int]:
        return self.applied

    async def push_node_config(
        self, node_id: str, revision: int, node_config: NodeConfig, answer: AckListener
    ) -> None:
        self.applied[node_id] = revision
        # the ack arrives in a later step, as a Node's does
        ack = RefreshAck(revision=revision, ok=True)
        trio.lowlevel.current_trio_token().run_sync_soon(answer, ack)


class LongestStep(trio.abc.Instrument):
    """The most CPU time any task step took on the event loop's thread."""

    def __init__(self) -> None:
        self.began: float | None = None
        """None until a step begins (the step that adds the instrument is not one)."""
        self.longest = 0.0
        self.task = ""

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.began = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.began is None:
            return
        spent = time.thread_time() - self.began
        if spent > self.longest:
            self.longest, self.task = spent, task.name


@pytest.fixture(scope="module")
def fleet() -> tuple[str, str]:
    return _fleet(capacity=4), _fleet(capacity=5)


async def test_a_fleet_refresh_holds_the_loop_no_step_longer_than_the_bound(
    fleet: tuple[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    settled_heap: None,
) -> None:
    running, candidate = fleet
    parsed = await trio.to_thread.run_sync(parse_config, running)
    edge = FleetEdge(Snapshot.build(parsed.config, revision=1, config_sha256=parsed.sha256))
    # The Edge's heap keeper holds the collector during an apply (`lifecycle.heap`, Rule 5):
    # without it, the collections of the apply's new objects are the longest steps.
    keeper = HeapKeeper()
    refresher = Refresher(edge, config_path=None, audit=AuditLog(tmp_path), hold=keeper.held)
    planned_here: list[object] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        planned_here.append(args)
        raise AssertionError("planned in the Edge's process")

    monkeypatch.setattr(refresh_plan, "plan_apply", recorded)
    steps = LongestStep()
    trio.lowlevel.add_instrument(steps)
    try:
        dry = await refresher.refresh(RefreshRequest(mode="dry_run", config_yaml=candidate))
        applied = await refresher.refresh(RefreshRequest(mode="apply", config_yaml=candidate))
    finally:
        trio.lowlevel.remove_instrument(steps)

    assert dry.report.outcome == "dry_run" and len(dry.report.changes) == NODES * PER_NODE
    # the plan's lists came from the worker in pieces, in order, with its paths by class
    assert dry.report.live_paths == [change.path for change in dry.report.changes]
    assert dry.report.restart_required_paths == []
    assert len(dry.report.changed_providers) == NODES * PER_NODE
    assert applied.report.outcome == "applied"
    assert [node.status for node in applied.report.nodes] == ["applied"] * NODES
    assert edge.scheduler.snapshot.revision == 2
    assert planned_here == []  # reading and planning ran in the worker process
    assert refresher.worker.starts == 1  # one worker, kept between the two
    await refresher.aclose()
    assert steps.longest <= LOOP_HOLD_BOUND_S, (steps.task, steps.longest)


async def test_a_change_to_one_node_checks_and_pushes_that_node_only(
    fleet: tuple[str, str], tmp_path: Path
) -> None:
    running, _ = fleet
    parsed = await trio.to_thread.run_sync(parse_config, running)
    edge = FleetEdge(Snapshot.build(parsed.config, revision=1, config_sha256=parsed.sha256))
    # The Edge's service has the worker read the running config's text as it starts: the
    # first candidate is then checked only where it changed.
    refresher = Refresher(edge, config_path=None, audit=AuditLog(tmp_path), running_text=running)
    pushed: list[str] = []
    push = edge.push_node_config

    async def recorded(
        node_id: str, revision: int, node_config: NodeConfig, answer: AckListener
    ) -> None:
        pushed.append(node_id)
        await push(node_id, revision, node_config, answer)

    edge.push_node_config = recorded  # type: ignore[method-assign]
    one = running.replace("capacity: 4", "capacity: 9", 1)  # node-0000's first provider
    unchanged = edge.snapshot.nodes["node-0001"]
    async with trio.open_nursery() as service:
        await service.start(refresher.run)
        result = await refresher.refresh(RefreshRequest(mode="apply", config_yaml=one))
        service.cancel_scope.cancel()  # the service stops the worker as it ends
    assert refresher.worker.process is None
    # the worker's reading of the running config is nobody's refresh: not audited
    assert len((tmp_path / "refresh-audit.jsonl").read_text().splitlines()) == 1

    report = result.report
    statistics = refresher.statistics()
    # one entry's YAML parsed, one entry checked
    assert (statistics.parsed_nodes, statistics.checked_nodes) == (1, 1)
    assert edge.snapshot.nodes["node-0001"] is unchanged  # an unchanged Node keeps its object
    assert [c.path for c in report.changes] == ["nodes[node-0000].providers[node-0000-p0].capacity"]
    assert pushed == ["node-0000"]
    assert [(n.id, n.status) for n in report.nodes] == [("node-0000", "applied")]
    assert edge.scheduler.statistics().providers["node-0000-p0"].capacity == 9
