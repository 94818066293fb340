"""`python -m bench` (`just bench`): measure IOP against a direct upstream and its peers.

One command, one run, in up to five parts (`--parts`), each starting and stopping its
own processes so no part's servers weigh on another's:

- `closed`: the fast fake upstream, the two HTTP floors (stock Hypercorn and the Edge's
  own HTTP server answering by themselves: `bench.asgi_floor`), the stack floor (IOP's
  transport parts relaying with none of its logic: `bench.stack_floor`), an IOP Edge and
  Node in front of the upstream, and the peers when installed (LiteLLM's proxy:
  `bench.litellm_proxy`; vLLM's Rust router: `bench.vllm_router`), each in its own
  process; for every scenario (caller protocol x concurrency x stream/non-stream) each
  target that serves the protocol is measured in turn by the closed-loop generator in
  this process (`bench.load`). Anthropic Messages and OpenAI Responses go to the
  upstream directly, to IOP natively (`iop`) and translated on the Node
  (`iop-translated`), and to LiteLLM's `/v1/messages` and `/v1/responses`.
- `fleet`: the fleet-shaped stream scenario (`bench.fleet`): the paced upstream, then
  each fleet target in turn (started, measured, stopped).
- `nodes`: many light Nodes on one Edge (`bench.many_nodes`).
- `agent-cache`: a Claude-Code-shaped conversation through IOP to an upstream with a
  prompt prefix cache, with Claude Code's attribution block removed and kept
  (`bench.agent_cache`).
- `affinity`: agent sessions over providers with prefix caches, routed by load only and
  with cache affinity, in process on virtual time; and the routing decision's CPU over
  3,000 providers (`bench.affinity`). Its table comes first, on its own.
- `models`: many models over providers that hold only some at once, routed by load only
  and with placement, in process on virtual time (`bench.many_models`); on its own too.

It prints the tables and the performance targets as PASS/MISS, stops every child and exits 0.
`--replicas [ROUNDS]` measures one Edge against two replicas sharing the caller port
(`bench.replicas`) instead; `--tracing [ROUNDS]` the CPU per request of OpenTelemetry
traces, off against on at 100 % sampling (`bench.tracing`).

    python -m bench [--parts closed,fleet,nodes,agent-cache,affinity,models]
                    [--duration S | --requests N] [--concurrency 1,32] [--warmup N] [--turns 4]
                    [--protocols chat,messages,responses]
                    [--only direct,hypercorn,edge-http,stack-floor,iop,iop-translated,
                            litellm,vllm-router]
                    [--fleet-only direct,iop,vllm-router] [--streams 100]
                    [--tokens-per-second 10] [--stream-tokens 30] [--window 5]
                    [--nodes 1000] [--providers-per-node 3] [--idle-window 10]
                    [--node-processes 1] [--caller-rate 50] [--light-nodes-niceness 10]
                    [--agent-turns 6] [--prefill-us-per-token 200]
                    [--json FILE] [--profile DIR [--profile-format flamegraph|speedscope|raw]]
    python -m bench --replicas [ROUNDS] [--duration S] [--concurrency 32]
    python -m bench --tracing [ROUNDS] [--duration S] [--concurrency 32]

`--profile DIR` attaches `py-spy record` (when on PATH; it is not a dependency) to the
Edge and the Node while the closed-loop scenarios run and writes `edge.*` and `node.*`
there; run it with `--parts closed --only iop` for a profile of IOP alone. Sampling
costs CPU, so the numbers of a profiled run are not the ones to quote.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final, TypeVar

import trio
from rich.console import Console

from bench.agent_cache import AgentCacheMeasurement, AgentCacheShape, measure_agent_cache
from bench.asgi_floor import READY_PREFIX as FLOOR_READY_PREFIX
from bench.fleet import FleetMeasurement, FleetShape, measure_fleet
from bench.gateway import CAPACITY, start_gateway
from bench.litellm_proxy import find_litellm, start_litellm
from bench.load import (
    PROTOCOLS,
    Budget,
    Measurement,
    Protocol,
    Scenario,
    Target,
    combined,
    measure,
    open_client,
)
from bench.many_nodes import ManyNodesMeasurement, ManyNodesShape, measure_many_nodes
from bench.procfs import cpu_seconds
from bench.profiler import FORMATS, find_py_spy, start_profilers
from bench.replicas import render_replicas, run_replicas_bench
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
    TARGET_LABELS,
    TARGET_MODELS,
    VLLM_ROUTER,
    BenchResult,
    Machine,
)
from bench.services import Service, ServiceFailed, python_argv, start_service, url_after
from bench.stack_floor import start_stack_floor
from bench.upstream import start_upstream
from bench.vllm_router import find_vllm_router, start_vllm_router

_T = TypeVar("_T")

CLOSED: Final = "closed"
FLEET: Final = "fleet"
NODES: Final = "nodes"
AGENT_CACHE: Final = "agent-cache"
AFFINITY: Final = "affinity"
MODELS: Final = "models"
ALL_PARTS: Final = (CLOSED, FLEET, NODES, AGENT_CACHE, AFFINITY, MODELS)
#: The fleet scenario's targets unless `--fleet-only` says otherwise. LiteLLM is left out:
#: at ~1.7 ms of CPU per relayed chunk (closed-loop stream column) it would need ~1.7
#: cores for the default 1,000 chunks/s, and would only measure its own backlog.
DEFAULT_FLEET_TARGETS: Final = (DIRECT, IOP, VLLM_ROUTER)
FLEET_TARGETS: Final = (DIRECT, IOP, LITELLM, VLLM_ROUTER)
_UPSTREAM_START_S: Final = 30.0
_GATEWAY_START_S: Final = 60.0
_PEER_START_S: Final = 180.0
#: A thousand Nodes: the Edge parses a large config, a thousand handshakes, a refresh.
_NODES_DEADLINE_S: Final = 900.0
#: Beyond the agent conversation's own prefill time: two processes' startup and a slow machine.
_AGENT_CACHE_SLACK_S: Final = 120.0
#: Beyond the fleet measurement's own schedule: slow warm-up streams, slow process reads.
_FLEET_SLACK_S: Final = 120.0
_REPORT_WIDTH: Final = 130
#: Before measuring, the started targets must go quiet (below this share of one core
#: over a window): LiteLLM keeps working for a while after it answers its readiness
#: probe, and that work would land on whichever target is measured first.
_QUIET_CPU_SHARE: Final = 0.03
_QUIET_WINDOW_S: Final = 0.5
_QUIET_WAIT_MAX_S: Final = 60.0

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class BenchOptions:
    parts: tuple[str, ...] = ALL_PARTS
    budget: Budget = field(default_factory=Budget)
    concurrency: tuple[int, ...] = (1, 32)
    protocols: tuple[Protocol, ...] = PROTOCOLS
    only: tuple[str, ...] = ALL_TARGETS
    fleet_only: tuple[str, ...] = DEFAULT_FLEET_TARGETS
    fleet: FleetShape = field(default_factory=FleetShape)
    nodes: ManyNodesShape = field(default_factory=ManyNodesShape)
    agent_cache: AgentCacheShape = field(default_factory=AgentCacheShape)
    profile_dir: Path | None = None
    profile_format: str = "flamegraph"

    def scenarios(self) -> list[Scenario]:
        return [
            Scenario(concurrency=c, stream=stream, protocol=protocol)
            for protocol in self.protocols
            for c in self.concurrency
            for stream in (False, True)
        ]

    def settings(self) -> dict[str, object]:
        settings: dict[str, object] = {}
        if CLOSED in self.parts:
            budget = self.budget
            length = (
                f"{budget.requests} requests"
                if budget.requests is not None
                else f"{budget.duration_s:g} s"
            )
            settings["per scenario"] = length
            settings["turns"] = f"{budget.turns}, the targets interleaved"
            settings["warm-up"] = f"{budget.warmup_requests} requests a turn"
            settings["protocols"] = ",".join(self.protocols)
        if FLEET in self.parts:
            settings["fleet"] = self.fleet.label
        if NODES in self.parts:
            settings["nodes"] = f"{self.nodes.nodes} x {self.nodes.providers_per_node} providers"
        if AGENT_CACHE in self.parts:
            settings["agent cache"] = self.agent_cache.label
        return settings


async def run_bench(
    options: BenchOptions, workdir: Path, progress: Progress | None = None
) -> BenchResult:
    """Run every part of `options`, each with its own processes; return the numbers.

    `workdir` receives the generated configs and the Edge's state; `progress` gets one
    line per step (what started where, each measurement's headline numbers)."""
    say = progress or (lambda _: None)
    load_at_start = _load_average()
    notes: list[str] = []
    measurements: list[Measurement] = []
    fleet: list[FleetMeasurement] = []
    many_nodes: ManyNodesMeasurement | None = None
    agent_cache: AgentCacheMeasurement | None = None
    if CLOSED in options.parts:
        measurements = await _run_closed_loop(options, workdir / "closed", notes, say)
    if FLEET in options.parts:
        fleet = await _run_fleet(options, workdir / "fleet", notes, say)
    if NODES in options.parts:
        many_nodes = await _run_many_nodes(options.nodes, workdir / "nodes", notes, say)
    if AGENT_CACHE in options.parts:
        agent_cache = await _run_agent_cache(
            options.agent_cache, workdir / "agent-cache", notes, say
        )
    settings = options.settings()
    if load_at_start is not None and (load_at_end := _load_average()) is not None:
        # Other work on the machine inflates every number; this says how much there was.
        settings["load average (1 min) at start/end"] = f"{load_at_start:.1f}/{load_at_end:.1f}"
    return BenchResult(
        machine=Machine.this(),
        measurements=tuple(measurements),
        fleet=tuple(fleet),
        many_nodes=many_nodes,
        agent_cache=agent_cache,
        notes=tuple(notes),
        settings=settings,
    )


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None


# --- starting targets -----------------------------------------------------------------------------


async def _start_upstream(services: trio.Nursery, *args: str) -> Service[str]:
    with trio.fail_after(_UPSTREAM_START_S):
        return await start_upstream(services, *args)


def _skip(notes: list[str], say: Progress, note: str) -> None:
    notes.append(note)
    say(note)


async def _start_target(
    services: trio.Nursery,
    name: str,
    upstream: Service[str],
    workdir: Path,
    *,
    notes: list[str],
    say: Progress,
    capacity: int = CAPACITY,
    started: Sequence[Target] = (),
) -> Target | None:
    """Start target `name` in front of `upstream` (None, with a note, when it cannot be).
    `iop-translated` is the IOP target of `started` asked for another model, or an IOP
    started for it."""
    await trio.Path(workdir).mkdir(parents=True, exist_ok=True)
    models = TARGET_MODELS[name]
    if name == DIRECT:
        return Target(DIRECT, upstream.ready, {"upstream": upstream.pid}, models)
    if name in (HYPERCORN, EDGE_HTTP):
        server, process = ("hypercorn", "hypercorn") if name == HYPERCORN else ("edge", "server")
        with trio.fail_after(_UPSTREAM_START_S):
            floor = await start_service(
                services,
                f"bench-asgi-floor-{server}",
                python_argv("bench.asgi_floor", "--server", server),
                url_after(FLOOR_READY_PREFIX),
            )
        say(f"{name} floor: {floor.ready} (pid {floor.pid})")
        return Target(name, floor.ready, {process: floor.pid})
    if name == STACK_FLOOR:
        with trio.fail_after(_GATEWAY_START_S):
            stack = await start_stack_floor(services, upstream.ready)
        say(f"{name}: {stack.url} (front pid {stack.front.pid}, back pid {stack.back.pid})")
        return Target(STACK_FLOOR, stack.url, stack.processes)
    if name == IOP_TRANSLATED:
        iop = next((target for target in started if target.name == IOP), None)
        if iop is None:
            iop = await _start_target(
                services, IOP, upstream, workdir, notes=notes, say=say, capacity=capacity
            )
        assert iop is not None
        return Target(IOP_TRANSLATED, iop.root_url, iop.processes, models)
    if name == IOP:
        with trio.fail_after(_GATEWAY_START_S):
            gateway = await start_gateway(services, upstream.ready, workdir, capacity=capacity)
        say(f"iop: {gateway.openai_url} (edge pid {gateway.edge.pid}, node pid {gateway.node.pid})")
        return Target(IOP, gateway.openai_url, gateway.processes, models)
    if name == LITELLM:
        service = await _start_peer(
            name,
            find_litellm(),
            howto="bench/litellm_proxy.py",
            notes=notes,
            say=say,
            start=lambda exe: start_litellm(services, exe, upstream.ready, workdir),
        )
        if service is None:
            return None
        return Target(LITELLM, service.ready, {"proxy": service.pid}, models)
    if name == VLLM_ROUTER:
        service = await _start_peer(
            name,
            find_vllm_router(),
            howto="bench/vllm_router.py",
            notes=notes,
            say=say,
            start=lambda exe: start_vllm_router(services, exe, upstream.ready),
        )
        if service is None:
            return None
        return Target(VLLM_ROUTER, service.ready, {"router": service.pid})
    raise ValueError(f"unknown target {name!r}")


async def _start_peer(
    name: str,
    executable: str | None,
    *,
    howto: str,
    notes: list[str],
    say: Progress,
    start: Callable[[str], Awaitable[Service[str]]],
) -> Service[str] | None:
    """Start an optional peer gateway; None, with a note saying why, when it cannot be."""
    if executable is None:
        _skip(notes, say, f"{name}: not installed, skipped (see {howto} to enable it)")
        return None
    say(f"{name}: starting {executable}")
    try:
        with trio.fail_after(_PEER_START_S):
            service = await start(executable)
    except trio.TooSlowError:
        _skip(notes, say, f"{name}: not ready within {_PEER_START_S:g} s, skipped")
        return None
    except ServiceFailed as exc:
        _skip(notes, say, f"{name}: failed to start, skipped: {exc}")
        return None
    say(f"{name}: {service.ready} (pid {service.pid})")
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
    _skip(notes, say, f"targets still busy after {_QUIET_WAIT_MAX_S:g} s idle; measured anyway")


# --- the closed-loop part -------------------------------------------------------------------------


async def _run_closed_loop(
    options: BenchOptions, workdir: Path, notes: list[str], say: Progress
) -> list[Measurement]:
    async with trio.open_nursery() as services:
        upstream = await _start_upstream(services)
        say(f"upstream: {upstream.ready} (pid {upstream.pid})")
        targets: list[Target] = []
        for name in options.only:
            if not TARGET_MODELS[name].keys() & set(options.protocols):
                continue  # serves none of the run's protocols
            target = await _start_target(
                services, name, upstream, workdir / name, notes=notes, say=say, started=targets
            )
            if target is not None:
                targets.append(target)
        await _wait_until_quiet(targets, notes, say)
        profiled = next((dict(t.processes) for t in targets if t.name == IOP), {})
        async with trio.open_nursery() as profilers:
            if options.profile_dir is not None:
                await _start_profilers(profilers, options, profiled, notes, say)
            measurements = await _measure_all(options, targets, say)
            profilers.cancel_scope.cancel()
        services.cancel_scope.cancel()
    return measurements


async def _measure_all(
    options: BenchOptions, targets: Sequence[Target], say: Progress
) -> list[Measurement]:
    """Every target under every scenario, in `budget.turns` turns: each turn measures
    every scenario of every target once (`Budget.per_turn`); a target's turns are then
    combined into one measurement per scenario."""
    clients = {t.name: open_client(max(options.concurrency)) for t in targets}
    budget = options.budget
    per_turn = budget.per_turn()
    turns: dict[tuple[str, Scenario], list[Measurement]] = defaultdict(list)
    try:
        for turn in range(1, budget.turns + 1):
            of = f"turn {turn}/{budget.turns} " if budget.turns > 1 else ""
            for scenario in options.scenarios():
                for target in targets:
                    if scenario.protocol not in target.models:
                        continue
                    m = await measure(clients[target.name], target, scenario, per_turn)
                    turns[target.name, scenario].append(m)
                    p50 = f"{m.p50_ms:.2f} ms" if m.p50_ms is not None else "-"
                    rps = f"{m.rps:.0f} req/s" if m.rps is not None else "-"
                    cpu = m.cpu_ms_per_request
                    cost = f"{cpu:.2f} ms CPU/req" if cpu is not None else ""
                    say(
                        f"{of}{scenario.label:<26} {TARGET_LABELS[target.name]:<11} "
                        f"p50 {p50:>10}  {rps:>11}  {cost:>16}  ok {m.ok}  errors {m.errors}"
                    )
    finally:
        with trio.move_on_after(5, shield=True):
            for client in clients.values():
                await client.aclose()
    return [
        combined(turns[t.name, s])
        for s in options.scenarios()
        for t in targets
        if (t.name, s) in turns
    ]


async def _start_profilers(
    profilers: trio.Nursery,
    options: BenchOptions,
    pids: Mapping[str, int],
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


# --- the fleet part -------------------------------------------------------------------------------


async def _run_fleet(
    options: BenchOptions, workdir: Path, notes: list[str], say: Progress
) -> list[FleetMeasurement]:
    shape = options.fleet
    measurements: list[FleetMeasurement] = []
    async with trio.open_nursery() as services:
        upstream = await _start_upstream(
            services,
            "--stream-tokens", str(shape.tokens),
            "--tokens-per-second", f"{shape.tokens_per_second:g}",
        )  # fmt: skip
        say(f"fleet: paced upstream {upstream.ready} (pid {upstream.pid}), {shape.label}")
        for name in options.fleet_only:
            async with trio.open_nursery() as target_services:
                target = await _start_target(
                    target_services,
                    name,
                    upstream,
                    workdir / name,
                    notes=notes,
                    say=say,
                    capacity=max(CAPACITY, 2 * shape.streams),
                )
                if target is not None:
                    await _wait_until_quiet([target], notes, say)
                    deadline = 3 * shape.stream_s + shape.window_s + _FLEET_SLACK_S
                    async with trio.open_nursery() as profilers:
                        if options.profile_dir is not None and name == IOP:
                            pids = {f"fleet-{p}": pid for p, pid in target.processes.items()}
                            await _start_profilers(profilers, options, pids, notes, say)
                        with trio.fail_after(deadline):
                            m = await measure_fleet(target, shape)
                        profilers.cancel_scope.cancel()
                    measurements.append(m)
                    say(_fleet_line(m))
                target_services.cancel_scope.cancel()
        services.cancel_scope.cancel()
    return measurements


def _fleet_line(m: FleetMeasurement) -> str:
    p99 = m.delay_ms(99.0)
    rate = m.chunks_per_s
    cost = m.cpu_us_per_chunk()
    return (
        f"fleet {TARGET_LABELS[m.target]:<11} {rate or 0:>7.0f} chunks/s  "
        f"delay p99 {'-' if p99 is None else f'{p99:.2f} ms':>9}  "
        f"CPU {'-' if cost is None else f'{cost:.0f} us/chunk':>12}  errors {m.errors}"
    )


# --- the many-Nodes part --------------------------------------------------------------------------


async def _run_many_nodes(
    shape: ManyNodesShape, workdir: Path, notes: list[str], say: Progress
) -> ManyNodesMeasurement | None:
    say(f"nodes: an Edge with {shape.nodes} Nodes x {shape.providers_per_node} providers")
    try:
        with trio.fail_after(_NODES_DEADLINE_S):
            m = await measure_many_nodes(shape, workdir)
    except trio.TooSlowError:
        _skip(notes, say, f"nodes: not done within {_NODES_DEADLINE_S:g} s, not measured")
        return None
    except ServiceFailed as exc:
        _skip(notes, say, f"nodes: a process failed, not measured: {exc}")
        return None
    idle = m.idle_cpu_share
    say(
        f"nodes: connected in {m.connect_s:.1f} s, idle CPU "
        f"{'-' if idle is None else f'{idle:.1%}'}, /catalog max "
        f"{m.catalog_max_ms or 0:.0f} ms, refresh "
        f"{'-' if m.refresh_s is None else f'{m.refresh_s:.1f} s'} "
        f"({m.refresh_applied}/{m.refresh_nodes} applied), callers' p99 "
        f"{m.caller_ms('idle', 99.0) or 0:.0f} ms idle, "
        f"{m.caller_ms('refresh', 99.0) or 0:.0f} ms during the refresh"
    )
    return m


# --- the agent prefix-cache part ------------------------------------------------------------------


async def _run_agent_cache(
    shape: AgentCacheShape, workdir: Path, notes: list[str], say: Progress
) -> AgentCacheMeasurement | None:
    say(f"agent cache: a Claude-Code-shaped conversation, {shape.label}")
    try:
        with trio.fail_after(_AGENT_CACHE_SLACK_S + 2 * shape.turns * _worst_turn_s(shape)):
            m = await measure_agent_cache(shape, workdir)
    except trio.TooSlowError:
        _skip(notes, say, "agent cache: not done in time, not measured")
        return None
    except (ServiceFailed, RuntimeError) as exc:
        _skip(notes, say, f"agent cache: not measured: {exc}")
        return None
    speedup = m.speedup
    say(
        f"agent cache: {m.total_s(m.stripped):.2f} s with the block removed "
        f"({m.cached_share(m.stripped):.0%} of prompt tokens cached), "
        f"{m.total_s(m.as_sent):.2f} s with it kept ({m.cached_share(m.as_sent):.0%})"
        + ("" if speedup is None else f": {speedup:.1f}x")
    )
    return m


def _worst_turn_s(shape: AgentCacheShape) -> float:
    """A turn's prefill with nothing cached, at the conversation's largest prompt (the
    system prompt, the tools and every turn's messages: a generous character count)."""
    chars = shape.instructions_chars + 1000 * shape.tools + 2000 * shape.turns + 1000
    return chars / 4 * shape.prefill_us / 1e6 + 1.0


# --- command line ---------------------------------------------------------------------------------


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


def _choices(allowed: Sequence[str], what: str) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated subset of `allowed`, in `allowed`'s order."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part.strip().lower() for part in text.split(",") if part.strip())
        unknown = [name for name in names if name not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what}(s) {', '.join(unknown) or '(none)'}; choose from "
                + ", ".join(allowed)
            )
        return tuple(name for name in allowed if name in names)

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=(
            "Measure IOP against a direct upstream and its peers (LiteLLM, vllm-router; "
            "when installed): closed-loop overhead, fleet-shaped streams, many Nodes."
        ),
    )
    parser.add_argument(
        "--parts", type=_choices(ALL_PARTS, "part"), default=ALL_PARTS, metavar="P,P",
        help="which parts to run, among " + ",".join(ALL_PARTS) + " (all)",
    )  # fmt: skip
    closed = parser.add_argument_group("closed-loop scenarios")
    length = closed.add_mutually_exclusive_group()
    length.add_argument(
        "--duration", type=float, default=4.0, metavar="S", help="seconds per scenario (4)"
    )
    length.add_argument(
        "--requests", type=int, default=None, metavar="N", help="requests per scenario instead"
    )
    closed.add_argument(
        "--concurrency", type=_int_list, default=(1, 32), metavar="C,C", help="(1,32)"
    )
    closed.add_argument(
        "--only", type=_choices(ALL_TARGETS, "target"), default=ALL_TARGETS, metavar="T,T",
        help="targets among " + ",".join(ALL_TARGETS) + " (all)",
    )  # fmt: skip
    closed.add_argument(
        "--protocols", type=_choices(PROTOCOLS, "protocol"), default=PROTOCOLS, metavar="P,P",
        help="caller protocols among " + ",".join(PROTOCOLS) + " (all)",
    )  # fmt: skip
    closed.add_argument(
        "--warmup", type=int, default=50, metavar="N", help="warm-up requests per turn (50)"
    )
    closed.add_argument(
        "--turns", type=int, default=4, metavar="N",
        help="measure in N turns, the targets interleaved, and combine them (4)",
    )  # fmt: skip
    fleet = parser.add_argument_group("fleet-shaped streams")
    defaults = FleetShape()
    fleet.add_argument(
        "--fleet-only", type=_choices(FLEET_TARGETS, "fleet target"),
        default=DEFAULT_FLEET_TARGETS, metavar="T,T",
        help="targets among " + ",".join(FLEET_TARGETS) + " ("
        + ",".join(DEFAULT_FLEET_TARGETS) + ")",
    )  # fmt: skip
    fleet.add_argument(
        "--streams", type=int, default=defaults.streams, metavar="S",
        help=f"streams open at once ({defaults.streams})",
    )  # fmt: skip
    fleet.add_argument(
        "--tokens-per-second", type=float, default=defaults.tokens_per_second, metavar="T",
        help=f"tokens per second of each stream ({defaults.tokens_per_second:g})",
    )  # fmt: skip
    fleet.add_argument(
        "--stream-tokens", type=int, default=defaults.tokens, metavar="N",
        help=f"tokens per stream ({defaults.tokens})",
    )  # fmt: skip
    fleet.add_argument(
        "--window", type=float, default=defaults.window_s, metavar="S",
        help=f"seconds measured per target ({defaults.window_s:g})",
    )  # fmt: skip
    nodes = parser.add_argument_group("many Nodes")
    node_defaults = ManyNodesShape()
    nodes.add_argument(
        "--nodes", type=int, default=node_defaults.nodes, metavar="N",
        help=f"light Nodes on one Edge ({node_defaults.nodes})",
    )  # fmt: skip
    nodes.add_argument(
        "--providers-per-node", type=int, default=node_defaults.providers_per_node, metavar="P",
        help=f"({node_defaults.providers_per_node})",
    )  # fmt: skip
    nodes.add_argument(
        "--idle-window", type=float, default=node_defaults.idle_window_s, metavar="S",
        help=f"seconds of idle Edge CPU measured ({node_defaults.idle_window_s:g})",
    )  # fmt: skip
    nodes.add_argument(
        "--node-processes", type=int, default=node_defaults.node_processes, metavar="K",
        help=f"processes the light Nodes are spread over ({node_defaults.node_processes}; "
        "10,000 light Nodes need 2 or more)",
    )  # fmt: skip
    nodes.add_argument(
        "--caller-rate", type=float, default=node_defaults.caller_rate, metavar="R",
        help="callers' requests a second to the sim model, idle and during the refresh "
        f"({node_defaults.caller_rate:g})",
    )  # fmt: skip
    nodes.add_argument(
        "--light-nodes-niceness", type=int, default=node_defaults.light_nodes_niceness,
        metavar="N",
        help="added to the light Nodes' processes' niceness: they stand in for a fleet on "
        f"machines of its own ({node_defaults.light_nodes_niceness}; 0: as equals)",
    )  # fmt: skip
    agent = parser.add_argument_group("agent prefix cache")
    agent_defaults = AgentCacheShape()
    agent.add_argument(
        "--agent-turns", type=int, default=agent_defaults.turns, metavar="N",
        help=f"turns of the conversation ({agent_defaults.turns})",
    )  # fmt: skip
    agent.add_argument(
        "--prefill-us-per-token", type=float, default=agent_defaults.prefill_us, metavar="U",
        help=f"prefill cost of an uncached prompt token, us ({agent_defaults.prefill_us:g})",
    )  # fmt: skip
    agent.add_argument(
        "--cached-prefill-us-per-token", type=float, default=agent_defaults.cached_us,
        metavar="C", help=f"... and of a cached one ({agent_defaults.cached_us:g})",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the numbers here")
    parser.add_argument(
        "--profile", type=Path, metavar="DIR", help="py-spy the Edge and Node into DIR"
    )
    parser.add_argument("--profile-format", choices=FORMATS, default="flamegraph")
    instead = parser.add_argument_group(
        "other measurements", "one of these runs instead of the parts, in its own set-up"
    ).add_mutually_exclusive_group()
    # Each given bare runs at its usual size; a number sets the size (rounds, tokens).
    for flag, usual, metavar, what in (
        (
            "--replicas",
            2,
            "ROUNDS",
            "one Edge vs two Edge replicas as workers on one host, non-stream at the "
            "highest --concurrency, measured in turns ROUNDS times (2; bench/replicas.py)",
        ),
        (
            "--tracing",
            3,
            "ROUNDS",
            "the CPU per request of OpenTelemetry traces, off, off again (the noise floor) "
            "and on at 100 %% sampling, stream and non-stream at the highest --concurrency, "
            "measured in turns ROUNDS times (3; bench/tracing.py)",
        ),
        (
            "--tokens",
            10_000,
            "N",
            "an Edge with N caller tokens (10,000) and principal limits against a small "
            "config: its startup, its check-config, and how long a refresh dry run holds "
            "callers' requests (bench/many_tokens.py)",
        ),
    ):
        instead.add_argument(
            flag, type=int, nargs="?", const=usual, default=None, metavar=metavar, help=what
        )
    instead.add_argument(
        "--fair-share",
        action="store_true",
        help="the scheduler sharing a saturated model between principals, in process: cost "
        "per admitted request with 1, 100, 10,000 principals, and the fairness targets on "
        "virtual time (bench/fair_share.py)",
    )
    return parser


def options_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BenchOptions:
    try:
        budget = Budget(
            requests=args.requests,
            duration_s=args.duration,
            warmup_requests=args.warmup,
            turns=args.turns,
        )
        fleet = FleetShape(
            streams=args.streams,
            tokens_per_second=args.tokens_per_second,
            tokens=args.stream_tokens,
            window_s=args.window,
        )
        nodes = ManyNodesShape(
            nodes=args.nodes,
            providers_per_node=args.providers_per_node,
            idle_window_s=args.idle_window,
            node_processes=args.node_processes,
            caller_rate=args.caller_rate,
            light_nodes_niceness=args.light_nodes_niceness,
        )
        agent_cache = AgentCacheShape(
            turns=args.agent_turns,
            prefill_us=args.prefill_us_per_token,
            cached_us=args.cached_prefill_us_per_token,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return BenchOptions(
        parts=args.parts,
        budget=budget,
        concurrency=args.concurrency,
        protocols=args.protocols,
        only=args.only,
        fleet_only=args.fleet_only,
        fleet=fleet,
        nodes=nodes,
        agent_cache=agent_cache,
        profile_dir=args.profile,
        profile_format=args.profile_format,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = options_from(args, parser)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, _REPORT_WIDTH)  # a pipe or CI log: room for the table
    status = Console(stderr=True)

    def say(line: str) -> None:
        status.print(line, highlight=False, markup=False, soft_wrap=True)

    try:
        return _run(args, options, console, say)
    except KeyboardInterrupt:
        return 130  # as a shell reports an interrupted command


def _run(args: argparse.Namespace, options: BenchOptions, console: Console, say: Progress) -> int:
    """The one measurement the command line asks for, reported."""
    if args.replicas is not None:
        return _replicas(options, args.replicas, console, say)
    if args.tracing is not None:
        return _tracing(options, args.tracing, console, say)
    if args.tokens is not None:
        return _many_tokens(args.tokens, console, say)
    if args.fair_share:
        from bench.fair_share import render_fair_share, run_fair_share

        console.print(render_fair_share(run_fair_share()))
        return 0
    if AFFINITY in options.parts:
        from bench.affinity import render_affinity, run_affinity

        say("affinity: agent sessions, load-only and affinity routing (virtual time)")
        console.print(render_affinity(run_affinity()))
        options = replace(options, parts=tuple(p for p in options.parts if p != AFFINITY))
        if not options.parts:
            return 0
    if MODELS in options.parts:
        from bench.many_models import render_models, run_models

        say("models: many models over providers holding some, load-only and placement")
        console.print(render_models(run_models()))
        options = replace(options, parts=tuple(p for p in options.parts if p != MODELS))
        if not options.parts:
            return 0
    result = _in_scratch_dir(lambda workdir: run_bench(options, workdir, say))
    console.print(render(result))
    if args.json is not None:
        args.json.write_text(to_json(result), encoding="utf-8")
    return 0


def _in_scratch_dir(measure: Callable[[Path], Awaitable[_T]]) -> _T:
    """Run one measurement under Trio with a scratch folder of its own, removed after."""
    with tempfile.TemporaryDirectory(prefix="iop-bench-") as workdir:
        return trio.run(measure, Path(workdir))


def _replicas(options: BenchOptions, rounds: int, console: Console, say: Progress) -> int:
    scenarios = [Scenario(concurrency=max(options.concurrency), stream=False)]
    setups = _in_scratch_dir(
        lambda workdir: run_replicas_bench(scenarios, options.budget, workdir, say, max(rounds, 1))
    )
    console.print(render_replicas(setups, Machine.this().cores))
    return 0


def _tracing(options: BenchOptions, rounds: int, console: Console, say: Progress) -> int:
    from bench.tracing import render_tracing, run_tracing_bench

    concurrency = max(options.concurrency)
    scenarios = [Scenario(concurrency, stream=False), Scenario(concurrency, stream=True)]
    turns = _in_scratch_dir(
        lambda workdir: run_tracing_bench(scenarios, options.budget, workdir, say, max(rounds, 1))
    )
    console.print(render_tracing(turns, Machine.this().cores))
    return 0


def _many_tokens(tokens: int, console: Console, say: Progress) -> int:
    from bench.many_tokens import ManyTokensShape, measure_many_tokens, render_many_tokens

    try:
        shape = ManyTokensShape(tokens=tokens)
    except ValueError as exc:
        say(f"--tokens: {exc}")
        return 2
    try:
        measured = _in_scratch_dir(lambda workdir: measure_many_tokens(shape, workdir, say))
    except (ServiceFailed, RuntimeError) as exc:
        say(f"many tokens: not measured: {exc}")
        return 1
    console.print(render_many_tokens(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
