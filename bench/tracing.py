"""`python -m bench --tracing`: what OpenTelemetry traces cost the Edge and the Node.

Three set-ups of one Edge and one Node each (`bench.gateway`, every one its own pair of
processes), in front of the same fake upstream, all started at once and measured in
turns (off, off again, on; then again), so a machine whose speed drifts treats them
alike:

- *tracing off*: no endpoint (the default); the Edge and the Node hold no tracer.
- *tracing off, again*: the same, a second pair: the difference between the two off
  pairs is the noise floor of the measurement, what "nothing measurable" is held to.
- *tracing on, 100 %*: `OTEL_EXPORTER_OTLP_ENDPOINT` at a local receiver
  (`bench.otlp_sink`, its own process) and `OTEL_TRACES_SAMPLER=always_on`: every
  request is traced, three spans (the Edge's, the Node's attempt, the upstream call),
  each exported in batches by the SDK's thread in the process that made it.

The cost is CPU per request: the Edge's and the Node's CPU time (user + system, from
/proc) during a measured phase, over the requests it served. The report gives, per
scenario and set-up, the median over the turns, and each against tracing off: the median
of both off pairs' turns together (so one slow off turn does not make tracing look cheap).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio
from rich.table import Table

from bench.gateway import Gateway, start_gateway
from bench.load import Budget, Measurement, Scenario, Target, measure, open_client
from bench.otlp_sink import READY_PREFIX
from bench.services import python_argv, start_service, url_after
from bench.upstream import start_upstream

__all__ = ["TracingTurn", "render_tracing", "run_tracing_bench"]

_START_S: Final = 60.0
OFF: Final = "tracing off"
OFF_AGAIN: Final = "tracing off, again"
ON: Final = "tracing on, 100 %"
SETUPS: Final = (OFF, OFF_AGAIN, ON)
#: Off means off whatever the bench's own environment holds.
_OFF_ENV: Final[Mapping[str, str]] = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",
}


@dataclass(frozen=True, slots=True)
class TracingTurn:
    setup: str
    turn: int
    measurement: Measurement

    def cpu_ms(self, process: str | None = None) -> float | None:
        """CPU ms per request of the Edge, the Node (`process`), or both (None)."""
        return self.measurement.process_cpu_ms_per_request(process)


def _on_env(sink_url: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": sink_url,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_SDK_DISABLED": "",
    }


async def run_tracing_bench(
    scenarios: Sequence[Scenario],
    budget: Budget,
    workdir: Path,
    say: Callable[[str], None],
    rounds: int = 3,
) -> list[TracingTurn]:
    """Start the upstream, the sink and the three set-ups; measure them in turns."""
    turns: list[TracingTurn] = []
    async with trio.open_nursery() as services:
        with trio.fail_after(_START_S):
            upstream = await start_upstream(services)
            sink = await start_service(
                services, "otlp-sink", python_argv("bench.otlp_sink"), url_after(READY_PREFIX)
            )
            gateways: dict[str, Gateway] = {}
            for index, name in enumerate(SETUPS):
                env = _on_env(sink.ready) if name == ON else dict(_OFF_ENV)
                gateways[name] = await start_gateway(
                    services, upstream.ready, workdir / f"setup-{index}", env=env
                )
        say(f"upstream {upstream.ready}; spans to {sink.ready}")
        for turn in range(1, rounds + 1):
            for scenario in scenarios:
                for name in SETUPS:
                    gateway = gateways[name]
                    target = Target(name, gateway.openai_url, gateway.processes)
                    client = open_client(scenario.concurrency)
                    try:
                        measurement = await measure(client, target, scenario, budget)
                    finally:
                        await client.aclose()
                    result = TracingTurn(name, turn, measurement)
                    turns.append(result)
                    say(
                        f"turn {turn}: {name:<20} {scenario.label:<18} "
                        f"{measurement.rps or 0:.0f} req/s, "
                        f"{result.cpu_ms() or 0:.3f} CPU ms/req (edge+node)"
                    )
        services.cancel_scope.cancel()
    return turns


def _median(turns: Sequence[TracingTurn], process: str | None) -> float | None:
    values = [v for t in turns if (v := t.cpu_ms(process)) is not None]
    return statistics.median(values) if values else None


def render_tracing(turns: Sequence[TracingTurn], cores: int) -> Table:
    """Per scenario and set-up: the median CPU per request over the turns, and against
    tracing off."""
    table = Table(title=f"What tracing costs: CPU per request, median of turns ({cores} cores)")
    for column in ("scenario", "setup", "turns", "req/s", "edge ms", "node ms", "total ms"):
        table.add_column(column, justify="left" if column in ("scenario", "setup") else "right")
    table.add_column("vs off")
    scenarios = list(dict.fromkeys(t.measurement.scenario for t in turns))
    for scenario in scenarios:
        off = [t for t in turns if t.setup != ON and t.measurement.scenario == scenario]
        base = _median(off, None)
        for name in SETUPS:
            mine = [t for t in turns if t.setup == name and t.measurement.scenario == scenario]
            total = _median(mine, None)
            rps = statistics.median(t.measurement.rps or 0.0 for t in mine) if mine else 0.0
            edge, node = _median(mine, "edge"), _median(mine, "node")
            ratio = f"{(total / base - 1) * 100:+.1f} %" if total and base else ""
            table.add_row(
                scenario.label,
                name,
                str(len(mine)),
                f"{rps:.0f}",
                f"{edge:.3f}" if edge is not None else "-",
                f"{node:.3f}" if node is not None else "-",
                f"{total:.3f}" if total is not None else "-",
                ratio,
            )
    return table
