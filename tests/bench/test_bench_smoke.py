"""The benchmark harness works end to end: each part in a tiny run, on real processes.

No timing is asserted (a shared CI machine makes any number noise); what is asserted is
that every part starts its processes, drives its targets without a single failed
request, measures each process's CPU apart, skips a peer that is not installed with a
note, and prints its tables; and that the report's pure parts (targets, derived
numbers, the stamped paced stream and the callers' HTTP reader) do what they say.
"""

from __future__ import annotations

import io
import itertools
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from rich.console import Console

from bench.agent_cache import AgentCacheShape
from bench.fleet import FleetMeasurement, FleetShape, _Connection, _request, _StreamReader, _Tally
from bench.load import Budget, Measurement, Scenario, combined, percentile
from bench.loop_holds import LoopHolds, read_holds
from bench.many_nodes import (
    CHURN_SHARE,
    ManyNodesMeasurement,
    ManyNodesShape,
    churn_nodes,
    fleet_config,
    node_credentials,
)
from bench.report import render, to_json
from bench.result import (
    ALL_TARGETS,
    DIRECT,
    EDGE_HTTP,
    HYPERCORN,
    IOP,
    IOP_TRANSLATED,
    LITELLM,
    STACK_FLOOR,
    VLLM_ROUTER,
    BenchResult,
    Machine,
    cpu_ratio_by_turn,
)
from bench.run import (
    AGENT_CACHE,
    CLOSED,
    FLEET,
    NODES,
    BenchOptions,
    build_parser,
    options_from,
    run_bench,
)
from bench.targets import check_targets
from bench.upstream import STAMP_PATTERN, STREAM_CHUNKS, BenchUpstream, stream_events
from iop_edge.core.configuration.config import parse_config
from iop_edge.runtime.lifecycle.heap import BURST

#: Startup of a few Python processes plus a handful of requests, on a slow CI machine.
SMOKE_GUARD_S = 120


def _text(result: BenchResult) -> str:
    console = Console(file=io.StringIO(), width=220, color_system=None)
    console.print(render(result))
    output = console.file
    assert isinstance(output, io.StringIO)
    return output.getvalue()


