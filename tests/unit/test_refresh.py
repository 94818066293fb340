"""The Refresher against a fake Edge: decisions, swaps, pushes, the file and the audit log."""

from __future__ import annotations

import contextlib
import json
import math
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest
import trio
import trio.testing
import yaml

from iop_edge.core.configuration.config import ParsedConfig, parse_config
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.refresh.audit import AuditLog, reserve_room, write_config_atomically
from iop_edge.runtime.refresh.push import (
    PUSH_RATE_PER_S,
    RETRY_NOTE,
    TURN_GRAIN_S,
    AckListener,
)
from iop_edge.runtime.refresh.refresh import Refresher, RefreshResult, RefreshTarget
from schemas.config import NodeConfig
from schemas.refresh import NodeResult, RefreshReport, RefreshRequest
from schemas.wire import RefreshAck


def unpack(result: RefreshResult) -> tuple[str, RefreshReport]:
    return result.verdict, result.report


NODE_IDS = ("gpu1", "gpu2", "gpu3", "gpu4", "gpu5")
SECRET_HASH = "c0ffee" + "e" * 58

Behaviour = Literal["ack", "refuse", "hang", "gone", "hold", "raise"]


def config_dict() -> dict[str, Any]:
    return {
        "edge": {"id": "edge-1", "listen": "127.0.0.1:0", "state_dir": "./var"},
        "admin": {"listen": "127.0.0.1:0"},
        "openai": {"listen": "127.0.0.1:0"},
        "models": [{"id": f"model-{n}", "providers": {f"{n}-sim": "sim-small"}} for n in NODE_IDS],
        "nodes": [
            {
                "id": n,
                "token_hash_sha256": f"{i}" * 64,
                "providers": [
                    {"id": f"{n}-sim", "type": "sim", "models": ["sim-small"], "capacity": 4}
                ],
            }
            for i, n in enumerate(NODE_IDS, start=1)
        ],
    }


def to_yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False)


def node_of(data: dict[str, Any], node_id: str) -> dict[str, Any]:
    found: dict[str, Any] = next(n for n in data["nodes"] if n["id"] == node_id)
    return found


def provider_of(data: dict[str, Any], node_id: str) -> dict[str, Any]:
    found: dict[str, Any] = node_of(data, node_id)["providers"][0]
    return found


def with_capacity(capacity: int, *node_ids: str) -> dict[str, Any]:
    data = config_dict()
    for node_id in node_ids:
        provider_of(data, node_id)["capacity"] = capacity
    return data


class FakeEdge:
    """A `RefreshTarget` that records swaps and pushes and acks as each node is told to."""

    def __init__(self, parsed: ParsedConfig, connected: tuple[str, ...] = NODE_IDS) -> None:
        self.snapshot = Snapshot.build(parsed.config, revision=1, config_sha256=parsed.sha256)
        self.swaps: list[Snapshot] = []
        self.connected = set(connected)
        self.applied: dict[str, int] = dict.fromkeys(connected, 1)
        self.pushes: list[tuple[str, int, NodeConfig]] = []
        self.push_times: dict[str, float] = {}
        self.behaviour: dict[str, Behaviour] = {}
        self.push_entered = trio.Event()
        self.release = trio.Event()

    def swap_snapshot(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.swaps.append(snapshot)

    def connected_nodes(self) -> frozenset[str]:
        return frozenset(self.connected)

    def applied_revisions(self) -> Mapping[str, int]:
        return self.applied

    async def push_node_config(
        self, node_id: str, revision: int, node_config: NodeConfig, answer: AckListener
    ) -> None:
        self.pushes.append((node_id, revision, node_config))
        self.push_times[node_id] = trio.current_time()
        match self.behaviour.get(node_id, "ack"):
            case "refuse":
                answer(RefreshAck(revision=revision, ok=False, error="adapter build failed"))
                return
            case "hang":
                return  # sent, and never acked
            case "gone":
                answer(None)
                return
            case "raise":
                raise ConnectionResetError("boom")
            case "hold":  # the Node's outbox is full until released
                self.push_entered.set()
                await self.release.wait()
        self.applied[node_id] = revision
        answer(RefreshAck(revision=revision, ok=True))


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    """The Edge's config file, holding the same text the fake Edge starts from."""
    path = tmp_path / "etc" / "edge.yaml"
    path.parent.mkdir()
    path.write_text(to_yaml(config_dict()))
    return path


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge(parse_config(to_yaml(config_dict())))


@pytest.fixture
def audit(tmp_path: Path) -> AuditLog:
    return AuditLog(tmp_path / "state")


@pytest.fixture
def refresher(edge: FakeEdge, config_path: Path, audit: AuditLog) -> Refresher:
    target: RefreshTarget = edge
    return Refresher(target, config_path=config_path, audit=audit)


def apply(data: dict[str, Any], **options: Any) -> RefreshRequest:
    return RefreshRequest(mode="apply", config_yaml=to_yaml(data), **options)


async def read(path: Path) -> str:
    return await trio.Path(path).read_text()


async def names_in(directory: Path) -> list[str]:
    return sorted(p.name for p in await trio.Path(directory).iterdir())


async def audit_lines(audit: AuditLog) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (await read(audit.path)).splitlines()]


