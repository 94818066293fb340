"""`python -m bench --replicas`: one Edge against two Edge replicas as workers on one host.

The same fake upstream and the same closed-loop load (`bench.load`) as the main bench,
against two set-ups that run side by side, each in its own processes:

- *one Edge*: one `iop-edge serve`;
- *two replicas*: two `iop-edge serve` with one config, sharing the caller port (the
  OpenAI listener sets `SO_REUSEPORT`, so the kernel spreads connections over them), each
  with its own node and admin port (port 0 in the config), as docs/operations.md#replicas
  sets replicas up on one host.

Both have two Nodes (each with one provider on the upstream), linked to every Edge of
their set-up, so that what is compared is the Edge: with one Node, the Node's own core
would cap both. The set-ups are measured in turns (one, two, one, two, ...), so a
machine whose speed drifts treats them alike; each turn reports throughput, latency and
where the CPU went: each Edge, the Nodes, the upstream, and the load generator (this
process). On a machine with fewer cores than busy processes they all compete for the
same cores, and the split says so.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import trio
import yaml
from rich.table import Table

from bench.gateway import EdgeLog, wait_servable
from bench.load import Budget, Measurement, Scenario, Target, measure, open_client
from bench.procfs import cpu_seconds
from bench.services import python_argv, spawn_service, start_service
from bench.upstream import MODEL, SERVED_MODEL, start_upstream

__all__ = ["Setup", "render_replicas", "run_replicas", "run_replicas_bench"]

_START_S: Final = 60.0
#: Run slots per provider: far above the bench's concurrency.
_CAPACITY: Final = 256
_NODES: Final = 2


@dataclass(frozen=True, slots=True)
class Setup:
    name: str
    measurement: Measurement
    cpu_s: dict[str, float]
    """CPU seconds per process group during the measured phase."""


@dataclass(frozen=True, slots=True)
class _Running:
    name: str
    url: str
    pids: dict[str, tuple[int, ...]]


def _free_port() -> int:
    """A port free right now (the replicas' shared caller port must be a number)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(upstream_root: str, state_dir: Path, token_hash: str, openai_listen: str) -> str:
    nodes: list[dict[str, Any]] = [
        {
            "id": f"bench-node-{index}",
            "token_hash_sha256": token_hash,
            "providers": [
                {
                    "id": f"bench-vllm-{index}",
                    "type": "vllm",
                    "models": [SERVED_MODEL],
                    "capacity": _CAPACITY,
                    "adapter": {"base_url": f"{upstream_root}/v1"},
                }
            ],
        }
        for index in range(1, _NODES + 1)
    ]
    config = {
        "edge": {"id": "bench-edge", "listen": "127.0.0.1:0", "state_dir": str(state_dir)},
        "admin": {"listen": "127.0.0.1:0"},
        "openai": {"listen": openai_listen},
        "dispatch": {"max_queue": 4096, "queue_timeout_ms": 120_000},
        "models": [
            {
                "id": MODEL,
                "providers": {f"bench-vllm-{i}": SERVED_MODEL for i in range(1, _NODES + 1)},
            }
        ],
        "nodes": nodes,
    }
    return yaml.safe_dump(config, sort_keys=False)


async def _start(services: trio.Nursery, upstream_root: str, workdir: Path, edges: int) -> _Running:
    """`edges` Edge processes (sharing the caller port when more than one) and the Nodes."""
    token = secrets.token_urlsafe(24)
    token_hash = hashlib.sha256(token.encode()).hexdigest()
    listen = f"127.0.0.1:{_free_port()}" if edges > 1 else "127.0.0.1:0"
    await trio.Path(workdir).mkdir(parents=True, exist_ok=True)
    path = workdir / "edge.yaml"
    text = _config(upstream_root, workdir / "state", token_hash, listen)
    await trio.Path(path).write_text(text, encoding="utf-8")
    argv = python_argv("iop_edge", "serve", "--config", str(path), "--log-level", "INFO")
    started = [
        await start_service(services, f"iop-edge-{index}", argv, EdgeLog())
        for index in range(1, edges + 1)
    ]
    nodes = []
    for index in range(1, _NODES + 1):
        node_argv = python_argv("iop_node", "run", "--node-id", f"bench-node-{index}")
        for edge in started:
            node_argv += ["--edge", edge.ready.node]
        nodes.append(
            await spawn_service(
                services, f"iop-node-{index}", node_argv, env={"IOP_NODE_TOKEN": token}
            )
        )
    for edge in started:
        await wait_servable(edge.ready.admin)
    name = "one Edge" if edges == 1 else f"{edges} replicas"
    pids: dict[str, tuple[int, ...]] = {
        f"edge {i}": (edge.pid,) for i, edge in enumerate(started, 1)
    }
    if edges == 1:
        pids = {"edge": (started[0].pid,)}
    pids["nodes"] = tuple(node.pid for node in nodes)
    return _Running(name, started[0].ready.openai, pids)


async def _measure(running: _Running, scenario: Scenario, budget: Budget) -> Setup:
    client = open_client(scenario.concurrency)
    try:
        before = {label: await cpu_seconds(pids) for label, pids in running.pids.items()}
        every = {str(pid): pid for pids in running.pids.values() for pid in pids}
        target = Target(running.name, running.url, every)
        measurement = await measure(client, target, scenario, budget)
        after = {label: await cpu_seconds(pids) for label, pids in running.pids.items()}
    finally:
        await client.aclose()
    cpu = {
        label: (after[label] or 0.0) - (before[label] or 0.0)
        for label in running.pids
        if before[label] is not None and after[label] is not None
    }
    return Setup(running.name, measurement, cpu)


async def run_replicas(
    upstream_root: str,
    upstream_pid: int,
    workdir: Path,
    *,
    scenarios: Sequence[Scenario],
    budget: Budget,
    rounds: int,
    say: Callable[[str], None],
) -> list[Setup]:
    """Start both set-ups, measure them in turns `rounds` times, stop everything."""
    setups: list[Setup] = []
    async with trio.open_nursery() as services:
        with trio.fail_after(_START_S):
            one = await _start(services, upstream_root, workdir / "one", edges=1)
            two = await _start(services, upstream_root, workdir / "two", edges=2)
        say(f"one Edge: {one.url}; two replicas: {two.url} (shared port)")
        for running in (one, two):
            running.pids["upstream"] = (upstream_pid,)
            running.pids["load"] = (os.getpid(),)
        for turn in range(rounds):
            for scenario in scenarios:
                for running in (one, two):
                    setup = await _measure(running, scenario, budget)
                    setups.append(setup)
                    m = setup.measurement
                    say(f"round {turn + 1}: {running.name:<12} {m.rps or 0:.0f} req/s")
        services.cancel_scope.cancel()
    return setups


def render_replicas(setups: Sequence[Setup], cores: int) -> Table:
    table = Table(title=f"One Edge vs two replicas as workers ({cores} cores)")
    for column in ("setup", "scenario", "ok", "err", "p50 ms", "p99 ms", "req/s", "vs one"):
        table.add_column(column, justify="left" if column in ("setup", "scenario") else "right")
    table.add_column("CPU ms/req by process")
    base: dict[Scenario, float] = {}
    for setup in setups:
        m = setup.measurement
        rps = m.rps or 0.0
        if setup.name == "one Edge":
            base[m.scenario] = rps
        ratio = rps / base[m.scenario] if base.get(m.scenario) else None
        requests = m.ok + m.errors
        split = (
            ", ".join(f"{label} {cpu / requests * 1000:.2f}" for label, cpu in setup.cpu_s.items())
            if requests
            else ""
        )
        table.add_row(
            setup.name,
            m.scenario.label,
            str(m.ok),
            str(m.errors),
            f"{m.p50_ms:.2f}" if m.p50_ms is not None else "-",
            f"{m.p99_ms:.2f}" if m.p99_ms is not None else "-",
            f"{rps:.0f}",
            f"{ratio:.2f}x" if ratio is not None else "",
            split,
        )
    return table


async def run_replicas_bench(
    scenarios: Sequence[Scenario],
    budget: Budget,
    workdir: Path,
    say: Callable[[str], None],
    rounds: int = 2,
) -> list[Setup]:
    """The whole `--replicas` run: the upstream, then `run_replicas`."""
    async with trio.open_nursery() as services:
        with trio.fail_after(_START_S):
            upstream = await start_upstream(services)
        say(f"upstream: {upstream.ready} (pid {upstream.pid})")
        setups = await run_replicas(
            upstream.ready,
            upstream.pid,
            workdir,
            scenarios=scenarios,
            budget=budget,
            rounds=rounds,
            say=say,
        )
        services.cancel_scope.cancel()
    return setups
