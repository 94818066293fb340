"""The bench's report: the machine, one table of measurements, and the issue's targets.

Everything here is pure: `BenchResult` is what a run measured, `check_targets` compares
it with the goals of the issue ("measure the gateway against a direct upstream and
against the most used open gateway"), and `render` turns both into rich renderables.
The goals are printed as PASS/MISS next to the measured values, never asserted: a number
on a shared 2-core CI machine is an observation, not a test.

Column meanings: `CPU ms/req` is the CPU time the target's own processes spent per
request (the upstream for `direct`, the Edge plus the Node for IOP, the proxy for
LiteLLM): on a machine whose cores are all busy it is what bounds throughput. The
`Hypercorn` row is the Edge's HTTP server answering by itself (`bench.asgi_floor`): the
floor under IOP's numbers. `+p50` is
the median latency a target adds over calling the upstream directly (for a stream, time
to the last byte); `vs direct` is its throughput as a share of the direct one;
`IOP/LiteLLM` is IOP's throughput over LiteLLM's.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from bench.load import Measurement, Scenario

DIRECT: Final = "direct"
HYPERCORN: Final = "hypercorn"
IOP: Final = "iop"
LITELLM: Final = "litellm"
TARGET_LABELS: Final = {
    DIRECT: "direct",
    HYPERCORN: "Hypercorn",
    IOP: "IOP",
    LITELLM: "LiteLLM",
}

#: Goals from the issue.
MAX_ADDED_P50_MS: Final = {False: 1.5, True: 3.0}  # by `stream`, at concurrency 1
MIN_THROUGHPUT_VS_LITELLM: Final = 5.0  # at concurrency 32

Verdict = Literal["PASS", "MISS", "n/a"]


@dataclass(frozen=True, slots=True)
class Machine:
    cores: int
    python: str
    platform: str

    @classmethod
    def this(cls) -> Machine:
        return cls(
            cores=os.cpu_count() or 1,
            python=f"{platform.python_implementation()} {sys.version.split()[0]}",
            platform=platform.platform(terse=True),
        )


@dataclass(frozen=True, slots=True)
class BenchResult:
    machine: Machine
    measurements: tuple[Measurement, ...]
    notes: tuple[str, ...] = ()
    """Why a target was skipped, and the like; printed under the table."""
    settings: dict[str, Any] = field(default_factory=dict)

    def scenarios(self) -> list[Scenario]:
        seen: dict[Scenario, None] = {}
        for m in self.measurements:
            seen.setdefault(m.scenario, None)
        return list(seen)

    def get(self, target: str, scenario: Scenario) -> Measurement | None:
        for m in self.measurements:
            if m.target == target and m.scenario == scenario:
                return m
        return None


@dataclass(frozen=True, slots=True)
class TargetCheck:
    goal: str
    measured: str
    verdict: Verdict


# --- derived numbers (pure) ---------------------------------------------------------------------


def added_p50_ms(result: BenchResult, target: str, scenario: Scenario) -> float | None:
    """Median latency `target` adds over the direct upstream, in ms."""
    measured, direct = result.get(target, scenario), result.get(DIRECT, scenario)
    if measured is None or direct is None or measured.p50_ms is None or direct.p50_ms is None:
        return None
    return measured.p50_ms - direct.p50_ms


def throughput_ratio(
    result: BenchResult, target: str, baseline: str, scenario: Scenario
) -> float | None:
    measured, base = result.get(target, scenario), result.get(baseline, scenario)
    if measured is None or base is None or measured.rps is None or not base.rps:
        return None
    return measured.rps / base.rps


def check_targets(result: BenchResult) -> list[TargetCheck]:
    checks: list[TargetCheck] = []
    for stream in (False, True):
        scenario = Scenario(concurrency=1, stream=stream)
        limit = MAX_ADDED_P50_MS[stream]
        kind = "stream (22 chunks, to last byte)" if stream else "non-stream"
        goal = f"IOP adds <= {limit:g} ms p50 at c=1, {kind}"
        added = added_p50_ms(result, IOP, scenario)
        if added is None:
            missing = IOP if result.get(DIRECT, scenario) else DIRECT
            checks.append(TargetCheck(goal, f"not measured ({missing})", "n/a"))
        else:
            verdict: Verdict = "PASS" if added <= limit else "MISS"
            checks.append(TargetCheck(goal, f"{added:+.2f} ms", verdict))
    for stream in (False, True):
        scenario = Scenario(concurrency=32, stream=stream)
        goal = (
            f"IOP throughput >= {MIN_THROUGHPUT_VS_LITELLM:g}x LiteLLM's at c=32, "
            f"{'stream' if stream else 'non-stream'}"
        )
        ratio = throughput_ratio(result, IOP, LITELLM, scenario)
        if ratio is None:
            missing = LITELLM if result.get(IOP, scenario) else IOP
            checks.append(TargetCheck(goal, f"not measured ({missing})", "n/a"))
        else:
            verdict = "PASS" if ratio >= MIN_THROUGHPUT_VS_LITELLM else "MISS"
            checks.append(TargetCheck(goal, f"{ratio:.2f}x", verdict))
    return checks


# --- rendering ------------------------------------------------------------------------------------


def _ms(value: float | None, *, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}" if signed else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def measurements_table(result: BenchResult) -> Table:
    table = Table(title="Gateway overhead: closed-loop load, fake upstream with no delay")
    table.add_column("scenario")
    table.add_column("target")
    for name in (
        "ok", "err", "p50 ms", "p99 ms", "req/s", "CPU ms/req", "+p50 ms", "vs direct",
        "IOP/LiteLLM",
    ):  # fmt: skip
        table.add_column(name, justify="right")
    scenarios = result.scenarios()
    for index, scenario in enumerate(scenarios):
        rows = [m for m in result.measurements if m.scenario == scenario]
        for row, m in enumerate(rows):
            baseline = m.target == DIRECT
            table.add_row(
                scenario.label if row == 0 else "",
                TARGET_LABELS.get(m.target, m.target),
                str(m.ok),
                Text(str(m.errors), style="red" if m.errors else ""),
                _ms(m.p50_ms),
                _ms(m.p99_ms),
                "-" if m.rps is None else f"{m.rps:.0f}",
                _ms(m.cpu_ms_per_request),
                "" if baseline else _ms(added_p50_ms(result, m.target, scenario), signed=True),
                "" if baseline else _ratio(throughput_ratio(result, m.target, DIRECT, scenario)),
                _ratio(throughput_ratio(result, IOP, LITELLM, scenario)) if m.target == IOP else "",
                end_section=row == len(rows) - 1 and index < len(scenarios) - 1,
            )
    return table


def targets_table(checks: Sequence[TargetCheck]) -> Table:
    table = Table(title="Targets from the issue (reported, not asserted)")
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
    parts.append(measurements_table(result))
    for m in result.measurements:
        if m.first_error:
            parts.append(Text(f"{m.target} {m.scenario.label}: first error: {m.first_error}"))
    parts.extend(Text(note) for note in result.notes)
    parts.append(targets_table(check_targets(result)))
    return Group(*parts)


def to_json(result: BenchResult) -> str:
    """The raw numbers, for tooling (`--json FILE`)."""
    rows = [
        {
            "target": m.target,
            "concurrency": m.scenario.concurrency,
            "stream": m.scenario.stream,
            "ok": m.ok,
            "errors": m.errors,
            "p50_ms": m.p50_ms,
            "p99_ms": m.p99_ms,
            "rps": m.rps,
            "cpu_ms_per_request": m.cpu_ms_per_request,
            "added_p50_ms": added_p50_ms(result, m.target, m.scenario),
            "first_error": m.first_error,
        }
        for m in result.measurements
    ]
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
        "targets": checks,
        "notes": list(result.notes),
    }
    return json.dumps(document, indent=2)