# --- decisions ---------------------------------------------------------------------------


async def test_dry_run_changes_nothing(
    refresher: Refresher, edge: FakeEdge, config_path: Path, audit: AuditLog
) -> None:
    before = await read(config_path)
    verdict, report = unpack(
        await refresher.refresh(
            RefreshRequest(mode="dry_run", config_yaml=to_yaml(with_capacity(8, "gpu1")))
        )
    )

    assert verdict == "accepted"
    assert (report.outcome, report.base_revision, report.revision) == ("dry_run", 1, 1)
    assert report.live_paths == ["nodes[gpu1].providers[gpu1-sim].capacity"]
    assert report.changed_nodes == ["gpu1"]
    assert report.nodes == []
    assert edge.swaps == [] and edge.pushes == []
    assert edge.snapshot.revision == 1
    assert (await read(config_path)) == before
    assert await names_in(config_path.parent) == ["edge.yaml"]
    assert [line["outcome"] for line in (await audit_lines(audit))] == ["dry_run"]


async def test_dry_run_reports_what_an_apply_would_refuse(
    refresher: Refresher, edge: FakeEdge
) -> None:
    data = config_dict()
    data["edge"]["listen"] = "127.0.0.1:1"
    verdict, report = unpack(
        await refresher.refresh(RefreshRequest(mode="dry_run", config_yaml=to_yaml(data)))
    )
    assert (verdict, report.outcome) == ("accepted", "dry_run")
    assert [e.path for e in report.errors] == ["edge.listen"]
    assert edge.swaps == []


async def test_invalid_candidate_is_400_with_every_error(
    refresher: Refresher, edge: FakeEdge, audit: AuditLog
) -> None:
    data = config_dict()
    provider_of(data, "gpu1")["capacity"] = 0
    data["models"][1]["providers"] = {"no-such-provider": "x"}
    data["dispatch"] = {"max_queeu": 3}

    verdict, report = unpack(await refresher.refresh(apply(data)))

    assert verdict == "invalid"
    assert report.outcome == "rejected"
    paths = [e.path for e in report.errors]
    assert paths == sorted(paths)
    assert len(paths) >= 3
    assert any("capacity" in p for p in paths)
    assert any("max_queeu" in p for p in paths)
    assert any(
        "no-such-provider" in e.path or "no-such-provider" in e.message for e in report.errors
    )
    assert edge.swaps == [] and edge.pushes == []
    assert (await audit_lines(audit))[0]["verdict"] == "invalid"


async def test_no_candidate_without_a_config_file_is_400(edge: FakeEdge, audit: AuditLog) -> None:
    refresher = Refresher(edge, config_path=None, audit=audit)
    verdict, report = unpack(await refresher.refresh(RefreshRequest(mode="apply")))
    assert (verdict, report.outcome) == ("invalid", "rejected")
    assert "config_yaml" in report.errors[0].message