@pytest.fixture
def no_peers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither peer installed, whatever this machine has."""
    monkeypatch.setenv("IOP_BENCH_LITELLM", str(tmp_path / "no-litellm-here"))
    monkeypatch.setenv("IOP_BENCH_VLLM_ROUTER", str(tmp_path / "no-vllm-router-here"))


# --- the three parts, each in a tiny run ---------------------------------------------------------


@pytest.mark.usefixtures("no_peers")
async def test_closed_loop_measures_every_scenario_and_each_process(tmp_path: Path) -> None:
    options = BenchOptions(
        parts=(CLOSED,),
        budget=Budget(requests=4, warmup_requests=2, turns=2),
        concurrency=(1, 2),
        protocols=("chat",),
        only=ALL_TARGETS,
    )
    lines: list[str] = []
    with trio.fail_after(SMOKE_GUARD_S):
        result = await run_bench(options, tmp_path, lines.append)

    scenarios = [Scenario(c, stream) for c in (1, 2) for stream in (False, True)]
    assert result.scenarios() == scenarios
    assert not any(m.target == IOP_TRANSLATED for m in result.measurements)  # no chat there
    for scenario in scenarios:
        for target in (DIRECT, HYPERCORN, EDGE_HTTP, STACK_FLOOR, IOP):
            measured = result.get(target, scenario)
            assert measured is not None, (target, scenario)
            assert (measured.ok, measured.errors) == (4, 0), measured.first_error
        assert result.get(LITELLM, scenario) is None
        assert result.get(VLLM_ROUTER, scenario) is None
        iop = result.get(IOP, scenario)
        assert iop is not None and iop.process_cpu_s is not None
        assert set(iop.process_cpu_s) == {"edge", "node"}
        assert (iop.process_cpu_us_per_chunk("edge") is None) == (not scenario.stream)
        floor = result.get(STACK_FLOOR, scenario)
        assert floor is not None and floor.process_cpu_s is not None
        assert set(floor.process_cpu_s) == {"front", "back"}
    assert any(note.startswith("litellm: not installed, skipped") for note in result.notes)
    assert any(note.startswith("vllm-router: not installed, skipped") for note in result.notes)
    assert any(line.startswith("iop: http://127.0.0.1:") for line in lines)
    turns = [line.split()[1] for line in lines if line.startswith("turn ")]
    assert turns == ["1/2"] * 20 + ["2/2"] * 20  # 4 scenarios x 5 targets, then again
    assert result.fleet == () and result.many_nodes is None

    text = _text(result)
    for label in ("c=1 non-stream", "c=1 stream", "c=2 non-stream", "c=2 stream"):
        assert label in text
    rows = re.findall(r"│ (direct|Hypercorn|Stack floor|IOP) +│ +(\d+) │ +(\d+) │", text)
    expected = [("direct", "4", "0"), ("Hypercorn", "4", "0"), ("Stack floor", "4", "0")]
    expected.append(("IOP", "4", "0"))  # (target, ok, err)
    assert sorted(rows) == sorted(expected * 4)
    assert "CPU by process" in text
    for process in ("upstream", "hypercorn", "front", "back", "edge", "node", "edge+node"):
        assert re.search(rf"│ {re.escape(process)} +│", text), process
    assert "vllm-router: not installed, skipped" in text
    assert "Performance targets" in text
    assert "machine: " in text

    document = json.loads(to_json(result))
    assert len(document["measurements"]) == 20  # 4 scenarios x (direct, the 3 floors, IOP)
    iop_rows = [row for row in document["measurements"] if row["target"] == IOP]
    assert all(set(row["processes"]) == {"edge", "node"} for row in iop_rows)


@pytest.mark.usefixtures("no_peers")
async def test_messages_and_responses_natively_and_translated(tmp_path: Path) -> None:
    options = BenchOptions(
        parts=(CLOSED,),
        budget=Budget(requests=3, warmup_requests=1, turns=1),
        concurrency=(1,),
        protocols=("chat", "messages", "responses"),
        only=(DIRECT, IOP, IOP_TRANSLATED, LITELLM),
    )
    with trio.fail_after(SMOKE_GUARD_S):
        result = await run_bench(options, tmp_path, lambda _: None)

    for protocol in ("messages", "responses"):
        for stream in (False, True):
            scenario = Scenario(1, stream, protocol)
            for target in (DIRECT, IOP, IOP_TRANSLATED):
                measured = result.get(target, scenario)
                assert measured is not None, (target, scenario)
                assert (measured.ok, measured.errors) == (3, 0), measured.first_error
            translated = result.get(IOP_TRANSLATED, scenario)
            assert translated is not None and translated.process_cpu_s is not None
            assert set(translated.process_cpu_s) == {"edge", "node"}
    assert result.get(IOP_TRANSLATED, Scenario(1, False)) is None
    assert result.get(IOP, Scenario(1, True)) is not None  # the chat path, to compare with

    text = _text(result)
    assert "Caller protocols: Anthropic Messages and OpenAI Responses" in text
    assert "c=1 stream messages" in text and "c=1 non-stream responses" in text
    assert re.search(r"│ IOP transl\. +│ +3 │ +0 │", text)
    goals = {check.goal: check for check in check_targets(result)}
    translated_goal = goals["Responses translated: CPU per request <= 1/5 of LiteLLM's, stream"]
    assert translated_goal.measured == "not measured (iop-translated, litellm)"
    rows = json.loads(to_json(result))["measurements"]
    assert {row["protocol"] for row in rows} == {"chat", "messages", "responses"}


async def test_the_agent_cache_part_shows_what_the_attribution_block_costs(
    tmp_path: Path,
) -> None:
    shape = AgentCacheShape(
        turns=3, prefill_us=20.0, cached_us=0.5, instructions_chars=4000, tools=2
    )
    with trio.fail_after(SMOKE_GUARD_S):
        result = await run_bench(
            BenchOptions(parts=(AGENT_CACHE,), agent_cache=shape), tmp_path, lambda _: None
        )

    m = result.agent_cache
    assert m is not None, result.notes
    assert len(m.stripped) == len(m.as_sent) == 3
    # The same conversation both times, the kept block adding its few tokens.
    for stripped, as_sent in zip(m.stripped, m.as_sent, strict=True):
        assert 0 < as_sent.prompt_tokens - stripped.prompt_tokens < 40
    assert m.stripped[0].cached_tokens < 5  # a cold cache
    # Removed: each turn reuses the whole prompt of the turn before. Kept: nothing past
    # the block's first values.
    for before, turn in itertools.pairwise(m.stripped):
        assert abs(turn.cached_tokens - before.prompt_tokens) <= 1
    assert all(turn.cached_tokens < 20 for turn in m.as_sent)
    text = _text(result)
    assert "Agent prefix cache: a Claude-Code-shaped conversation" in text
    document = json.loads(to_json(result))["agent_cache"]
    assert [len(document[name]) for name in ("removed", "kept")] == [3, 3]


@pytest.mark.usefixtures("no_peers")
async def test_fleet_streams_measure_delay_cost_and_memory_per_target(tmp_path: Path) -> None:
    shape = FleetShape(streams=4, tokens_per_second=50.0, tokens=4, window_s=1.0)
    options = BenchOptions(parts=(FLEET,), fleet_only=(DIRECT, IOP, VLLM_ROUTER), fleet=shape)
    lines: list[str] = []
    with trio.fail_after(SMOKE_GUARD_S):
        result = await run_bench(options, tmp_path, lines.append)

    assert [m.target for m in result.fleet] == [DIRECT, IOP]
    for m in result.fleet:
        assert m.errors == 0, m.first_error
        assert m.chunks > 0 and m.delays_s and m.gaps_s
        assert m.process_cpu_s is not None and m.rss_idle and m.rss_loaded
        assert m.process_wait_s is not None and m.caller_cpu_s is not None
    iop = result.fleet_of(IOP)
    assert iop is not None and iop.process_cpu_s is not None
    assert set(iop.process_cpu_s) == {"edge", "node"}
    assert iop.rss_kb_per_stream("edge") is not None
    assert any(note.startswith("vllm-router: not installed, skipped") for note in result.notes)
    assert result.measurements == () and result.many_nodes is None

    text = _text(result)
    assert "Fleet-shaped streams: 4 streams x 50 tok/s" in text
    assert "cost by process" in text
    assert re.search(r"│ IOP +│ edge +│", text)
    document = json.loads(to_json(result))
    assert [row["target"] for row in document["fleet"]] == [DIRECT, IOP]


async def test_many_nodes_connect_and_every_node_applies_the_refresh(tmp_path: Path) -> None:
    shape = ManyNodesShape(
        nodes=12,
        providers_per_node=2,
        models=3,
        idle_window_s=0.2,
        catalog_requests=3,
        node_processes=2,
        caller_rate=20.0,
        caller_window_s=0.5,
    )
    lines: list[str] = []
    options = BenchOptions(parts=(NODES,), nodes=shape)
    with trio.fail_after(SMOKE_GUARD_S):
        result = await run_bench(options, tmp_path, lines.append)

    m = result.many_nodes
    assert m is not None, result.notes
    assert m.refresh_status == 200, m.refresh_problem
    assert (m.refresh_nodes, m.refresh_applied, m.refresh_problem) == (12, 12, None)
    assert m.refresh_s is not None and m.dry_run_s is not None
    assert len(m.catalog_s) == 3 and m.catalog_bytes > 0
    assert len(m.catalog_filtered_s) == 3
    assert None not in (m.rss_empty, m.rss_connected, m.rss_after_refresh, m.idle_cpu_s)
    # Callers got their answers from the sim Node while idle and during the refresh.
    assert m.caller_errors == 0 and m.caller_idle_s and m.caller_refresh_s
    assert m.caller_p99_ratio is not None
    # Too few Nodes for a churn: the fleet's holds are still recorded.
    assert (m.churned, m.holds_churn, m.rss_churn) == (0, None, ()) and m.holds_fleet is not None

    text = _text(result)
    assert "Many Nodes on one Edge: 12 light Nodes x 2 providers" in text
    assert "(12/12 applied)" in text
    verdicts = {c.goal: c.verdict for c in check_targets(result) if c.goal.startswith("1000")}
    assert set(verdicts.values()) == {"n/a"}  # measured at 12 Nodes, not the goal's 1,000


# --- the pure parts -------------------------------------------------------------------------------


def _measurement(
    target: str, scenario: Scenario, latency_ms: float, rps: float, cpu_ms: float = 0.0
) -> Measurement:
    count = 100
    return Measurement(
        target=target,
        scenario=scenario,
        latencies_s=(latency_ms / 1000,) * count,
        errors=0,
        wall_s=count / rps,
        process_cpu_s={"all": cpu_ms * count / 1000},
    )


def _fleet(target: str, delay_ms: float, cpu_s: dict[str, float]) -> FleetMeasurement:
    return FleetMeasurement(
        target=target,
        shape=FleetShape(),
        window_s=1.0,
        chunks=1000,
        streams_done=10,
        errors=0,
        delays_s=(delay_ms / 1000,) * 10,
        gaps_s=(0.1,) * 10,
        process_cpu_s=cpu_s,
        rss_idle={name: 10 * 2**20 for name in cpu_s},
        rss_loaded={name: 10 * 2**20 + 100 * 1024 * 100 for name in cpu_s},
    )


def test_targets_are_judged_from_the_measured_numbers() -> None:
    c1, c1s = Scenario(1, False), Scenario(1, True)
    c32, c32s = Scenario(32, False), Scenario(32, True)
    result = BenchResult(
        machine=Machine.this(),
        measurements=(
            _measurement(DIRECT, c1, 1.0, 1000),
            _measurement(HYPERCORN, c1, 1.5, 800),  # floor +0.5 ms
            _measurement(IOP, c1, 2.0, 500, cpu_ms=1.0),  # +1 ms = 2x the floor: within 3x
            _measurement(LITELLM, c1, 20.0, 50, cpu_ms=10.0),  # IOP at 1/10: within 1/8
            _measurement(STACK_FLOOR, c1, 1.75, 600, cpu_ms=0.8),  # 1/12.5 of LiteLLM; 1.5x
            _measurement(DIRECT, c1s, 1.0, 1000),
            _measurement(HYPERCORN, c1s, 2.0, 500),  # floor +1 ms
            _measurement(IOP, c1s, 4.0, 200),  # +3 ms = 3x the floor: over 2x
            _measurement(IOP, c32, 10.0, 1000),
            _measurement(LITELLM, c32, 10.0, 100),  # 10x: over 8x
            _measurement(IOP, c32s, 10.0, 1000, cpu_ms=2.2),
            _measurement(STACK_FLOOR, c32s, 10.0, 1000, cpu_ms=2.0),  # IOP at 1.1x
        ),
        fleet=(
            _fleet(DIRECT, 1.0, {"upstream": 0.05}),
            _fleet(IOP, 4.0, {"edge": 0.2, "node": 0.2}),  # +3 ms; 200 us/chunk
            _fleet(VLLM_ROUTER, 1.5, {"router": 0.05}),  # 50 us/chunk: the Edge at 4x
        ),
    )
    verdicts = {check.goal: (check.measured, check.verdict) for check in check_targets(result)}
    assert verdicts["fleet: Edge CPU per relayed chunk <= 3x vllm-router's"] == (
        "200 vs 50 us = 4.0x",
        "MISS",
    )
    assert verdicts["fleet: IOP adds <= 5 ms token delay p99 at 100 x 10 tok/s"] == (
        "+3.00 ms",
        "PASS",
    )
    assert verdicts["CPU per request, Edge + Node <= 1/8 of LiteLLM's, non-stream, c=1"] == (
        "1/10.0 (stack floor 1/12.5)",
        "PASS",
    )
    # IOP's 1.0 ms over the stack floor's 0.8 ms: 1.25x
    assert verdicts["CPU per request, Edge + Node <= 1.15x the stack floor's, non-stream, c=1"] == (
        "1.25x",
        "MISS",
    )
    assert verdicts[
        "CPU per request, Edge + Node <= 1.15x the stack floor's, non-stream, c=32"
    ] == ("not measured (stack-floor)", "n/a")
    assert verdicts[
        "CPU per request, Edge + Node <= 1.15x the stack floor's, 22-chunk stream, c=32"
    ] == ("1.10x", "PASS")
    assert verdicts["throughput >= 8x LiteLLM's at c=32, non-stream"] == ("10.00x", "PASS")
    assert verdicts["throughput >= 15x LiteLLM's at c=32, stream"] == (
        "not measured (litellm)",
        "n/a",
    )
    assert verdicts["c=1 added p50 <= 3x the Hypercorn floor's, non-stream"] == (
        "+1.00 vs +0.50 ms = 2.0x (stack floor 1.5x)",
        "PASS",
    )
    assert verdicts["c=1 added p50 <= 2x the Hypercorn floor's, 22-chunk stream"] == (
        "+3.00 vs +1.00 ms = 3.0x",
        "MISS",
    )
    nodes = [verdict for goal, (_, verdict) in verdicts.items() if goal.startswith("1000 Nodes")]
    assert nodes == ["n/a"] * 4  # not run


def test_many_nodes_budgets_are_judged_at_1000_nodes_only() -> None:
    def measured(nodes: int, refresh_s: float) -> ManyNodesMeasurement:
        return ManyNodesMeasurement(
            shape=ManyNodesShape(nodes=nodes),
            connect_s=5.0,
            rss_empty=50 * 2**20,
            rss_connected=120 * 2**20,
            rss_after_refresh=150 * 2**20,
            idle_cpu_s=0.2,
            idle_window_s=10.0,  # 2% of a core
            catalog_s=(0.03, 0.05, 0.2),  # the slowest over 100 ms
            catalog_bytes=1000,
            dry_run_s=1.0,
            refresh_s=refresh_s,
            refresh_status=200,
            refresh_nodes=nodes,
            refresh_applied=nodes,
        )

    at_scale = BenchResult(machine=Machine.this(), many_nodes=measured(1000, 4.0))
    verdicts = [c.verdict for c in check_targets(at_scale) if c.goal.startswith("1000 Nodes")]
    assert verdicts == ["PASS", "PASS", "MISS", "PASS"]
    smaller = BenchResult(machine=Machine.this(), many_nodes=measured(10, 4.0))
    verdicts = [c.verdict for c in check_targets(smaller) if c.goal.startswith("1000 Nodes")]
    assert verdicts == ["n/a"] * 4


def test_fleet_budgets_are_judged_at_the_run_scale_and_a_node_left_behind_misses() -> None:
    def measured(applied: int) -> ManyNodesMeasurement:
        return ManyNodesMeasurement(
            shape=ManyNodesShape(nodes=5000),
            connect_s=60.0,
            rss_empty=100 * 2**20,
            rss_connected=400 * 2**20,
            rss_after_refresh=500 * 2**20,
            idle_cpu_s=0.5,
            idle_window_s=10.0,  # 5% of a core
            catalog_s=(0.3, 0.5),
            catalog_bytes=5_000_000,
            dry_run_s=2.5,  # every Node changed: reported beside the few Nodes' dry run
            dry_run_few_s=0.4,
            refresh_s=9.0,
            refresh_status=200,
            refresh_nodes=5000,
            refresh_applied=applied,
            catalog_filtered_s=(0.01, 0.08),  # the slowest over 50 ms
            caller_idle_s=(0.05,) * 99 + (0.06,),
            caller_refresh_s=(0.05,) * 99 + (0.07,),  # the slowest of 100 is past the p99
            caller_dry_run_s=(0.05,) * 9 + (0.055,),
            caller_apply_s=(0.05,) * 89 + (0.07,),
            # a step of 90 ms on a busy machine, 30 ms of it the Edge's own CPU
            holds_fleet=LoopHolds(
                longest_s=0.09,
                longest_cpu_s=0.03,
                over_bound=1,
                over_bound_cpu=0,
                full_collections=0,
                longest_collection_s=0.004,
            ),
            churned=550,
            rss_before_churn=500 * 2**20,
            rss_churn=(510 * 2**20, 505 * 2**20, 530 * 2**20),  # 6% more at the end
        )

    checks = {
        c.goal.split(": ", 1)[1]: (c.measured, c.verdict)
        for c in check_targets(BenchResult(machine=Machine.this(), many_nodes=measured(5000)))
        if c.goal.startswith("fleet (5,000 Nodes")
    }
    assert [verdict for _, verdict in checks.values()] == [
        "PASS", "PASS", "PASS", "PASS", "MISS", "PASS", "PASS", "PASS", "MISS"
    ]  # fmt: skip
    assert checks["Edge RSS after the churn <= 1.05x before it"][0] == (
        "500 MB -> 510 -> 505 -> 530 MB (550 Nodes left and came back, 2 times)"
    )
    assert checks["refresh dry run of a few Nodes' change <= 2 s"] == (
        "0.40 s (10 Nodes; every Node 2.5 s)",
        "PASS",
    )
    assert checks["refresh apply <= 15 s until every Node acked, none left behind"] == (
        "9.0 s, 5000/5000 applied",
        "PASS",
    )
    assert checks["callers' p99 during the refresh <= 1.2x idle"] == (
        "50 vs 50 ms = 1.00x (dry runs 55, apply 52 ms; light Nodes at niceness 10)",
        "PASS",
    )
    guard = "Edge loop held <= 50 ms a step (CPU), fleet connected: idle, refresh, churn"
    assert checks[guard][1] == "PASS"  # judged on the Edge's CPU, not the machine's wall
    assert "longest step 90 ms (30 ms CPU), 1 step(s) >= 50 ms (0 by CPU)" in checks[guard][0]
    behind = check_targets(BenchResult(machine=Machine.this(), many_nodes=measured(4999)))
    [apply] = [c for c in behind if "refresh apply" in c.goal and c.goal.startswith("fleet")]
    assert apply.verdict == "MISS"


def test_loop_holds_are_read_back_per_window(tmp_path: Path) -> None:
    """`bench.loop_holds` writes the Edge's long steps and collections as JSON lines; a
    window's summary counts only what ended inside it."""
    path = tmp_path / "holds.jsonl"
    lines = [
        {"at": 1.0, "step_s": 0.2, "cpu_s": 0.15, "task": "start"},  # before the window
        {"at": 5.0, "step_s": 0.08, "cpu_s": 0.01, "task": "preempted"},
        {"at": 6.0, "step_s": 0.06, "cpu_s": 0.055, "task": "busy"},
        {"at": 6.5, "gc": 2, "s": 0.04, "cpu_s": 0.03, "loop": True},
        {"at": 7.0, "gc": 0, "s": 0.5, "cpu_s": 0.5, "loop": False},  # another thread
        # the loop's busy share, a window at a time
        {"at": 3.5, "window_s": 0.5, "busy_s": 0.5, "cpu_s": 0.5, "steps": 10},  # before
        {"at": 5.5, "window_s": 0.5, "busy_s": 0.4, "cpu_s": 0.3, "steps": 900},
        {"at": 6.0, "window_s": 0.5, "busy_s": 0.2, "cpu_s": 0.2, "steps": 700},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))

    holds = read_holds(str(path), 4.0, 8.0)

    assert holds == LoopHolds(
        longest_s=0.08,
        longest_cpu_s=0.055,
        over_bound=2,
        over_bound_cpu=1,
        full_collections=1,
        longest_collection_s=0.04,
        longest_task="preempted",
        longest_collection_cpu_s=0.03,
        busy_share=pytest.approx(0.6),
        cpu_share=pytest.approx(0.5),
    )
    assert "loop busy 60% (50% CPU)" in str(holds)
    nothing = read_holds(str(tmp_path / "none.jsonl"))
    assert nothing.longest_s == 0.0 and nothing.busy_share is None  # no file: nothing held


