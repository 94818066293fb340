"""`python -m bench --replicas`: one Edge against two Edge replicas as workers on one host.

The same fake upstream and the same closed-loop load (`bench.load`) as the main bench,
against two set-ups, each in its own processes:

- *one Edge*: `iop-edge serve` and one Node (`bench.gateway`);
- *two replicas*: two `iop-edge serve` with one config, sharing the caller port (the
  OpenAI listener sets `SO_REUSEPORT`, so the kernel spreads connections over them), each
  with its own node and admin port (port 0 in the config), and one Node linked to both
  (`--edge` twice), as the README's "Scaling" section sets replicas up on one host.

For each, the throughput and latency of the chosen scenarios (default: concurrency 32,
non-stream), and where the CPU went: each Edge, the Node, the upstream, and the load
generator (this process). On a machine with
fewer cores than busy processes the replicas compete with the Node, the upstream and the
load generator for the same cores, and the split says so.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio
import yaml
from rich.table import Table

from bench.gateway import edge_config, start_gateway, wait_servable
from bench.load import Budget, Measurement, Scenario, Target, cpu_seconds, measure, open_client
from bench.services import python_argv, spawn_service, start_service
from bench.upstream import READY_PREFIX

__all__ = ["Setup", "render_replicas", "run_replicas", "run_replicas_bench"]

_START_S: Final = 60.0
_NODE_ID: Final = "bench-node"
_URL = {
    "node": re.compile(r"node websocket listening on (\S+)"),
    "openai": re.compile(r"OpenAI API listening on (\S+)"),
    "admin": re.compile(r"admin API listening on (\S+)"),
}


@dataclass(frozen=True, slots=True)
class Setup:
    name: str
    measurement: Measurement
    cpu_s: dict[str, float]
    """CPU seconds per process during the measured phase (Edges, Node, upstream)."""


class _Urls:
    def __init__(self) -> None:
        self.found: dict[str, str] = {}

    def __call__(self, line: str) -> dict[str, str] | None:
        for name, pattern in _URL.items():
            if match := pattern.search(line):
                self.found[name] = match.group(1)
        return dict(self.found) if len(self.found) == len(_URL) else None


def _free_port() -> int:
    """A port free right now (the replicas' shared caller port must be a number)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _measure(
    name: str, url: str, pids: dict[str, int], scenario: Scenario, budget: Budget
) -> Setup:
    client = open_client(scenario.concurrency)
    try:
        before = {label: await cpu_seconds((pid,)) for label, pid in pids.items()}
        measurement = await measure(
            client, Target(name, url, tuple(pids.values())), scenario, budget
        )
        after = {label: await cpu_seconds((pid,)) for label, pid in pids.items()}
    finally:
        await client.aclose()
    cpu = {
        label: (after[label] or 0.0) - (before[label] or 0.0)
        for label in pids
        if before[label] is not None and after[label] is not None
    }
    return Setup(name, measurement, cpu)


async def run_replicas(
    upstream_root: str,
    upstream_pid: int,
    workdir: Path,
    *,
    scenarios: Sequence[Scenario],
    budget: Budget,
    say: Callable[[str], None],
) -> list[Setup]:
    """Measure one Edge, then two replicas, on every scenario; every process stopped after."""
    setups: list[Setup] = []
    for name in ("one", "two"):
        await trio.Path(workdir / name).mkdir(parents=True, exist_ok=True)
    async with trio.open_nursery() as services:
        with trio.fail_after(_START_S):
            gateway = await start_gateway(services, upstream_root, workdir / "one")
        say(f"one Edge: {gateway.openai_url} (edge pid {gateway.edge.pid})")
        pids = {"edge": gateway.edge.pid, "node": gateway.node.pid, "upstream": upstream_pid}
        pids["load"] = os.getpid()
        for scenario in scenarios:
            setups.append(await _measure("one Edge", gateway.openai_url, pids, scenario, budget))
        services.cancel_scope.cancel()
    async with trio.open_nursery() as services:
        with trio.fail_after(_START_S):
            urls, pids = await _start_replicas(services, upstream_root, workdir / "two", say)
        pids["upstream"] = upstream_pid
        pids["load"] = os.getpid()
        for scenario in scenarios:
            setups.append(await _measure("two replicas", urls, pids, scenario, budget))
        services.cancel_scope.cancel()
    return setups


async def _start_replicas(
    services: trio.Nursery, upstream_root: str, workdir: Path, say: Callable[[str], None]
) -> tuple[str, dict[str, int]]:
    token = "bench-replica-token"
    config = yaml.safe_load(edge_config(upstream_root, workdir / "state", token))
    port = _free_port()
    config["openai"]["listen"] = f"127.0.0.1:{port}"  # shared: SO_REUSEPORT
    path = workdir / "edge.yaml"
    await trio.Path(path).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    argv = python_argv("iop_edge", "serve", "--config", str(path), "--log-level", "INFO")
    edges = [await start_service(services, f"iop-edge-{index}", argv, _Urls()) for index in (1, 2)]
    node_argv = python_argv("iop_node", "run", "--node-id", _NODE_ID)
    for edge in edges:
        node_argv += ["--edge", edge.ready["node"]]
    node = await spawn_service(services, "iop-node", node_argv, env={"IOP_NODE_TOKEN": token})
    for edge in edges:
        await wait_servable(edge.ready["admin"])
    say(f"two replicas on 127.0.0.1:{port} (edge pids {edges[0].pid}, {edges[1].pid})")
    pids = {"edge 1": edges[0].pid, "edge 2": edges[1].pid, "node": node.pid}
    return f"http://127.0.0.1:{port}", pids


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
    scenarios: Sequence[Scenario], budget: Budget, workdir: Path, say: Callable[[str], None]
) -> list[Setup]:
    """The whole `--replicas` run: the upstream, then `run_replicas`."""
    async with trio.open_nursery() as services:
        with trio.fail_after(_START_S):
            upstream = await start_service(
                services,
                "bench-upstream",
                python_argv("bench.upstream"),
                lambda line: (
                    line.removeprefix(READY_PREFIX) if line.startswith(READY_PREFIX) else None
                ),
            )
        say(f"upstream: {upstream.ready} (pid {upstream.pid})")
        setups = await run_replicas(
            upstream.ready, upstream.pid, workdir, scenarios=scenarios, budget=budget, say=say
        )
        services.cancel_scope.cancel()
    return setups