async def test_no_refresh_runs_while_the_edge_says_it_may_not(
    edge: FakeEdge, config_path: Path, audit: AuditLog
) -> None:
    """A restart in progress (its new Edge has read the config file) refuses a refresh as
    another refresh does: 409, nothing applied, the attempt audited."""
    before = await read(config_path)
    reason = "a restart is in progress (its new Edge has read the config file)"
    refresher = Refresher(edge, config_path=config_path, audit=audit, blocked=lambda: reason)
    verdict, report = unpack(await refresher.refresh(apply(with_capacity(8, "gpu1"))))
    assert (verdict, report.outcome) == ("conflict", "rejected")
    assert report.errors[0].message == f"{reason}; retry when it has finished"
    assert await read(config_path) == before and edge.snapshot.revision == 1
    assert [line["verdict"] for line in await audit_lines(audit)] == ["conflict"]


async def test_restart_required_change_is_409_and_nothing_changes(
    refresher: Refresher, edge: FakeEdge, config_path: Path
) -> None:
    before = await read(config_path)
    data = with_capacity(8, "gpu1")
    data["edge"]["listen"] = "127.0.0.1:1"
    node_of(data, "gpu2")["token_hash_sha256"] = SECRET_HASH

    verdict, report = unpack(await refresher.refresh(apply(data)))

    assert verdict == "conflict"
    assert report.outcome == "rejected"
    assert report.restart_required_paths == ["edge.listen", "nodes[gpu2].token_hash_sha256"]
    assert [e.path for e in report.errors] == report.restart_required_paths
    assert report.live_paths == ["nodes[gpu1].providers[gpu1-sim].capacity"]
    assert report.pending_restart == []
    assert edge.swaps == [] and edge.pushes == []
    assert (await read(config_path)) == before
    assert SECRET_HASH.encode() not in msgspec.json.encode(report)


async def test_allow_restart_required_applies_the_live_subset(
    refresher: Refresher, edge: FakeEdge, config_path: Path
) -> None:
    data = with_capacity(8, "gpu1")
    data["edge"]["listen"] = "127.0.0.1:1"
    node_of(data, "gpu2")["alias"] = "rack-b/gpu2"
    provider_of(data, "gpu3")["type"] = "cli"
    provider_of(data, "gpu3")["adapter"] = {"command": ["echo"]}
    provider_of(data, "gpu3")["priority"] = 1

    verdict, report = unpack(await refresher.refresh(apply(data, allow_restart_required=True)))

    assert (verdict, report.outcome, report.revision) == ("accepted", "applied", 2)
    expected_pending = [
        "edge.listen",
        "nodes[gpu2].alias",
        "nodes[gpu3].providers[gpu3-sim].adapter.command",
        "nodes[gpu3].providers[gpu3-sim].type",
    ]
    assert report.pending_restart == expected_pending
    assert refresher.status().pending_restart == expected_pending
    running = edge.snapshot
    assert running.revision == 2
    assert running.config.edge.listen == "127.0.0.1:0"
    assert running.nodes["gpu2"].alias is None
    assert (running.providers["gpu3-sim"].type, running.providers["gpu3-sim"].priority) == (
        "sim",
        1,
    )
    assert running.providers["gpu1-sim"].capacity == 8
    # gpu3's category follows its new type in the candidate; that is live and goes through.
    assert sorted(n for n, _, _ in edge.pushes) == ["gpu1", "gpu3"]
    assert (await read(config_path)) == to_yaml(data)  # the file holds the whole candidate