def test_fleet_numbers_are_derived_per_process() -> None:
    m = _fleet(IOP, 4.0, {"edge": 0.3, "node": 0.1})
    assert m.cpu_us_per_chunk("edge") == pytest.approx(300.0)
    assert m.cpu_us_per_chunk() == pytest.approx(400.0)
    assert m.chunks_per_core_s("edge") == pytest.approx(1e6 / 300)
    assert m.cpu_us_per_chunk("router") is None
    assert m.rss_kb_per_stream("edge") == pytest.approx(100 * 100 / FleetShape().streams)
    assert m.delay_ms(99.0) == pytest.approx(4.0)


def test_percentile_interpolates_between_ranks() -> None:
    values = (1.0, 2.0, 3.0, 4.0)
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile((7.0,), 99) == 7.0


def test_the_upstream_stream_has_the_documented_shape() -> None:
    plain = stream_events(include_usage=False)
    assert len(plain) == STREAM_CHUNKS == 22
    assert b'"finish_reason":"stop"' in plain[-1]
    with_usage = stream_events(include_usage=True)
    assert with_usage[:-1] == plain
    assert b'"usage"' in with_usage[-1]
    stamped = stream_events(include_usage=False, tokens=3, stamped=True)
    assert len(stamped) == 4
    assert all(b"STAMP-SLOT" in event for event in stamped[:3])


