"""The bench's report: the machine, one table per measured part, and the performance targets.

Everything here is pure: `render` turns a `BenchResult` into rich renderables and
`to_json` into a document for tooling. What the columns mean:

Closed-loop table. `CPU ms/req` is the CPU time the target's own processes spent per
request (the upstream for `direct`, the Edge plus the Node for IOP, the proxy or the
router for a peer): on a machine whose cores are all busy it is what bounds throughput.
The `Hypercorn` and `Edge HTTP` rows are the floors (`bench.asgi_floor`): stock Hypercorn,
and the Edge's own HTTP server (Hypercorn with the Edge's connection handler), answering
by themselves; the second is the floor under IOP's numbers, the first the one the
c=1 latency goals name. `+p50` is the median latency a target adds over calling
the upstream directly (for a stream, time to the last byte); `vs direct` is its
throughput as a share of the direct one; `IOP/LiteLLM` is IOP's throughput over
LiteLLM's.

CPU by process. The same CPU time split by process (IOP's Edge and Node apart), per
request and, for streams, per relayed chunk (22 per stream).

Caller protocols. The Anthropic Messages and OpenAI Responses scenarios: the upstream
answering them itself (`direct`), IOP relaying them to it natively (`IOP`) and
translating them to chat on the Node (`IOP transl.`), LiteLLM's `/v1/messages` and
`/v1/responses`. `vs IOP chat` is a row's CPU per request over IOP's on the chat
scenario of the same load; `of LiteLLM` its CPU per request as a share of LiteLLM's.

Agent prefix cache (`bench.agent_cache`). Each turn of a Claude-Code-shaped
conversation through IOP to an upstream with a prompt prefix cache, with Claude Code's
attribution block removed (the default) and kept: the time to the whole answer, the
prompt's tokens and the share of them the upstream read from its cache.

Fleet-shaped streams (`bench.fleet` says how they are measured). `token delay` is a
token's arrival at the caller minus the moment the upstream sent it; `+p50`/`+p99` are a
target's percentiles minus the direct ones; `gap` is the time between two tokens of one
stream at the caller. Per process: `CPU us/chunk` over the chunks relayed in the window,
`chunks/s per core` its inverse, the share of the window it was runnable but waited
for a core (other work on the machine), resident memory idle (after a warm-up) and at
its highest under load, and the difference per open stream.

Many Nodes (`bench.many_nodes`). The Edge's memory before any Node and with all of them
connected, its CPU while idle, `/catalog` latency, and the time to validate (dry run)
and to apply a refresh that changes every Node's providers, until every Node acked.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from bench.agent_cache import AgentCacheMeasurement
from bench.fleet import FleetMeasurement
from bench.load import Measurement, Scenario
from bench.many_nodes import FEW_NODES
from bench.result import (
    DIRECT,
    IOP,
    IOP_TRANSLATED,
    LITELLM,
    PROCESSES,
    TARGET_LABELS,
    BenchResult,
    added_gap_ms,
    added_p50_ms,
    added_token_delay_ms,
    cpu_ratio,
    throughput_ratio,
)
from bench.targets import TargetCheck, check_targets

_MB = 2**20


def _num(value: float | None, digits: int = 2, *, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _label(target: str) -> str:
    return TARGET_LABELS.get(target, target)


def _chat_scenarios(result: BenchResult) -> list[Scenario]:
    return [s for s in result.scenarios() if s.protocol == "chat"]


def _scenario_table(title: str, columns: Sequence[str], caption: str | None = None) -> Table:
    """A table of closed-loop measurements: a row per target within each scenario, the
    first five columns `_outcome_cells`, then `columns` (numbers, right-aligned)."""
    table = Table(title=title, caption=caption)
    table.add_column("scenario")
    table.add_column("target")
    for name in ("ok", "err", "p50 ms", *columns):
        table.add_column(name, justify="right")
    return table


def _outcome_cells(scenario: Scenario, row: int, m: Measurement) -> list[RenderableType]:
    """What every closed-loop row starts with: the scenario (on its first row only), the
    target, requests answered and failed (red when any failed), median latency."""
    return [
        scenario.label if row == 0 else "",
        _label(m.target),
        str(m.ok),
        Text(str(m.errors), style="red" if m.errors else ""),
        _num(m.p50_ms),
    ]


def _rps(m: Measurement) -> str:
    return "-" if m.rps is None else f"{m.rps:.0f}"


def measurements_table(result: BenchResult) -> Table:
    table = _scenario_table(
        "Gateway overhead: closed-loop load, fake upstream with no delay",
        ("p99 ms", "req/s", "CPU ms/req", "+p50 ms", "vs direct", "IOP/LiteLLM"),
    )
    scenarios = _chat_scenarios(result)
    for index, scenario in enumerate(scenarios):
        rows = [m for m in result.measurements if m.scenario == scenario]
        for row, m in enumerate(rows):
            baseline = m.target == DIRECT
            table.add_row(
                *_outcome_cells(scenario, row, m),
                _num(m.p99_ms),
                _rps(m),
                _num(m.cpu_ms_per_request),
                "" if baseline else _num(added_p50_ms(result, m.target, scenario), signed=True),
                "" if baseline else _ratio(throughput_ratio(result, m.target, DIRECT, scenario)),
                _ratio(throughput_ratio(result, IOP, LITELLM, scenario)) if m.target == IOP else "",
                end_section=row == len(rows) - 1 and index < len(scenarios) - 1,
            )
    return table


def _process_rows(target: str) -> list[tuple[str, str | None]]:
    """(label, process) rows of a target; a target of several processes gets a total."""
    processes = PROCESSES.get(target, ())
    rows: list[tuple[str, str | None]] = [(name, name) for name in processes]
    if len(processes) > 1:
        rows.append(("+".join(processes), None))
    return rows


def cpu_by_process_table(result: BenchResult) -> Table:
    table = Table(title="CPU by process: ms per request; us per relayed chunk for streams")
    table.add_column("target")
    table.add_column("process")
    scenarios = _chat_scenarios(result)
    for scenario in scenarios:
        table.add_column(f"{scenario.label}\nms/req", justify="right")
        if scenario.stream:
            table.add_column(f"{scenario.label}\nus/chunk", justify="right")
    targets = list(dict.fromkeys(m.target for m in result.measurements if m.scenario in scenarios))
    for index, target in enumerate(targets):
        rows = _process_rows(target)
        for row, (label, process) in enumerate(rows):
            cells: list[str] = []
            for scenario in scenarios:
                m: Measurement | None = result.get(target, scenario)
                cells.append(_num(m.process_cpu_ms_per_request(process) if m else None))
                if scenario.stream:
                    per_chunk = m.process_cpu_us_per_chunk(process) if m else None
                    cells.append(_num(per_chunk, 0))
            table.add_row(
                _label(target) if row == 0 else "",
                label,
                *cells,
                end_section=row == len(rows) - 1 and index < len(targets) - 1,
            )
    return table


def _share(value: float | None) -> str:
    return "-" if not value else f"1/{1 / value:.1f}"


def protocols_table(result: BenchResult) -> Table:
    """The Messages and Responses scenarios (see the module docstring)."""
    table = _scenario_table(
        "Caller protocols: Anthropic Messages and OpenAI Responses, closed-loop",
        ("req/s", "CPU ms/req", "edge", "node", "vs IOP chat", "of LiteLLM"),
        caption="IOP relays them natively; IOP transl. and LiteLLM translate them to chat "
        "completions and back, for a model each serves from a chat-only provider",
    )
    scenarios = [s for s in result.scenarios() if s.protocol != "chat"]
    for index, scenario in enumerate(scenarios):
        rows = [m for m in result.measurements if m.scenario == scenario]
        chat = result.get(IOP, scenario.like("chat"))
        chat_cpu = chat.cpu_ms_per_request if chat is not None else None
        for row, m in enumerate(rows):
            iop = m.target in (IOP, IOP_TRANSLATED)
            cpu = m.cpu_ms_per_request
            vs_chat = cpu / chat_cpu if iop and cpu is not None and chat_cpu else None
            table.add_row(
                *_outcome_cells(scenario, row, m),
                _rps(m),
                _num(cpu),
                _num(m.process_cpu_ms_per_request("edge")) if iop else "",
                _num(m.process_cpu_ms_per_request("node")) if iop else "",
                _ratio(vs_chat) if iop else "",
                _share(cpu_ratio(result, m.target, LITELLM, scenario)) if iop else "",
                end_section=row == len(rows) - 1 and index < len(scenarios) - 1,
            )
    return table


def agent_cache_table(m: AgentCacheMeasurement) -> Table:
    table = Table(
        title=(
            "Agent prefix cache: a Claude-Code-shaped conversation, the attribution block "
            f"removed (default) and kept; {m.shape.label}"
        )
    )
    table.add_column("turn", justify="right")
    for name in (
        "prompt tokens", "removed: ms", "cached", "kept: ms", "cached",
    ):  # fmt: skip
        table.add_column(name, justify="right")
    for n, (stripped, as_sent) in enumerate(zip(m.stripped, m.as_sent, strict=True), 1):
        table.add_row(
            str(n),
            str(stripped.prompt_tokens),
            f"{stripped.seconds * 1000:.0f}",
            f"{stripped.cached_share:.0%}",
            f"{as_sent.seconds * 1000:.0f}",
            f"{as_sent.cached_share:.0%}",
        )
    speedup = m.speedup
    table.add_row(
        "all",
        str(sum(turn.prompt_tokens for turn in m.stripped)),
        f"{m.total_s(m.stripped) * 1000:.0f}",
        f"{m.cached_share(m.stripped):.0%}",
        f"{m.total_s(m.as_sent) * 1000:.0f}",
        f"{m.cached_share(m.as_sent):.0%}"
        + ("" if speedup is None else f" ({speedup:.1f}x the time)"),
        style="bold",
    )
    return table


def fleet_delivery_table(result: BenchResult) -> Table:
    shape = result.fleet[0].shape
    table = Table(title=f"Fleet-shaped streams: {shape.label}, {shape.window_s:g} s measured")
    table.add_column("target")
    for name in (
        "chunks/s", "streams", "err", "delay p50 ms", "delay p99 ms", "+p50 ms", "+p99 ms",
        "gap p50 ms", "gap p99 ms", "+gap p99 ms",
    ):  # fmt: skip
        table.add_column(name, justify="right")
    for m in result.fleet:
        baseline = m.target == DIRECT
        table.add_row(
            _label(m.target),
            _num(m.chunks_per_s, 0),
            str(m.streams_done),
            Text(str(m.errors), style="red" if m.errors else ""),
            _num(m.delay_ms(50.0)),
            _num(m.delay_ms(99.0)),
            "" if baseline else _num(added_token_delay_ms(result, m.target, 50.0), signed=True),
            "" if baseline else _num(added_token_delay_ms(result, m.target, 99.0), signed=True),
            _num(m.gap_ms(50.0)),
            _num(m.gap_ms(99.0)),
            "" if baseline else _num(added_gap_ms(result, m.target, 99.0), signed=True),
        )
    return table


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / _MB:.1f}"


def fleet_cost_table(result: BenchResult) -> Table:
    table = Table(title="Fleet-shaped streams: cost by process")
    table.add_column("target")
    table.add_column("process")
    for name in (
        "CPU us/chunk", "chunks/s per core", "waited for a core", "RSS idle MB",
        "RSS loaded MB", "KB/open stream",
    ):  # fmt: skip
        table.add_column(name, justify="right")
    for index, m in enumerate(result.fleet):
        rows = _process_rows(m.target)
        for row, (label, process) in enumerate(rows):
            idle = m.rss_idle.get(process) if m.rss_idle and process else None
            loaded = m.rss_loaded.get(process) if m.rss_loaded and process else None
            per_core = m.chunks_per_core_s(process)
            waited = m.waited_share(process) if process else None
            table.add_row(
                _label(m.target) if row == 0 else "",
                label,
                _num(m.cpu_us_per_chunk(process), 0),
                "-" if per_core is None else f"{per_core:,.0f}",
                "-" if waited is None else f"{waited:.0%}",
                _mb(idle),
                _mb(loaded),
                _num(m.rss_kb_per_stream(process), 1) if process else "-",
                end_section=row == len(rows) - 1 and index < len(result.fleet) - 1,
            )
    return table


def many_nodes_table(result: BenchResult) -> Table:
    m = result.many_nodes
    assert m is not None
    shape = m.shape
    table = Table(
        title=(
            f"Many Nodes on one Edge: {shape.nodes} light Nodes x "
            f"{shape.providers_per_node} providers, {shape.models} models "
            f"({shape.node_processes} process{'es' if shape.node_processes > 1 else ''}, "
            f"niceness {shape.light_nodes_niceness})"
        )
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    catalog_p50 = m.catalog_ms(50.0)
    rows = [
        ("connect (until the catalog shows every provider available)", f"{m.connect_s:.1f} s"),
        ("Edge RSS before any Node", f"{_mb(m.rss_empty)} MB"),
        ("Edge RSS, every Node connected, idle", f"{_mb(m.rss_connected)} MB"),
        ("Edge RSS per connected Node", f"{_num(m.rss_kb_per_node, 1)} KB"),
        ("Edge RSS after the refresh", f"{_mb(m.rss_after_refresh)} MB"),
        (
            f"idle Edge CPU over {m.idle_window_s:g} s",
            "-" if m.idle_cpu_share is None else f"{m.idle_cpu_share:.1%} of a core",
        ),
        (
            f"/catalog p50 / slowest of {len(m.catalog_s)} ({m.catalog_bytes / 1024:,.0f} KB)",
            f"{_num(catalog_p50, 0)} / {_num(m.catalog_max_ms, 0)} ms",
        ),
        (
            f"/catalog filtered (one Node; a page of a model's available), slowest of "
            f"{len(m.catalog_filtered_s)}",
            f"{_num(m.catalog_filtered_max_ms, 0)} ms",
        ),
        (
            f"refresh dry run (validate + plan), {FEW_NODES} Nodes changed",
            f"{_num(m.dry_run_few_s, 2)} s",
        ),
        ("refresh dry run (validate + plan), every Node changed", f"{_num(m.dry_run_s, 1)} s"),
        (
            "refresh apply, until every Node acked",
            f"{_num(m.refresh_s, 1)} s ({m.refresh_applied}/{m.refresh_nodes} applied)",
        ),
        ("Edge loop holds during the dry runs and the apply", str(m.holds_refresh or "-")),
        ("Edge loop holds during the apply", str(m.holds_apply or "-")),
        (
            f"Edge loop holds while {m.churned} Nodes leave at once and connect again, "
            f"{len(m.rss_churn) - 1 if m.rss_churn else 0} times, and after",
            str(m.holds_churn or "- (too few Nodes for a churn)"),
        ),
        (
            "Edge RSS before the churn, after each round, at its end",
            " / ".join(f"{_mb(v)}" for v in (m.rss_before_churn, *m.rss_churn)) + " MB"
            if m.rss_churn
            else "-",
        ),
        (
            "Edge loop holds with the fleet connected (idle, refresh, churn)",
            str(m.holds_fleet or "-"),
        ),
        ("Edge loop holds over its whole run (start, connects too)", str(m.holds_all or "-")),
        (
            f"callers ({m.shape.caller_rate:g}/s to the sim model) p50 / p99 idle "
            f"({len(m.caller_idle_s)} requests)",
            f"{_num(m.caller_ms('idle', 50.0), 0)} / {_num(m.caller_ms('idle', 99.0), 0)} ms",
        ),
        (
            f"... during the dry run and the apply ({len(m.caller_refresh_s)} requests, "
            f"{m.caller_errors} failed)",
            f"{_num(m.caller_ms('refresh', 50.0), 0)} / {_num(m.caller_ms('refresh', 99.0), 0)} ms",
        ),
        (
            f"... of which during the dry run ({len(m.caller_dry_run_s)}) / the apply "
            f"({len(m.caller_apply_s)}), p99",
            f"{_num(m.caller_ms('dry_run', 99.0), 0)} / {_num(m.caller_ms('apply', 99.0), 0)} ms",
        ),
        (
            f"... idle again after the refresh ({len(m.caller_after_s)} requests), p50 / p99",
            f"{_num(m.caller_ms('after', 50.0), 0)} / {_num(m.caller_ms('after', 99.0), 0)} ms",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def targets_table(checks: Sequence[TargetCheck]) -> Table:
    table = Table(title="Performance targets (reported, not asserted)")
    table.add_column("goal")
    table.add_column("measured", justify="right")
    table.add_column("verdict", justify="center")
    styles = {"PASS": "bold green", "MISS": "bold red", "n/a": "dim"}
    for check in checks:
        table.add_row(check.goal, check.measured, Text(check.verdict, style=styles[check.verdict]))
    return table


def render(result: BenchResult) -> RenderableType:
    machine = result.machine
    parts: list[RenderableType] = [
        Text(
            f"machine: {machine.cores} cores, {machine.python}, {machine.platform}",
            style="bold",
        )
    ]
    if result.settings:
        parts.append(Text("settings: " + ", ".join(f"{k}={v}" for k, v in result.settings.items())))
    if _chat_scenarios(result):
        parts.append(measurements_table(result))
        parts.append(cpu_by_process_table(result))
    if any(s.protocol != "chat" for s in result.scenarios()):
        parts.append(protocols_table(result))
    for m in result.measurements:
        if m.first_error:
            parts.append(Text(f"{m.target} {m.scenario.label}: first error: {m.first_error}"))
    if result.fleet:
        parts.append(fleet_delivery_table(result))
        parts.append(fleet_cost_table(result))
    for f in result.fleet:
        if f.first_error:
            parts.append(Text(f"{f.target} fleet: first error: {f.first_error}"))
    if result.many_nodes is not None:
        parts.append(many_nodes_table(result))
        if result.many_nodes.refresh_problem:
            parts.append(Text(f"refresh: {result.many_nodes.refresh_problem}"))
    if result.agent_cache is not None:
        parts.append(agent_cache_table(result.agent_cache))
    parts.extend(Text(note) for note in result.notes)
    parts.append(targets_table(check_targets(result)))
    return Group(*parts)


# --- JSON -----------------------------------------------------------------------------------------


def _fleet_json(result: BenchResult, m: FleetMeasurement) -> dict[str, Any]:
    processes = PROCESSES.get(m.target, ())
    return {
        "target": m.target,
        "streams": m.shape.streams,
        "tokens_per_second": m.shape.tokens_per_second,
        "tokens": m.shape.tokens,
        "window_s": m.window_s,
        "chunks": m.chunks,
        "streams_done": m.streams_done,
        "errors": m.errors,
        "delay_p50_ms": m.delay_ms(50.0),
        "delay_p99_ms": m.delay_ms(99.0),
        "added_delay_p50_ms": added_token_delay_ms(result, m.target, 50.0),
        "added_delay_p99_ms": added_token_delay_ms(result, m.target, 99.0),
        "gap_p50_ms": m.gap_ms(50.0),
        "gap_p99_ms": m.gap_ms(99.0),
        "processes": {
            name: {
                "cpu_us_per_chunk": m.cpu_us_per_chunk(name),
                "rss_idle_bytes": m.rss_idle.get(name) if m.rss_idle else None,
                "rss_loaded_bytes": m.rss_loaded.get(name) if m.rss_loaded else None,
                "rss_kb_per_stream": m.rss_kb_per_stream(name),
                "waited_for_a_core_share": m.waited_share(name),
            }
            for name in processes
        },
        "first_error": m.first_error,
    }


def to_json(result: BenchResult) -> str:
    """The raw numbers, for tooling (`--json FILE`)."""
    rows = [
        {
            "target": m.target,
            "protocol": m.scenario.protocol,
            "concurrency": m.scenario.concurrency,
            "stream": m.scenario.stream,
            "ok": m.ok,
            "errors": m.errors,
            "p50_ms": m.p50_ms,
            "p99_ms": m.p99_ms,
            "rps": m.rps,
            "cpu_ms_per_request": m.cpu_ms_per_request,
            "turn_cpu_ms_per_request": list(m.turn_cpu_ms),
            "processes": {
                name: {
                    "cpu_ms_per_request": m.process_cpu_ms_per_request(name),
                    "cpu_us_per_chunk": m.process_cpu_us_per_chunk(name),
                }
                for name in PROCESSES.get(m.target, ())
            },
            "added_p50_ms": added_p50_ms(result, m.target, m.scenario),
            "first_error": m.first_error,
        }
        for m in result.measurements
    ]
    nodes = result.many_nodes
    many_nodes = None
    if nodes is not None:
        many_nodes = {
            "nodes": nodes.shape.nodes,
            "providers_per_node": nodes.shape.providers_per_node,
            "connect_s": nodes.connect_s,
            "rss_empty_bytes": nodes.rss_empty,
            "rss_connected_bytes": nodes.rss_connected,
            "rss_after_refresh_bytes": nodes.rss_after_refresh,
            "rss_before_churn_bytes": nodes.rss_before_churn,
            "rss_churn_bytes": list(nodes.rss_churn),
            "idle_cpu_share": nodes.idle_cpu_share,
            "catalog_p50_ms": nodes.catalog_ms(50.0),
            "catalog_max_ms": nodes.catalog_max_ms,
            "catalog_bytes": nodes.catalog_bytes,
            "dry_run_s": nodes.dry_run_s,
            "dry_run_few_s": nodes.dry_run_few_s,
            "refresh_s": nodes.refresh_s,
            "refresh_status": nodes.refresh_status,
            "refresh_applied": nodes.refresh_applied,
            "refresh_nodes": nodes.refresh_nodes,
            "refresh_problem": nodes.refresh_problem,
            "node_processes": nodes.shape.node_processes,
            "light_nodes_niceness": nodes.shape.light_nodes_niceness,
            "catalog_filtered_max_ms": nodes.catalog_filtered_max_ms,
            "caller_rate": nodes.shape.caller_rate,
            "caller_idle_p50_ms": nodes.caller_ms("idle", 50.0),
            "caller_idle_p99_ms": nodes.caller_ms("idle", 99.0),
            "caller_refresh_p50_ms": nodes.caller_ms("refresh", 50.0),
            "caller_refresh_p99_ms": nodes.caller_ms("refresh", 99.0),
            "caller_p99_ratio": nodes.caller_p99_ratio,
            "caller_after_p99_ms": nodes.caller_ms("after", 99.0),
            "caller_errors": nodes.caller_errors,
            **{
                f"loop_holds_{window}": None if holds is None else dataclasses.asdict(holds)
                for window, holds in (
                    ("refresh", nodes.holds_refresh),
                    ("apply", nodes.holds_apply),
                    ("churn", nodes.holds_churn),
                    ("fleet", nodes.holds_fleet),
                    ("all", nodes.holds_all),
                )
            },
        }
    agent = result.agent_cache
    agent_cache = None
    if agent is not None:
        agent_cache = {
            "turns": agent.shape.turns,
            "prefill_us_per_token": agent.shape.prefill_us,
            "cached_prefill_us_per_token": agent.shape.cached_us,
            **{
                name: [
                    {
                        "seconds": turn.seconds,
                        "prompt_tokens": turn.prompt_tokens,
                        "cached_tokens": turn.cached_tokens,
                    }
                    for turn in turns
                ]
                for name, turns in (("removed", agent.stripped), ("kept", agent.as_sent))
            },
        }
    checks = [
        {"goal": c.goal, "measured": c.measured, "verdict": c.verdict}
        for c in check_targets(result)
    ]
    document = {
        "machine": {
            "cores": result.machine.cores,
            "python": result.machine.python,
            "platform": result.machine.platform,
        },
        "settings": result.settings,
        "measurements": rows,
        "fleet": [_fleet_json(result, m) for m in result.fleet],
        "many_nodes": many_nodes,
        "agent_cache": agent_cache,
        "targets": checks,
        "notes": list(result.notes),
    }
    return json.dumps(document, indent=2)