async def test_pending_paths_do_not_block_again_and_clear_when_reverted(
    refresher: Refresher, edge: FakeEdge
) -> None:
    data = config_dict()
    data["edge"]["listen"] = "127.0.0.1:1"
    await refresher.refresh(apply(data, allow_restart_required=True))
    assert refresher.status().pending_restart == ["edge.listen"]

    provider_of(data, "gpu1")["capacity"] = 2
    verdict, report = unpack(await refresher.refresh(apply(data)))
    assert (verdict, report.outcome) == ("accepted", "applied")
    assert report.pending_restart == ["edge.listen"]

    data["admin"]["listen"] = "127.0.0.1:2"  # a new restart-required change blocks
    verdict, report = unpack(await refresher.refresh(apply(data)))
    assert (verdict, [e.path for e in report.errors]) == ("conflict", ["admin.listen"])

    verdict, report = unpack(await refresher.refresh(apply(config_dict())))
    assert (verdict, report.outcome, report.pending_restart) == ("accepted", "applied", [])
    assert edge.snapshot.config.edge.listen == "127.0.0.1:0"


async def test_live_subset_that_needs_a_restart_part_is_409(
    refresher: Refresher, edge: FakeEdge
) -> None:
    data = config_dict()
    node_of(data, "gpu1")["providers"].append(
        {"id": "gpu1-new", "type": "sim", "models": ["sim-new"], "capacity": 1}
    )
    data["models"][0]["providers"]["gpu1-new"] = "sim-new"

    verdict, report = unpack(await refresher.refresh(apply(data, allow_restart_required=True)))

    assert (verdict, report.outcome) == ("conflict", "rejected")
    assert [e.path for e in report.errors] == ["models[model-gpu1].providers[gpu1-new]"]
    assert edge.swaps == []
    assert refresher.status().pending_restart == []


async def test_if_revision_must_match(refresher: Refresher, edge: FakeEdge) -> None:
    verdict, report = unpack(
        await refresher.refresh(apply(with_capacity(8, "gpu1"), if_revision=7))
    )
    assert (verdict, report.outcome) == ("conflict", "rejected")
    assert report.errors[0].path == "if_revision"
    assert edge.swaps == []

    verdict, report = unpack(
        await refresher.refresh(apply(with_capacity(8, "gpu1"), if_revision=1))
    )
    assert (verdict, report.revision) == ("accepted", 2)


async def test_concurrent_refresh_is_409_at_once(
    refresher: Refresher, edge: FakeEdge, audit: AuditLog
) -> None:
    edge.behaviour["gpu1"] = "hold"
    first: list[tuple[str, RefreshReport]] = []

    async def run_first() -> None:
        first.append(unpack(await refresher.refresh(apply(with_capacity(8, "gpu1")))))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_first)
        await edge.push_entered.wait()
        assert refresher.statistics().busy

        verdict, report = unpack(await refresher.refresh(apply(with_capacity(9, "gpu2"))))
        assert (verdict, report.outcome) == ("conflict", "rejected")
        assert "in progress" in report.errors[0].message
        assert first == []
        edge.release.set()

    [(verdict, report)] = first
    assert (verdict, report.outcome, report.revision) == ("accepted", "applied", 2)
    assert len(edge.swaps) == 1
    assert not refresher.statistics().busy
    # The apply's line is written before its swap, so it comes first.
    assert [line["verdict"] for line in (await audit_lines(audit))] == ["accepted", "conflict"]


async def test_an_apply_holds_the_heap_from_its_build_to_its_end_and_a_dry_run_never(
    edge: FakeEdge, config_path: Path, audit: AuditLog
) -> None:
    """The Edge's heap keeper holds the collector back while an apply makes a fleet's
    objects (`lifecycle.heap`, Rule 5): from the worker's built answer through the swap
    and the pushes, and no longer; the snapshot, as it is assembled, is kept (said alive)
    before the swap."""
    events: list[str] = []

    def keep() -> None:
        if events[-1] != "kept":
            events.append("kept")
        assert edge.snapshot.revision == 1  # before the swap

    @contextlib.contextmanager
    def hold() -> Iterator[Callable[[], None]]:
        events.append(f"hold at revision {edge.snapshot.revision}")
        try:
            yield keep
        finally:
            events.append(f"let go after {len(edge.pushes)} push(es)")

    refresher = Refresher(edge, config_path=config_path, audit=audit, hold=hold)
    try:
        dry = RefreshRequest(mode="dry_run", config_yaml=to_yaml(with_capacity(8, "gpu1")))
        assert (await refresher.refresh(dry)).verdict == "accepted"
        assert events == []
        result = await refresher.refresh(apply(with_capacity(8, "gpu1", "gpu2")))
        assert (result.verdict, result.report.revision) == ("accepted", 2)
        assert events == ["hold at revision 1", "kept", "let go after 2 push(es)"]
    finally:
        await refresher.aclose()


