"""IOP's performance goals, judged against one run's numbers (pure).

Each goal is printed as PASS/MISS next to what was measured, never asserted: a number
on a shared 2-core machine is an observation, not a test. A goal whose numbers were not
measured in the run (a peer not installed, a part not run) is `n/a` and says what is
missing; a goal stated for a scale (1,000 Nodes, the default fleet) is `n/a` when the
run used another one, with the value shown anyway.

The goals compare targets within one run (ratios), except the absolute ones of the
many-Nodes scenario, which are budgets for one Edge on this machine. Where the run
measured the stack floor (`bench.stack_floor`: IOP's transport parts relaying, with none
of its logic), each closed-loop goal shows the floor's number beside IOP's: what those
parts alone make of the goal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

from bench.fleet import FleetShape
from bench.load import Protocol, Scenario
from bench.many_nodes import FEW_NODES
from bench.result import (
    HYPERCORN,
    IOP,
    IOP_TRANSLATED,
    LITELLM,
    STACK_FLOOR,
    VLLM_ROUTER,
    BenchResult,
    added_p50_ms,
    added_token_delay_ms,
    cpu_ratio,
    cpu_ratio_by_turn,
    throughput_ratio,
)

Verdict = Literal["PASS", "MISS", "n/a"]

#: Edge CPU per relayed chunk in the fleet scenario, at most this many times the router's.
MAX_EDGE_CHUNK_CPU_VS_ROUTER: Final = 3.0
#: Added token delay p99 in the fleet scenario at the default shape (ms).
MAX_ADDED_TOKEN_DELAY_P99_MS: Final = 5.0
#: Edge + Node CPU per request as a share of LiteLLM's, by `stream`.
MAX_CPU_SHARE_OF_LITELLM: Final = {False: 1 / 8, True: 1 / 12}
#: Edge + Node CPU per request over the stack floor's (IOP's transport parts alone), on
#: every closed-loop chat scenario: what IOP's own logic may add to its transport. Judged
#: on the median of the per-turn ratios (`cpu_ratio_by_turn`) when the run has turns,
#: their range shown beside it.
MAX_CPU_VS_STACK_FLOOR: Final = 1.15
#: Throughput at c=32 over LiteLLM's, by `stream`.
MIN_THROUGHPUT_VS_LITELLM: Final = {False: 8.0, True: 15.0}
THROUGHPUT_CONCURRENCY: Final = 32
#: IOP's added p50 at c=1 over the Hypercorn floor's own added p50, by `stream`.
MAX_ADDED_P50_VS_FLOOR: Final = {False: 3.0, True: 2.0}
#: Messages and Responses translated on the Node: CPU per request (Edge + Node) as a
#: share of LiteLLM's on the same protocol.
MAX_TRANSLATED_CPU_SHARE_OF_LITELLM: Final = 1 / 5
#: Messages and Responses relayed natively: CPU per request over IOP's on chat.
MAX_NATIVE_CPU_VS_CHAT: Final = 1.10
_PROTOCOL_NAMES: Final[dict[Protocol, str]] = {"messages": "Messages", "responses": "Responses"}
#: The many-Nodes budgets for one Edge.
NODES_AT_SCALE: Final = 1000
MAX_EDGE_RSS_MB: Final = 300.0
MAX_IDLE_CPU_SHARE: Final = 0.05
MAX_CATALOG_MS: Final = 100.0
MAX_REFRESH_S: Final = 10.0
#: The fleet budgets for one Edge, stated for 10,000 Nodes x 3 providers and judged at
#: whatever scale the run used (a smaller fleet must fit them too).
FLEET_NODES: Final = 10_000
FLEET_MAX_IDLE_CPU_SHARE: Final = 0.10
FLEET_MAX_DRY_RUN_S: Final = 2.0
FLEET_MAX_APPLY_S: Final = 15.0
FLEET_MAX_CALLER_P99_RATIO: Final = 1.2
FLEET_MAX_FILTERED_CATALOG_MS: Final = 50.0
FLEET_MAX_CATALOG_MS: Final = 1000.0
FLEET_MAX_EDGE_RSS_MB: Final = 1024.0
#: The longest the Edge's event loop may be held in one step while it serves a fleet, by
#: anything: a refresh's own work, the collector, the heap keeper's sweeps, a share of
#: the fleet leaving and connecting again (`bench.loop_holds`; judged on the loop's CPU
#: time, which preemption does not move).
FLEET_MAX_LOOP_HOLD_S: Final = 0.05
#: The Edge's RSS at the churn's end over its RSS before it: sessions that ended are
#: freed (the Nodes that connect again reuse their memory).
FLEET_MAX_CHURN_RSS_GROWTH: Final = 1.05


@dataclass(frozen=True, slots=True)
class TargetCheck:
    goal: str
    measured: str
    verdict: Verdict


def _at_most(value: float, limit: float) -> Verdict:
    return "PASS" if value <= limit else "MISS"


def _floor_note(floor: str | None) -> str:
    """The same number for the stack floor, when measured: what the transport parts alone
    make of the goal (`bench.stack_floor`)."""
    return "" if floor is None else f" (stack floor {floor})"


def _kind(stream: bool) -> str:
    return "22-chunk stream" if stream else "non-stream"


def _fleet_checks(result: BenchResult) -> list[TargetCheck]:
    checks: list[TargetCheck] = []
    iop, router = result.fleet_of(IOP), result.fleet_of(VLLM_ROUTER)
    goal = f"fleet: Edge CPU per relayed chunk <= {MAX_EDGE_CHUNK_CPU_VS_ROUTER:g}x vllm-router's"
    edge_cost = iop.cpu_us_per_chunk("edge") if iop else None
    router_cost = router.cpu_us_per_chunk("router") if router else None
    if edge_cost is None or not router_cost:
        missing = "iop" if edge_cost is None else "vllm-router"
        checks.append(TargetCheck(goal, f"not measured ({missing})", "n/a"))
    else:
        ratio = edge_cost / router_cost
        measured = f"{edge_cost:.0f} vs {router_cost:.0f} us = {ratio:.1f}x"
        checks.append(TargetCheck(goal, measured, _at_most(ratio, MAX_EDGE_CHUNK_CPU_VS_ROUTER)))

    default = FleetShape()
    goal = (
        f"fleet: IOP adds <= {MAX_ADDED_TOKEN_DELAY_P99_MS:g} ms token delay p99 "
        f"at {default.streams} x {default.tokens_per_second:g} tok/s"
    )
    added = added_token_delay_ms(result, IOP, 99.0)
    if added is None or iop is None:
        checks.append(TargetCheck(goal, "not measured (iop or direct)", "n/a"))
    else:
        at_default = (iop.shape.streams, iop.shape.tokens_per_second) == (
            default.streams,
            default.tokens_per_second,
        )
        if at_default:
            checks.append(
                TargetCheck(goal, f"{added:+.2f} ms", _at_most(added, MAX_ADDED_TOKEN_DELAY_P99_MS))
            )
        else:
            shape = f"{iop.shape.streams} x {iop.shape.tokens_per_second:g}"
            checks.append(TargetCheck(goal, f"{added:+.2f} ms (at {shape})", "n/a"))
    return checks


def _closed_loop_checks(result: BenchResult) -> list[TargetCheck]:
    checks: list[TargetCheck] = []
    concurrencies = sorted({s.concurrency for s in result.scenarios()}) or [1, 32]
    for stream in (False, True):
        share = MAX_CPU_SHARE_OF_LITELLM[stream]
        for concurrency in concurrencies:
            scenario = Scenario(concurrency=concurrency, stream=stream)
            goal = (
                f"CPU per request, Edge + Node <= 1/{1 / share:.0f} of LiteLLM's, "
                f"{_kind(stream)}, c={concurrency}"
            )
            ratio = cpu_ratio(result, IOP, LITELLM, scenario)
            if ratio is None:
                missing = LITELLM if result.get(IOP, scenario) else IOP
                checks.append(TargetCheck(goal, f"not measured ({missing})", "n/a"))
            else:
                floor = cpu_ratio(result, STACK_FLOOR, LITELLM, scenario)
                measured = f"1/{1 / ratio:.1f}" + _floor_note(
                    None if floor is None else f"1/{1 / floor:.1f}"
                )
                checks.append(TargetCheck(goal, measured, _at_most(ratio, share)))
    for stream in (False, True):
        for concurrency in concurrencies:
            scenario = Scenario(concurrency=concurrency, stream=stream)
            goal = (
                f"CPU per request, Edge + Node <= {MAX_CPU_VS_STACK_FLOOR:g}x the stack floor's, "
                f"{_kind(stream)}, c={concurrency}"
            )
            by_turn = cpu_ratio_by_turn(result, IOP, STACK_FLOOR, scenario)
            ratio = cpu_ratio(result, IOP, STACK_FLOOR, scenario)
            if by_turn is not None and by_turn.turns > 1:
                measured = (
                    f"{by_turn.median:.2f}x (median of {by_turn.turns} turns, "
                    f"{by_turn.low:.2f}-{by_turn.high:.2f})"
                )
                verdict = _at_most(by_turn.median, MAX_CPU_VS_STACK_FLOOR)
                checks.append(TargetCheck(goal, measured, verdict))
            elif ratio is None:
                missing = STACK_FLOOR if result.get(IOP, scenario) else IOP
                checks.append(TargetCheck(goal, f"not measured ({missing})", "n/a"))
            else:
                checks.append(
                    TargetCheck(goal, f"{ratio:.2f}x", _at_most(ratio, MAX_CPU_VS_STACK_FLOOR))
                )
    for stream in (False, True):
        scenario = Scenario(concurrency=THROUGHPUT_CONCURRENCY, stream=stream)
        least = MIN_THROUGHPUT_VS_LITELLM[stream]
        goal = (
            f"throughput >= {least:g}x LiteLLM's at c={THROUGHPUT_CONCURRENCY}, "
            f"{'stream' if stream else 'non-stream'}"
        )
        ratio = throughput_ratio(result, IOP, LITELLM, scenario)
        if ratio is None:
            missing = LITELLM if result.get(IOP, scenario) else IOP
            checks.append(TargetCheck(goal, f"not measured ({missing})", "n/a"))
        else:
            floor = throughput_ratio(result, STACK_FLOOR, LITELLM, scenario)
            measured = f"{ratio:.2f}x" + _floor_note(None if floor is None else f"{floor:.2f}x")
            checks.append(TargetCheck(goal, measured, "PASS" if ratio >= least else "MISS"))
    for stream in (False, True):
        scenario = Scenario(concurrency=1, stream=stream)
        limit = MAX_ADDED_P50_VS_FLOOR[stream]
        goal = f"c=1 added p50 <= {limit:g}x the Hypercorn floor's, {_kind(stream)}"
        iop, floor = added_p50_ms(result, IOP, scenario), added_p50_ms(result, HYPERCORN, scenario)
        if iop is None or floor is None or floor <= 0:
            missing = "iop" if iop is None else "hypercorn"
            checks.append(TargetCheck(goal, f"not measured ({missing})", "n/a"))
        else:
            ratio = iop / floor
            stack = added_p50_ms(result, STACK_FLOOR, scenario)
            measured = f"{iop:+.2f} vs {floor:+.2f} ms = {ratio:.1f}x" + _floor_note(
                None if stack is None else f"{stack / floor:.1f}x"
            )
            checks.append(TargetCheck(goal, measured, _at_most(ratio, limit)))
    return checks


def _ratio_check(
    goal: str,
    ratios: list[tuple[int, float | None]],
    limit: float,
    show: Callable[[float], str],
    missing: str,
) -> TargetCheck:
    """One goal over every concurrency measured: PASS when each ratio is within `limit`
    (`missing`: the targets it needs, named when none was measured)."""
    measured = [(c, r) for c, r in ratios if r is not None]
    if not measured:
        return TargetCheck(goal, f"not measured ({missing})", "n/a")
    shown = ", ".join(f"c={c} {show(r)}" for c, r in measured)
    return TargetCheck(goal, shown, "PASS" if all(r <= limit for _, r in measured) else "MISS")


def _native_vs_chat(result: BenchResult, scenario: Scenario) -> float | None:
    native = result.get(IOP, scenario)
    chat = result.get(IOP, scenario.like("chat"))
    if native is None or chat is None:
        return None
    mine, theirs = native.cpu_ms_per_request, chat.cpu_ms_per_request
    return None if mine is None or not theirs else mine / theirs


def _protocol_checks(result: BenchResult) -> list[TargetCheck]:
    checks: list[TargetCheck] = []
    for protocol, name in _PROTOCOL_NAMES.items():
        for stream in (False, True):
            scenarios = [
                s for s in result.scenarios() if s.protocol == protocol and s.stream == stream
            ]
            share = MAX_TRANSLATED_CPU_SHARE_OF_LITELLM
            kind = "stream" if stream else "non-stream"
            checks.append(
                _ratio_check(
                    f"{name} translated: CPU per request <= 1/{1 / share:.0f} of LiteLLM's, {kind}",
                    [
                        (s.concurrency, cpu_ratio(result, IOP_TRANSLATED, LITELLM, s))
                        for s in scenarios
                    ],
                    share,
                    lambda ratio: f"1/{1 / ratio:.1f}" if ratio else "0",
                    f"{IOP_TRANSLATED}, {LITELLM}",
                )
            )
            checks.append(
                _ratio_check(
                    f"{name} native: CPU per request <= {MAX_NATIVE_CPU_VS_CHAT:g}x IOP's chat, "
                    f"{kind}",
                    [(s.concurrency, _native_vs_chat(result, s)) for s in scenarios],
                    MAX_NATIVE_CPU_VS_CHAT,
                    lambda ratio: f"{ratio:.2f}x",
                    f"{IOP} on {protocol} and chat",
                )
            )
    return checks


def _nodes_checks(result: BenchResult) -> list[TargetCheck]:
    prefix = f"{NODES_AT_SCALE} Nodes: "
    m = result.many_nodes
    if m is None:
        names = ("Edge RSS", "idle Edge CPU", "/catalog latency", "refresh of every Node")
        return [TargetCheck(prefix + name, "not measured (nodes)", "n/a") for name in names]
    at_scale = m.shape.nodes == NODES_AT_SCALE
    scale_note = "" if at_scale else f" (at {m.shape.nodes} Nodes)"
    rss = max((v for v in (m.rss_connected, m.rss_after_refresh) if v is not None), default=None)
    rss_mb = None if rss is None else rss / 2**20
    idle, slowest = m.idle_cpu_share, m.catalog_max_ms
    budgets: list[tuple[str, float | None, str, float]] = [
        (
            f"Edge RSS <= {MAX_EDGE_RSS_MB:g} MB (highest: idle or after the refresh)",
            rss_mb,
            f"{rss_mb:.0f} MB" if rss_mb is not None else "",
            MAX_EDGE_RSS_MB,
        ),
        (
            f"idle Edge CPU <= {MAX_IDLE_CPU_SHARE:.0%} of a core",
            idle,
            f"{idle:.1%}" if idle is not None else "",
            MAX_IDLE_CPU_SHARE,
        ),
        (
            f"/catalog <= {MAX_CATALOG_MS:g} ms (slowest of {len(m.catalog_s)})",
            slowest,
            f"{slowest:.0f} ms" if slowest is not None else "",
            MAX_CATALOG_MS,
        ),
    ]
    checks: list[TargetCheck] = []
    for goal, value, text, limit in budgets:
        if value is None:
            checks.append(TargetCheck(prefix + goal, "not measured", "n/a"))
        else:
            verdict: Verdict = _at_most(value, limit) if at_scale else "n/a"
            checks.append(TargetCheck(prefix + goal, text + scale_note, verdict))
    goal = prefix + f"refresh of every Node <= {MAX_REFRESH_S:g} s (until all acked)"
    if m.refresh_s is None:
        measured = f"refused: {m.refresh_problem}"[:80]
        checks.append(TargetCheck(goal, measured, "MISS" if at_scale else "n/a"))
        return checks
    everyone = m.refresh_applied == m.shape.nodes
    measured = f"{m.refresh_s:.1f} s, {m.refresh_applied}/{m.refresh_nodes} applied" + scale_note
    verdict = "n/a"
    if at_scale:
        verdict = "PASS" if everyone and m.refresh_s <= MAX_REFRESH_S else "MISS"
    checks.append(TargetCheck(goal, measured, verdict))
    return checks


def _fleet_scale_checks(result: BenchResult) -> list[TargetCheck]:
    """The fleet budgets (stated for `FLEET_NODES`), judged at the run's scale."""
    m = result.many_nodes
    names = (
        f"idle Edge CPU <= {FLEET_MAX_IDLE_CPU_SHARE:.0%} of a core",
        f"refresh dry run of a few Nodes' change <= {FLEET_MAX_DRY_RUN_S:g} s",
        f"refresh apply <= {FLEET_MAX_APPLY_S:g} s until every Node acked, none left behind",
        f"callers' p99 during the refresh <= {FLEET_MAX_CALLER_P99_RATIO:g}x idle",
        f"filtered /catalog <= {FLEET_MAX_FILTERED_CATALOG_MS:g} ms (slowest)",
        f"whole /catalog <= {FLEET_MAX_CATALOG_MS:g} ms (slowest)",
        f"Edge RSS <= {FLEET_MAX_EDGE_RSS_MB:g} MB, idle and after the refresh",
        f"Edge loop held <= {FLEET_MAX_LOOP_HOLD_S * 1000:g} ms a step (CPU), fleet connected: "
        "idle, refresh, churn",
        f"Edge RSS after the churn <= {FLEET_MAX_CHURN_RSS_GROWTH:g}x before it",
    )
    if m is None:
        return [TargetCheck(f"fleet: {name}", "not measured (nodes)", "n/a") for name in names]
    prefix = f"fleet ({m.shape.nodes:,} Nodes; budget for {FLEET_NODES:,}): "
    rss = max((v for v in (m.rss_connected, m.rss_after_refresh) if v is not None), default=None)
    ratio = m.caller_p99_ratio
    holds = m.holds_fleet
    churn_end = m.rss_churn[-1] if m.rss_churn else None
    churn_growth = (
        None if churn_end is None or not m.rss_before_churn else churn_end / m.rss_before_churn
    )
    p99_idle, p99_busy = m.caller_ms("idle", 99.0), m.caller_ms("refresh", 99.0)
    values: list[tuple[float | None, str, float]] = [
        (m.idle_cpu_share, f"{m.idle_cpu_share or 0:.1%}", FLEET_MAX_IDLE_CPU_SHARE),
        (
            m.dry_run_few_s,
            f"{m.dry_run_few_s or 0:.2f} s ({FEW_NODES} Nodes; "
            f"every Node {m.dry_run_s or 0:.1f} s)",
            FLEET_MAX_DRY_RUN_S,
        ),
        (
            None if m.refresh_s is None else m.refresh_s,
            f"{m.refresh_s or 0:.1f} s, {m.refresh_applied}/{m.shape.nodes} applied",
            FLEET_MAX_APPLY_S,
        ),
        (
            ratio,
            f"{p99_busy or 0:.0f} vs {p99_idle or 0:.0f} ms = {ratio or 0:.2f}x (dry runs "
            f"{m.caller_ms('dry_run', 99.0) or 0:.0f}, apply {m.caller_ms('apply', 99.0) or 0:.0f}"
            f" ms; light Nodes at niceness {m.shape.light_nodes_niceness})",
            FLEET_MAX_CALLER_P99_RATIO,
        ),
        (
            m.catalog_filtered_max_ms,
            f"{m.catalog_filtered_max_ms or 0:.0f} ms",
            FLEET_MAX_FILTERED_CATALOG_MS,
        ),
        (m.catalog_max_ms, f"{m.catalog_max_ms or 0:.0f} ms", FLEET_MAX_CATALOG_MS),
        (
            None if rss is None else rss / 2**20,
            f"{(rss or 0) / 2**20:.0f} MB",
            FLEET_MAX_EDGE_RSS_MB,
        ),
        (
            None if holds is None else holds.longest_cpu_s,
            "-" if holds is None else str(holds),
            FLEET_MAX_LOOP_HOLD_S,
        ),
        (
            churn_growth,
            f"{(m.rss_before_churn or 0) / 2**20:.0f} MB -> "
            + " -> ".join(f"{(v or 0) / 2**20:.0f}" for v in m.rss_churn)
            + f" MB ({m.churned} Nodes left and came back, {len(m.rss_churn) - 1} times)",
            FLEET_MAX_CHURN_RSS_GROWTH,
        ),
    ]
    checks: list[TargetCheck] = []
    for name, (value, text, limit) in zip(names, values, strict=True):
        if value is None:
            reason = m.refresh_problem if name.startswith("refresh") else None
            checks.append(TargetCheck(prefix + name, f"not measured {reason or ''}"[:80], "n/a"))
            continue
        verdict = _at_most(value, limit)
        if name.startswith("refresh apply") and m.refresh_applied != m.shape.nodes:
            verdict = "MISS"  # a Node left behind misses the goal, however fast
        checks.append(TargetCheck(prefix + name, text, verdict))
    return checks


def check_targets(result: BenchResult) -> list[TargetCheck]:
    """Every goal, in the order of the targets table."""
    return [
        *_fleet_checks(result),
        *_closed_loop_checks(result),
        *_protocol_checks(result),
        *_nodes_checks(result),
        *_fleet_scale_checks(result),
    ]
