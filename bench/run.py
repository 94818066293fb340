"""`python -m bench` (`just bench`): measure IOP against a direct upstream and LiteLLM.

One command, one run: it starts the fast fake upstream, an IOP Edge and Node in front of
it, and LiteLLM's proxy when installed (`bench.litellm_proxy` says how), each in its own
process; then, for every scenario (concurrency x stream/non-stream), it measures each
target in turn with the closed-loop generator in this process, prints one table and the
issue's targets as PASS/MISS, stops every child and exits 0.

    python -m bench [--duration S | --requests N] [--concurrency 1,32]
                    [--only direct,hypercorn,iop,litellm] [--warmup N] [--json FILE]
                    [--profile DIR [--profile-format flamegraph|speedscope|raw]]
    python -m bench --replicas [ROUNDS] [--duration S] [--concurrency 32]

`--profile DIR` attaches `py-spy record` (when on PATH; it is not a dependency) to the
Edge and the Node while the scenarios run and writes `edge.*` and `node.*` there; run it
with `--only iop` for a profile of IOP alone. Sampling costs CPU, so the numbers of a
profiled run are not the ones to quote.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import trio
from rich.console import Console

from bench.asgi_floor import READY_PREFIX as FLOOR_READY_PREFIX
from bench.gateway import start_gateway
from bench.litellm_proxy import find_litellm, start_litellm
from bench.load import (
    Budget,
    Measurement,
    Scenario,
    Target,
    cpu_seconds,
    measure,
    open_client,
)
from bench.profiler import FORMATS, find_py_spy, start_profilers
from bench.replicas import render_replicas, run_replicas_bench
from bench.report import (
    DIRECT,
    HYPERCORN,
    IOP,
    LITELLM,
    TARGET_LABELS,
    BenchResult,
    Machine,
    render,
    to_json,
)
from bench.services import Service, ServiceFailed, python_argv, start_service
from bench.upstream import READY_PREFIX

ALL_TARGETS: Final = (DIRECT, HYPERCORN, IOP, LITELLM)
_UPSTREAM_START_S: Final = 30.0
_GATEWAY_START_S: Final = 60.0
_LITELLM_START_S: Final = 180.0
_REPORT_WIDTH: Final = 120
#: Before measuring, the started targets must go quiet (below this share of one core
#: over a window): LiteLLM keeps working for a while after it answers its readiness
#: probe, and that work would land on whichever target is measured first.
_QUIET_CPU_SHARE: Final = 0.03
_QUIET_WINDOW_S: Final = 0.5
_QUIET_WAIT_MAX_S: Final = 60.0

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class BenchOptions:
    budget: Budget = field(default_factory=Budget)
    concurrency: tuple[int, ...] = (1, 32)
    only: tuple[str, ...] = ALL_TARGETS
    profile_dir: Path | None = None
    profile_format: str = "flamegraph"

    def scenarios(self) -> list[Scenario]:
        return [
            Scenario(concurrency=c, stream=stream)
            for c in self.concurrency
            for stream in (False, True)
        ]

    def settings(self) -> dict[str, object]:
        budget = self.budget
        length = (
            f"{budget.requests} requests"
            if budget.requests is not None
            else f"{budget.duration_s:g} s"
        )
        return {"per scenario": length, "warm-up": f"{budget.warmup_requests} requests"}


def _ready_line(prefix: str) -> Callable[[str], str | None]:
    """Readiness of a service that prints `prefix` + its URL once accepting: the URL."""

    def ready(line: str) -> str | None:
        return line.removeprefix(prefix) if line.startswith(prefix) else None

    return ready


async def run_bench(
    options: BenchOptions, workdir: Path, progress: Progress | None = None
) -> BenchResult:
    """Start every target, measure every scenario on each, stop everything, return numbers.

    `workdir` receives the generated configs and the Edge's state; `progress` gets one
    line per step (what started where, each scenario's headline numbers)."""
    say = progress or (lambda _: None)
    notes: list[str] = []
    async with trio.open_nursery() as services:
        with trio.fail_after(_UPSTREAM_START_S):
            upstream = await start_service(
                services, "bench-upstream", python_argv("bench.upstream"), _ready_line(READY_PREFIX)
            )
        say(f"upstream: {upstream.ready} (pid {upstream.pid})")
        targets: list[Target] = []
        if DIRECT in options.only:
            targets.append(Target(DIRECT, upstream.ready, (upstream.pid,)))
        if HYPERCORN in options.only:
            with trio.fail_after(_UPSTREAM_START_S):
                floor = await start_service(
                    services,
                    "bench-asgi-floor",
                    python_argv("bench.asgi_floor"),
                    _ready_line(FLOOR_READY_PREFIX),
                )
            say(f"hypercorn floor: {floor.ready} (pid {floor.pid})")
            targets.append(Target(HYPERCORN, floor.ready, (floor.pid,)))
        profiled: dict[str, int] = {}
        if IOP in options.only:
            with trio.fail_after(_GATEWAY_START_S):
                gateway = await start_gateway(services, upstream.ready, workdir)
            say(
                f"iop: {gateway.openai_url} (edge pid {gateway.edge.pid}, "
                f"node pid {gateway.node.pid})"
            )
            targets.append(Target(IOP, gateway.openai_url, tuple(gateway.pids.values())))
            profiled = gateway.pids
        if LITELLM in options.only:
            litellm = await _start_litellm(services, upstream.ready, workdir, notes, say)
            if litellm is not None:
                targets.append(Target(LITELLM, litellm.ready, (litellm.pid,)))
        await _wait_until_quiet(targets, notes, say)
        async with trio.open_nursery() as profilers:
            if options.profile_dir is not None:
                await _start_profilers(profilers, options, profiled, notes, say)
            measurements = await _measure_all(options, targets, say)
            profilers.cancel_scope.cancel()
        services.cancel_scope.cancel()
    return BenchResult(
        machine=Machine.this(),
        measurements=tuple(measurements),
        notes=tuple(notes),
        settings=options.settings(),
    )


async def _start_litellm(
    services: trio.Nursery, upstream_root: str, workdir: Path, notes: list[str], say: Progress
) -> Service[str] | None:
    executable = find_litellm()
    if executable is None:
        note = "litellm: not installed, skipped (see bench/litellm_proxy.py to enable it)"
        notes.append(note)
        say(note)
        return None
    say(f"litellm: starting {executable} (takes a few seconds)")
    try:
        with trio.fail_after(_LITELLM_START_S):
            service = await start_litellm(services, executable, upstream_root, workdir)
    except trio.TooSlowError:
        note = f"litellm: not ready within {_LITELLM_START_S:g} s, skipped"
        notes.append(note)
        say(note)
        return None
    except ServiceFailed as exc:
        note = f"litellm: failed to start, skipped: {exc}"
        notes.append(note)
        say(note)
        return None
    say(f"litellm: {service.ready} (pid {service.pid})")
    return service


async def _wait_until_quiet(targets: Sequence[Target], notes: list[str], say: Progress) -> None:
    """Wait (bounded) until the started targets use next to no CPU while idle."""
    pids = tuple(pid for target in targets for pid in target.pids)
    started = trio.current_time()
    with trio.move_on_after(_QUIET_WAIT_MAX_S):
        while True:
            before = await cpu_seconds(pids)
            await trio.sleep(_QUIET_WINDOW_S)
            after = await cpu_seconds(pids)
            if before is None or after is None:
                return  # no /proc: nothing to wait on
            if after - before <= _QUIET_CPU_SHARE * _QUIET_WINDOW_S:
                waited = trio.current_time() - started
                if waited > 2 * _QUIET_WINDOW_S:
                    say(f"targets idle after {waited:.1f} s")
                return
    note = f"targets still busy after {_QUIET_WAIT_MAX_S:g} s idle; measured anyway"
    notes.append(note)
    say(note)


async def _measure_all(
    options: BenchOptions, targets: Sequence[Target], say: Progress
) -> list[Measurement]:
    clients = {t.name: open_client(max(options.concurrency)) for t in targets}
    measurements: list[Measurement] = []
    try:
        for scenario in options.scenarios():
            for target in targets:
                m = await measure(clients[target.name], target, scenario, options.budget)
                measurements.append(m)
                p50 = f"{m.p50_ms:.2f} ms" if m.p50_ms is not None else "-"
                rps = f"{m.rps:.0f} req/s" if m.rps is not None else "-"
                cpu = m.cpu_ms_per_request
                cost = f"{cpu:.2f} ms CPU/req" if cpu is not None else ""
                say(
                    f"{scenario.label:<16} {TARGET_LABELS[target.name]:<8} "
                    f"p50 {p50:>10}  {rps:>11}  {cost:>16}  ok {m.ok}  errors {m.errors}"
                )
    finally:
        with trio.move_on_after(5, shield=True):
            for client in clients.values():
                await client.aclose()
    return measurements


async def _start_profilers(
    profilers: trio.Nursery,
    options: BenchOptions,
    pids: dict[str, int],
    notes: list[str],
    say: Progress,
) -> None:
    py_spy = find_py_spy()
    if py_spy is None or options.profile_dir is None:
        notes.append("profile: py-spy not found (pip install py-spy), not profiled")
        return
    if not pids:
        notes.append("profile: IOP is not among the targets, nothing to profile")
        return
    outputs = await start_profilers(
        profilers, py_spy, pids, options.profile_dir, options.profile_format
    )
    for (name, pid), output in zip(pids.items(), outputs, strict=True):
        notes.append(f"profile: {name} (pid {pid}) -> {output}")
        say(f"profiling {name} (pid {pid}) -> {output}")


# --- command line ------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("concurrency values must be >= 1")
    return values


def _targets(text: str) -> tuple[str, ...]:
    names = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in ALL_TARGETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown target(s) {', '.join(unknown) or '(none)'}; choose from "
            + ", ".join(ALL_TARGETS)
        )
    return tuple(name for name in ALL_TARGETS if name in names)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure IOP against a direct upstream and LiteLLM's proxy (if installed).",
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument(
        "--duration", type=float, default=4.0, metavar="S", help="seconds per scenario (4)"
    )
    length.add_argument(
        "--requests", type=int, default=None, metavar="N", help="requests per scenario instead"
    )
    parser.add_argument(
        "--concurrency", type=_int_list, default=(1, 32), metavar="C,C", help="(1,32)"
    )
    parser.add_argument(
        "--only", type=_targets, default=ALL_TARGETS, metavar="T,T",
        help="targets among direct,iop,litellm (all)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup", type=int, default=50, metavar="N", help="warm-up requests per scenario (50)"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the numbers here")
    parser.add_argument(
        "--profile", type=Path, metavar="DIR", help="py-spy the Edge and Node into DIR"
    )
    parser.add_argument("--profile-format", choices=FORMATS, default="flamegraph")
    parser.add_argument(
        "--replicas",
        type=int,
        nargs="?",
        const=2,
        default=None,
        metavar="ROUNDS",
        help="instead: one Edge vs two Edge replicas as workers on one host, non-stream at "
        "the highest --concurrency, measured in turns ROUNDS times (2; bench/replicas.py)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        budget = Budget(
            requests=args.requests, duration_s=args.duration, warmup_requests=args.warmup
        )
    except ValueError as exc:
        parser.error(str(exc))
    options = BenchOptions(
        budget=budget,
        concurrency=args.concurrency,
        only=args.only,
        profile_dir=args.profile,
        profile_format=args.profile_format,
    )
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, _REPORT_WIDTH)  # a pipe or CI log: room for the table
    status = Console(stderr=True)

    def say(line: str) -> None:
        status.print(line, highlight=False, markup=False, soft_wrap=True)

    if args.replicas is not None:
        return _replicas(options, args.replicas, console, say)
    try:
        with tempfile.TemporaryDirectory(prefix="iop-bench-") as workdir:
            result = trio.run(run_bench, options, Path(workdir), say)
    except KeyboardInterrupt:
        return 130
    console.print(render(result))
    if args.json is not None:
        args.json.write_text(to_json(result), encoding="utf-8")
    return 0


def _replicas(options: BenchOptions, rounds: int, console: Console, say: Progress) -> int:
    scenarios = [Scenario(concurrency=max(options.concurrency), stream=False)]
    try:
        with tempfile.TemporaryDirectory(prefix="iop-bench-") as workdir:
            setups = trio.run(
                run_replicas_bench, scenarios, options.budget, Path(workdir), say, max(rounds, 1)
            )
    except KeyboardInterrupt:
        return 130
    console.print(render_replicas(setups, Machine.this().cores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