async def test_no_change_apply_makes_a_new_revision_and_pushes_nothing(
    refresher: Refresher, edge: FakeEdge
) -> None:
    verdict, report = unpack(await refresher.refresh(apply(config_dict())))
    assert (verdict, report.outcome, report.base_revision, report.revision) == (
        "accepted",
        "no_change",
        1,
        2,
    )
    assert report.changes == [] and report.nodes == []
    assert [s.revision for s in edge.swaps] == [2]
    assert edge.pushes == []


async def test_apply_without_candidate_rereads_the_file(
    refresher: Refresher, edge: FakeEdge, config_path: Path
) -> None:
    await trio.Path(config_path).write_text(to_yaml(with_capacity(3, "gpu4")))
    verdict, report = unpack(await refresher.refresh(RefreshRequest(mode="apply")))
    assert (verdict, report.outcome) == ("accepted", "applied")
    assert report.changed_providers == ["gpu4-sim"]
    assert edge.snapshot.providers["gpu4-sim"].capacity == 3
    assert await names_in(config_path.parent) == ["edge.yaml"]  # nothing was written


# --- pushes ------------------------------------------------------------------------------


async def test_push_results_per_node(
    config_path: Path, audit: AuditLog, autojump_clock: trio.testing.MockClock
) -> None:
    edge = FakeEdge(parse_config(to_yaml(config_dict())), connected=NODE_IDS[:4])
    # The worker's and the file writes' deadlines are for hangs in real time: the autojump
    # clock would reach any deadline while the worker reads or a thread writes.
    refresher = Refresher(
        edge,
        config_path=config_path,
        audit=audit,
        push_timeout_s=10.0,
        worker_deadline_s=math.inf,
        write_deadline_s=math.inf,
    )
    edge.behaviour.update(gpu2="refuse", gpu3="hang", gpu4="gone")
    start = trio.current_time()

    verdict, report = unpack(await refresher.refresh(apply(with_capacity(8, *NODE_IDS))))

    assert (verdict, report.outcome) == ("accepted", "applied")
    assert [(r.id, r.status, r.revision) for r in report.nodes] == [
        ("gpu1", "applied", 2),
        ("gpu2", "failed", 2),
        ("gpu3", "failed", None),
        ("gpu4", "not_connected", None),
        ("gpu5", "not_connected", None),
    ]
    details = {r.id: r.detail for r in report.nodes}
    assert details["gpu2"] == f"adapter build failed; {RETRY_NOTE}"
    # The whole push's deadline grows with the Nodes pushed (four here).
    assert details["gpu3"] == f"no refresh_ack within 10s; {RETRY_NOTE}"
    assert sorted(n for n, _, _ in edge.pushes) == ["gpu1", "gpu2", "gpu3", "gpu4"]
    assert all(rev == 2 for _, rev, _ in edge.pushes)
    # All pushed together, not one after another's ack: four turns at the push rate fall
    # within one grain, and go at once (the audit line written ahead, in a worker
    # thread, may let the autojump clock move before the pushes).
    assert 4 / PUSH_RATE_PER_S <= TURN_GRAIN_S
    times = sorted(edge.push_times.values())
    assert times[0] >= start and times[-1] == times[0]
    assert (await audit_lines(audit))[0]["nodes"][2]["detail"].startswith(
        "no refresh_ack within 10s"
    )


async def test_each_node_gets_only_its_own_providers(refresher: Refresher, edge: FakeEdge) -> None:
    await refresher.refresh(apply(with_capacity(8, "gpu2")))
    [(node_id, revision, node_config)] = edge.pushes
    assert (node_id, revision) == ("gpu2", 2)
    assert node_config.node_id == "gpu2"
    assert [(p.id, p.capacity) for p in node_config.providers] == [("gpu2-sim", 8)]