async def test_a_paced_stream_arrives_whole_with_a_stamp_per_token() -> None:
    upstream = BenchUpstream(stream_tokens=5, tokens_per_second=200.0)
    async with trio.open_nursery() as nursery:
        root = await nursery.start(upstream.serve)
        host, port, request = _request(root)
        connection = _Connection(host, port, request)
        for _ in range(2):  # the second stream reuses the keep-alive connection
            tally = _Tally(expected_tokens=5, window_start_ns=0)
            reader = _StreamReader(tally)
            await connection.exchange(reader)
            assert (reader.tokens, reader.done) == (5, True)
            assert tally.chunks == 6  # five tokens and the finish-reason chunk
            assert len(tally.delays_ns) == len(tally.gaps_ns) == 4  # the first token aside
            assert all(delay >= 0 for delay in tally.delays_ns)
        await connection.aclose()
        nursery.cancel_scope.cancel()


async def test_a_connection_the_target_closed_while_idle_is_replaced_once() -> None:
    """The target closes every connection after one answer; each stream still arrives."""
    events = stream_events(include_usage=False, tokens=2, stamped=True)
    body = b"".join(
        b"%x\r\n%s\r\n" % (len(sse), sse)
        for sse in [b"data: " + e.replace(b"STAMP-SLOT", b"1") + b"\n\n" for e in events]
        + [b"data: [DONE]\n\n"]
    )
    answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"
    connections = 0

    async def answer_once_then_close(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        received = b""
        while b"\r\n\r\n" not in received or not received.endswith(b"}"):
            received += await stream.receive_some(65536)
        await stream.send_all(answer)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, answer_once_then_close, 0)
        port = listeners[0].socket.getsockname()[1]
        host, port, request = _request(f"http://127.0.0.1:{port}")
        connection = _Connection(host, port, request)
        for _ in range(3):
            reader = _StreamReader(None)
            await connection.exchange(reader)
            assert (reader.tokens, reader.done) == (2, True)
        assert connections == 3
        await connection.aclose()
        nursery.cancel_scope.cancel()


