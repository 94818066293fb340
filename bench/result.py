"""What one bench run measured, and the numbers derived from it (all pure).

A run has up to four parts (`bench.run` says which ran): the closed-loop scenarios
(`measurements`, from `bench.load`), the fleet-shaped stream scenario (`fleet`, from
`bench.fleet`), the many-Nodes scenario (`many_nodes`, from `bench.many_nodes`) and the
agent prefix-cache scenario (`agent_cache`, from `bench.agent_cache`). Targets are named
by the constants here; each is made of named processes (`PROCESSES`), whose CPU and
memory the report shows apart. `iop-translated` is IOP's Edge and Node again, asked for
the model whose Messages and Responses runs the Node translates (`bench.gateway`).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Final

from bench.agent_cache import AgentCacheMeasurement
from bench.fleet import FleetMeasurement
from bench.load import PROTOCOLS, Measurement, Protocol, Scenario
from bench.many_nodes import ManyNodesMeasurement
from bench.upstream import MODEL, MODEL_TRANSLATED

DIRECT: Final = "direct"
HYPERCORN: Final = "hypercorn"
EDGE_HTTP: Final = "edge-http"
STACK_FLOOR: Final = "stack-floor"
IOP: Final = "iop"
IOP_TRANSLATED: Final = "iop-translated"
LITELLM: Final = "litellm"
VLLM_ROUTER: Final = "vllm-router"
ALL_TARGETS: Final = (
    DIRECT,
    HYPERCORN,
    EDGE_HTTP,
    STACK_FLOOR,
    IOP,
    IOP_TRANSLATED,
    LITELLM,
    VLLM_ROUTER,
)
TARGET_LABELS: Final = {
    DIRECT: "direct",
    HYPERCORN: "Hypercorn",
    EDGE_HTTP: "Edge HTTP",
    STACK_FLOOR: "Stack floor",
    IOP: "IOP",
    IOP_TRANSLATED: "IOP transl.",
    LITELLM: "LiteLLM",
    VLLM_ROUTER: "vllm-router",
}
#: The processes each target is made of, by the name the report gives them.
PROCESSES: Final = {
    DIRECT: ("upstream",),
    HYPERCORN: ("hypercorn",),
    EDGE_HTTP: ("server",),
    STACK_FLOOR: ("front", "back"),
    IOP: ("edge", "node"),
    IOP_TRANSLATED: ("edge", "node"),
    LITELLM: ("proxy",),
    VLLM_ROUTER: ("router",),
}
_EVERY_PROTOCOL: Final[dict[Protocol, str]] = {protocol: MODEL for protocol in PROTOCOLS}
_CHAT: Final[dict[Protocol, str]] = {"chat": MODEL}
_TRANSLATED: Final[dict[Protocol, str]] = {
    "messages": MODEL_TRANSLATED,
    "responses": MODEL_TRANSLATED,
}
#: The protocols each target is measured under, and the model its requests name in
#: each. The floors and the router relay chat only; the upstream (direct) and IOP
#: (natively) serve all three with `bench-model`; `iop-translated` and LiteLLM take
#: Messages and Responses for `bench-model-translated`, a model each is set up to
#: serve from a chat-only upstream (IOP: `adapter.protocols: [chat]`; LiteLLM: its
#: `custom_openai/` provider), so each translates them to chat completions and back.
TARGET_MODELS: Final[dict[str, dict[Protocol, str]]] = {
    DIRECT: _EVERY_PROTOCOL,
    HYPERCORN: _CHAT,
    EDGE_HTTP: _CHAT,
    STACK_FLOOR: _CHAT,
    IOP: _EVERY_PROTOCOL,
    IOP_TRANSLATED: _TRANSLATED,
    LITELLM: {**_CHAT, **_TRANSLATED},
    VLLM_ROUTER: _CHAT,
}


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
    measurements: tuple[Measurement, ...] = ()
    """The closed-loop scenarios."""
    fleet: tuple[FleetMeasurement, ...] = ()
    """The fleet-shaped stream scenario, one per target."""
    many_nodes: ManyNodesMeasurement | None = None
    agent_cache: AgentCacheMeasurement | None = None
    notes: tuple[str, ...] = ()
    """Why a target was skipped, and the like; printed under the tables."""
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

    def fleet_of(self, target: str) -> FleetMeasurement | None:
        for m in self.fleet:
            if m.target == target:
                return m
        return None


# --- derived numbers ------------------------------------------------------------------------------


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


def cpu_ratio(result: BenchResult, target: str, baseline: str, scenario: Scenario) -> float | None:
    """`target`'s CPU per request (all its processes) over `baseline`'s."""
    measured, base = result.get(target, scenario), result.get(baseline, scenario)
    if measured is None or base is None:
        return None
    mine, theirs = measured.cpu_ms_per_request, base.cpu_ms_per_request
    if mine is None or not theirs:
        return None
    return mine / theirs


@dataclass(frozen=True, slots=True)
class TurnRatios:
    """`target`'s CPU per request over `baseline`'s, turn by turn (each turn measures
    both within the same minute): the median and the range of the per-turn ratios."""

    median: float
    low: float
    high: float
    turns: int


def cpu_ratio_by_turn(
    result: BenchResult, target: str, baseline: str, scenario: Scenario
) -> TurnRatios | None:
    """The per-turn ratios of `target`'s CPU per request over `baseline`'s (None when
    either lacks per-turn CPU or their turns differ in number). A turn in which the
    machine was busier weighs on both of its numbers; the median then leaves out a turn
    in which it weighed on one more than on the other, where the ratio of the sums
    would carry it."""
    measured, base = result.get(target, scenario), result.get(baseline, scenario)
    if measured is None or base is None:
        return None
    mine, theirs = measured.turn_cpu_ms, base.turn_cpu_ms
    if not mine or len(mine) != len(theirs) or not all(theirs):
        return None
    ratios = sorted(a / b for a, b in zip(mine, theirs, strict=True))
    return TurnRatios(statistics.median(ratios), ratios[0], ratios[-1], len(ratios))


def added_token_delay_ms(result: BenchResult, target: str, q: float) -> float | None:
    """The q-th percentile token delay through `target` minus the direct one, in ms."""
    measured, direct = result.fleet_of(target), result.fleet_of(DIRECT)
    if measured is None or direct is None:
        return None
    mine, floor = measured.delay_ms(q), direct.delay_ms(q)
    return None if mine is None or floor is None else mine - floor


def added_gap_ms(result: BenchResult, target: str, q: float) -> float | None:
    """The q-th percentile gap between tokens through `target` minus the direct one."""
    measured, direct = result.fleet_of(target), result.fleet_of(DIRECT)
    if measured is None or direct is None:
        return None
    mine, floor = measured.gap_ms(q), direct.gap_ms(q)
    return None if mine is None or floor is None else mine - floor