async def test_a_push_that_raises_is_a_failed_node(refresher: Refresher, edge: FakeEdge) -> None:
    edge.behaviour["gpu1"] = "raise"
    verdict, report = unpack(await refresher.refresh(apply(with_capacity(8, "gpu1", "gpu2"))))
    assert verdict == "accepted"
    assert [(r.id, r.status) for r in report.nodes] == [("gpu1", "failed"), ("gpu2", "applied")]
    assert report.nodes[0].detail == f"push failed: ConnectionResetError; {RETRY_NOTE}"


async def test_caller_cancelled_after_the_swap_still_pushes_and_audits(
    refresher: Refresher, edge: FakeEdge, audit: AuditLog
) -> None:
    edge.behaviour["gpu1"] = "hold"
    caller = trio.CancelScope()

    async def hang_up_then_ack() -> None:
        await edge.push_entered.wait()
        caller.cancel()
        await trio.testing.wait_all_tasks_blocked()
        edge.release.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hang_up_then_ack)
        with caller:
            verdict, report = unpack(await refresher.refresh(apply(with_capacity(8, "gpu1"))))
    assert caller.cancel_called
    assert (verdict, report.outcome) == ("accepted", "applied")
    assert edge.applied["gpu1"] == 2
    [line] = await audit_lines(audit)
    assert (line["outcome"], line["nodes"][0]["status"]) == ("applied", "applied")


# --- status ------------------------------------------------------------------------------


async def test_status_lists_every_node(refresher: Refresher, edge: FakeEdge) -> None:
    edge.connected = {"gpu1", "gpu3"}
    edge.applied = {"gpu1": 1, "gpu3": 1}
    await refresher.refresh(apply(with_capacity(8, "gpu1")))

    status = refresher.status()
    assert (status.revision, status.config_sha256) == (2, edge.snapshot.config_sha256)
    assert [(n.id, n.connected, n.applied_revision) for n in status.nodes] == [
        ("gpu1", True, 2),
        ("gpu2", False, None),
        ("gpu3", True, 1),
        ("gpu4", False, None),
        ("gpu5", False, None),
    ]


# --- the file and the audit log ----------------------------------------------------------


async def test_applied_inline_candidate_is_written_keeping_prev(
    refresher: Refresher, config_path: Path
) -> None:
    original = await read(config_path)
    candidate = to_yaml(with_capacity(8, "gpu1"))
    await refresher.refresh(RefreshRequest(mode="apply", config_yaml=candidate))

    assert (await read(config_path)) == candidate
    assert (await read(config_path.with_name("edge.yaml.prev"))) == original
    assert await names_in(config_path.parent) == ["edge.yaml", "edge.yaml.prev"]


async def test_write_config_atomically(tmp_path: Path) -> None:
    path = tmp_path / "edge.yaml"
    await write_config_atomically(path, "first: 1\n")
    assert (await read(path)) == "first: 1\n"
    assert await names_in(tmp_path) == ["edge.yaml"]

    await trio.Path(path).chmod(0o600)
    await write_config_atomically(path, "second: 2\n")
    await write_config_atomically(path, "third: 3\n")
    assert (await read(path)) == "third: 3\n"
    assert (await read(path.with_name("edge.yaml.prev"))) == "second: 2\n"
    assert stat.S_IMODE((await trio.Path(path).stat()).st_mode) == 0o600
    assert await names_in(tmp_path) == ["edge.yaml", "edge.yaml.prev"]


async def test_write_failure_is_reported_but_the_apply_stands(
    edge: FakeEdge, audit: AuditLog, tmp_path: Path
) -> None:
    missing_dir = tmp_path / "no-such-dir" / "edge.yaml"
    refresher = Refresher(edge, config_path=missing_dir, audit=audit)
    verdict, report = unpack(await refresher.refresh(apply(with_capacity(8, "gpu1"))))
    assert (verdict, report.outcome, edge.snapshot.revision) == ("accepted", "applied", 2)
    assert "config file could not be written" in report.errors[0].message