def test_the_stream_reader_finds_events_split_across_reads() -> None:
    tally = _Tally(expected_tokens=2, window_start_ns=0)
    reader = _StreamReader(tally)
    body = b"".join(
        b"data: " + event + b"\n\n"
        for event in stream_events(include_usage=False, tokens=2, stamped=True)
    ).replace(b"STAMP-SLOT", b"100")
    body += b"data: [DONE]\n\n"
    for index in range(0, len(body), 7):  # seven bytes at a time
        reader(body[index : index + 7], 1000 + index)
    assert (reader.tokens, reader.done, tally.chunks) == (2, True, 3)
    assert len(tally.delays_ns) == 1 and tally.delays_ns[0] > 0
    assert STAMP_PATTERN.search(b'"content":"tok@123 "') is not None


def test_the_many_nodes_config_is_a_valid_edge_config() -> None:
    shape = ManyNodesShape(nodes=5, providers_per_node=3, models=4)
    credentials = node_credentials(shape.nodes)
    parsed = parse_config(fleet_config(shape, credentials, Path("/tmp/state"), capacity=2))
    config = parsed.config
    assert [node.id for node in config.nodes] == list(credentials)
    assert sum(len(node.providers) for node in config.nodes) == shape.providers
    served = {provider for model in config.models for provider in model.providers}
    assert len(served) == shape.providers  # every provider serves a model
    assert all(token not in parsed.text for token in credentials.values())