async def test_every_attempt_is_audited(
    refresher: Refresher, audit: AuditLog, config_path: Path
) -> None:
    bad = config_dict()
    bad["nodes"][0]["providers"][0]["capacity"] = 0
    restart = config_dict()
    node_of(restart, "gpu1")["token_hash_sha256"] = SECRET_HASH
    good = with_capacity(8, "gpu1")

    await refresher.refresh(apply(bad))
    await refresher.refresh(apply(restart))
    await refresher.refresh(apply(good, if_revision=5))
    await refresher.refresh(RefreshRequest(mode="dry_run", config_yaml=to_yaml(good)))
    await refresher.refresh(apply(good))

    lines = await audit_lines(audit)
    assert [(line["mode"], line["outcome"], line["verdict"]) for line in lines] == [
        ("apply", "rejected", "invalid"),
        ("apply", "rejected", "conflict"),
        ("apply", "rejected", "conflict"),
        ("dry_run", "dry_run", "accepted"),
        ("apply", "applied", "accepted"),
    ]
    assert lines[1]["changed_paths"] == ["nodes[gpu1].token_hash_sha256"]
    assert lines[0]["errors"] and lines[0]["config_sha256"] is None
    last = lines[-1]
    assert (last["base_revision"], last["revision"]) == (1, 2)
    assert last["config_sha256"] == parse_config(to_yaml(good)).sha256
    assert last["nodes"] == [{"id": "gpu1", "status": "applied", "revision": 2, "detail": None}]
    assert last["time"].endswith("+00:00")
    assert SECRET_HASH not in (await read(audit.path))


def _report_of(nodes: int) -> RefreshReport:
    results = [NodeResult(id=f"node-{i}", status="applied", revision=2) for i in range(nodes)]
    return RefreshReport(
        mode="apply",
        outcome="applied",
        base_revision=1,
        revision=2,
        changed_nodes=[],
        changed_providers=[],
        changed_models=[],
        changes=[],
        live_paths=[],
        restart_required_paths=[],
        pending_restart=[],
        errors=[],
        nodes=results,
    )


async def test_a_line_written_ahead_is_completed_in_place_or_followed(audit: AuditLog) -> None:
    planned = _report_of(0)
    fits = await audit.reserve(planned, verdict="accepted", config_sha256=None, room=400)
    await audit.complete(fits, _report_of(2), verdict="accepted", config_sha256=None)
    raw = audit.path.read_bytes()
    assert len(raw) == fits.length and raw.endswith(b"\n")  # one line, as long as reserved
    assert [len(line["nodes"]) for line in await audit_lines(audit)] == [2]

    tight = await audit.reserve(planned, verdict="accepted", config_sha256=None, room=0)
    await audit.complete(tight, _report_of(50), verdict="accepted", config_sha256=None)
    lines = await audit_lines(audit)
    assert [len(line["nodes"]) for line in lines] == [2, 0, 50]  # the plan stays, the whole after


async def test_a_fleets_reserved_line_is_its_record_and_spaces_whole(audit: AuditLog) -> None:
    """A fleet's room is megabytes, written from a block of spaces many times over: the
    line is the JSON, then exactly its room, then one newline, and completed in place."""
    nodes = 3000
    planned = _report_of(0)
    room = reserve_room(nodes)  # more than one block of spaces, not a multiple of it
    line = await audit.reserve(planned, verdict="accepted", config_sha256=None, room=room)
    raw = audit.path.read_bytes()
    assert len(raw) == line.length and raw.count(b"\n") == 1 and raw.endswith(b" \n")
    assert len(raw) - len(raw.rstrip()) == room + 1
    await audit.complete(line, _report_of(nodes), verdict="accepted", config_sha256=None)
    raw = audit.path.read_bytes()
    assert len(raw) == line.length and raw.count(b"\n") == 1
    assert [len(entry["nodes"]) for entry in await audit_lines(audit)] == [nodes]