def test_command_line_parts_targets_and_shapes() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["--only", "iop,direct", "--concurrency", "4,1", "--parts", "nodes,closed"]
    )
    assert args.only == (DIRECT, IOP)
    assert args.concurrency == (4, 1)
    assert args.parts == (CLOSED, NODES)
    options = options_from(
        parser.parse_args(["--streams", "7", "--tokens-per-second", "3", "--nodes", "9"]), parser
    )
    assert (options.fleet.streams, options.fleet.tokens_per_second) == (7, 3.0)
    assert options.nodes.nodes == 9
    assert options.budget.turns == 4  # the default: targets interleaved
    assert options_from(parser.parse_args(["--turns", "1"]), parser).budget.turns == 1
    for bad in (
        ["--only", "nginx"],
        ["--concurrency", "0"],
        ["--concurrency", "x"],
        ["--parts", "warp"],
        ["--fleet-only", "hypercorn"],
        ["--replicas", "--tokens"],  # one other measurement at a time
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    with pytest.raises(SystemExit):
        options_from(parser.parse_args(["--streams", "0"]), parser)
    for bad_turns in (["--turns", "0"], ["--requests", "3", "--turns", "4"]):
        with pytest.raises(SystemExit):
            options_from(parser.parse_args(bad_turns), parser)


def test_turns_share_the_budget_and_combine_into_one_measurement() -> None:
    assert Budget(duration_s=4, turns=2).per_turn() == Budget(duration_s=2)
    assert Budget(requests=5, turns=2, warmup_requests=3).per_turn() == Budget(
        requests=3, duration_s=2, warmup_requests=3
    )
    scenario = Scenario(1, False)
    turns = [
        Measurement("iop", scenario, (0.003, 0.001), 0, 1.0, None, {"edge": 0.5, "node": 0.25}),
        Measurement("iop", scenario, (0.002,), 1, 2.0, "boom", {"edge": 0.25, "node": 0.5}),
    ]
    whole = combined(turns)
    assert whole.latencies_s == (0.001, 0.002, 0.003)
    assert (whole.errors, whole.wall_s, whole.first_error) == (1, 3.0, "boom")
    assert whole.process_cpu_s == {"edge": 0.75, "node": 0.75}
    assert whole.turn_cpu_ms == (375.0, 375.0)  # 0.75 s over 2 requests each (one failed)
    unknown = combined([turns[0], replace(turns[1], process_cpu_s=None)])
    assert (unknown.process_cpu_s, unknown.turn_cpu_ms) == (None, ())


def test_the_stack_floor_goal_is_judged_on_the_median_of_the_turns() -> None:
    """Each turn's IOP over the same turn's floor; one turn where the machine weighed on
    IOP alone moves the range, not the verdict (the ratio of the sums would miss)."""
    c1 = Scenario(1, False)
    goal = "CPU per request, Edge + Node <= 1.15x the stack floor's, non-stream, c=1"

    def measured(target: str, costs: tuple[float, ...]) -> Measurement:
        one = _measurement(target, c1, 1.0, 1000, cpu_ms=sum(costs) / len(costs))
        return replace(one, turn_cpu_ms=costs)

    result = BenchResult(
        machine=Machine.this(),
        measurements=(
            measured(STACK_FLOOR, (1.0, 1.0, 1.0, 1.0)),
            measured(IOP, (1.1, 1.05, 2.0, 1.12)),  # 1.32x of the sums
        ),
    )
    verdicts = {check.goal: (check.measured, check.verdict) for check in check_targets(result)}
    assert verdicts[goal] == ("1.11x (median of 4 turns, 1.05-2.00)", "PASS")
    by_turn = cpu_ratio_by_turn(result, IOP, STACK_FLOOR, c1)
    assert by_turn is not None
    assert (by_turn.median, by_turn.low, by_turn.high) == pytest.approx((1.11, 1.05, 2.0))
    assert by_turn.turns == 4
    uneven = replace(result, measurements=(result.measurements[0], measured(IOP, (1.1,))))
    assert cpu_ratio_by_turn(uneven, IOP, STACK_FLOOR, c1) is None


@pytest.mark.parametrize("nodes", [128, 1000, 5000, 10_000])
def test_a_churn_round_is_more_than_a_tenth_of_the_fleet_and_at_least_a_burst(nodes: int) -> None:
    churn = churn_nodes(nodes)
    assert 0 < churn <= nodes // 2
    assert churn >= max(BURST, CHURN_SHARE * nodes) and churn > nodes // 10


def test_a_fleet_too_small_for_a_churn_has_none() -> None:
    assert churn_nodes(12) == churn_nodes(2 * BURST - 1) == 0
