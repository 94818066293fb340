"""Many Nodes on one Edge: what a thousand connected Nodes cost the Edge when idle.

A real Edge process (`python -m iop_edge serve`) gets a generated config with `nodes`
Node entries (each with its own token, stored only as its sha256 in the config) of
`providers_per_node` providers each, spread over `models` models. One child process
(`bench.light_nodes`) connects a light Node for every entry. Then, from outside, as an
operator would see it:

- **connect**: from starting the light Nodes until the Edge's `/catalog` shows every
  provider connected and available;
- **Edge RSS** before any Node connected, with all of them connected (idle), and after
  the refresh;
- **idle Edge CPU**: its CPU time over `idle_window_s` seconds of doing nothing but
  keeping the links (heartbeat pings every 5 s per Node), as a share of one core;
- **`/catalog` latency**: `catalog_requests` requests one after the other, each timed to
  its last byte;
- **refresh of every Node**: `POST /refresh` (apply) with a candidate that changes the
  capacity of every provider of every Node (a live change), timed until the Edge
  answers: it answers once every Node acked (or its push timed out), and the report it
  returns says, per Node, whether the Node applied the new revision. The same candidate
  as a dry run first, timed too: validating and planning, the part of the refresh that
  does not depend on the Nodes.

The light Nodes stop before the Edge does, so the Edge is not stopped while a thousand
links break at once.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx2
import trio
import yaml

from bench.gateway import EdgeLog
from bench.light_nodes import DEFAULT_HANDSHAKES
from bench.light_nodes import READY_PREFIX as NODES_READY_PREFIX
from bench.load import percentile
from bench.procfs import process_cpu_seconds, rss_bytes
from bench.services import python_argv, start_service

#: Where the light Nodes' providers point: never contacted (a light Node has no upstream).
_UNUSED_UPSTREAM: Final = "http://127.0.0.1:9/v1"
_CAPACITY: Final = 4
#: Between two looks at the Edge's catalog while the Nodes report in (see `_wait_all_available`).
_READINESS_INTERVAL_S: Final = 0.25
_ADMIN_TIMEOUT_S: Final = 60.0
#: After the last Node reported in, before the idle window: the Edge's log lines of the
#: connect burst are still being written.
_SETTLE_S: Final = 1.0
#: An Edge that just lost a thousand Nodes takes a few seconds to tear their sessions
#: down before it exits (longer on a busy machine): more than the default 5 s grace.
_EDGE_STOP_GRACE_S: Final = 30.0

try:  # libyaml's emitter: a thousand Node entries take a while with the pure-Python one
    _Dumper: Any = yaml.CSafeDumper
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _Dumper = yaml.SafeDumper


@dataclass(frozen=True, slots=True)
class ManyNodesShape:
    nodes: int = 1000
    providers_per_node: int = 3
    models: int = 10
    idle_window_s: float = 10.0
    catalog_requests: int = 20

    def __post_init__(self) -> None:
        if min(self.nodes, self.providers_per_node, self.models, self.catalog_requests) < 1:
            raise ValueError("nodes, providers per node, models and catalog requests must be >= 1")
        if self.idle_window_s <= 0:
            raise ValueError("the idle window must be > 0")

    @property
    def providers(self) -> int:
        return self.nodes * self.providers_per_node


@dataclass(frozen=True, slots=True)
class ManyNodesMeasurement:
    shape: ManyNodesShape
    connect_s: float
    rss_empty: int | None
    """The Edge's resident memory before any Node connected."""
    rss_connected: int | None
    """... with every Node connected, after the idle window."""
    rss_after_refresh: int | None
    idle_cpu_s: float | None
    idle_window_s: float
    catalog_s: tuple[float, ...]
    """`/catalog` latencies, sorted."""
    catalog_bytes: int
    dry_run_s: float | None
    """The same candidate as a dry run: validation and plan only."""
    refresh_s: float | None
    refresh_status: int
    refresh_nodes: int
    """Nodes the refresh report lists (those whose config changed)."""
    refresh_applied: int
    """... of which acked the new revision as applied."""
    refresh_problem: str | None = None
    """The first Node that did not apply, and why; or why the refresh was refused."""

    @property
    def idle_cpu_share(self) -> float | None:
        """The Edge's idle CPU as a share of one core."""
        return None if self.idle_cpu_s is None else self.idle_cpu_s / self.idle_window_s

    @property
    def rss_kb_per_node(self) -> float | None:
        if self.rss_empty is None or self.rss_connected is None:
            return None
        return (self.rss_connected - self.rss_empty) / 1024 / self.shape.nodes

    def catalog_ms(self, q: float) -> float | None:
        return percentile(self.catalog_s, q) * 1000 if self.catalog_s else None

    @property
    def catalog_max_ms(self) -> float | None:
        return self.catalog_s[-1] * 1000 if self.catalog_s else None


# --- the config -----------------------------------------------------------------------------------


def node_credentials(count: int) -> dict[str, str]:
    """A fresh random token for each of `count` Node ids."""
    return {f"node-{i:04d}": secrets.token_urlsafe(18) for i in range(count)}


def fleet_config(
    shape: ManyNodesShape, credentials: Mapping[str, str], state_dir: Path, *, capacity: int
) -> str:
    """The Edge config (YAML): every Node with its providers, each model on its providers.

    Provider `j` of Node `i` serves model `(i * providers_per_node + j) % models`, so
    every model is served by providers on many Nodes."""
    served: dict[int, dict[str, str]] = {m: {} for m in range(shape.models)}
    nodes: list[dict[str, Any]] = []
    for i, (node_id, token) in enumerate(credentials.items()):
        providers = []
        for j in range(shape.providers_per_node):
            model = (i * shape.providers_per_node + j) % shape.models
            provider_id = f"{node_id}-p{j}"
            served[model][provider_id] = f"served-{model}"
            providers.append(
                {
                    "id": provider_id,
                    "type": "vllm",
                    "models": [f"served-{model}"],
                    "capacity": capacity,
                    "adapter": {"base_url": _UNUSED_UPSTREAM},
                }
            )
        nodes.append(
            {
                "id": node_id,
                "token_hash_sha256": hashlib.sha256(token.encode()).hexdigest(),
                "providers": providers,
            }
        )
    config = {
        "edge": {"id": "bench-edge", "listen": "127.0.0.1:0", "state_dir": str(state_dir)},
        "admin": {"listen": "127.0.0.1:0"},
        "openai": {"listen": "127.0.0.1:0"},
        "models": [{"id": f"model-{m}", "providers": served[m]} for m in range(shape.models)],
        "nodes": nodes,
    }
    text: str = yaml.dump(config, Dumper=_Dumper, sort_keys=False)
    return text


# --- the measurement ------------------------------------------------------------------------------


async def _available_providers(admin: httpx2.AsyncClient) -> int:
    response = await admin.get("/catalog")
    response.raise_for_status()
    return sum(
        1
        for p in response.json().get("providers", [])
        if p.get("connected") and p.get("health") == "available"
    )


async def _wait_all_available(admin: httpx2.AsyncClient, providers: int) -> None:
    """Return once the catalog shows `providers` providers connected and available.

    The light Nodes' process says when it has sent every status; when the Edge has
    processed them is visible only in its catalog, so this re-reads it at an interval.
    The caller's deadline bounds the wait."""
    while True:
        if await _available_providers(admin) >= providers:
            return
        await trio.sleep(_READINESS_INTERVAL_S)


async def _idle_cpu(pid: int, window_s: float) -> float | None:
    before = await process_cpu_seconds(pid)
    await trio.sleep(window_s)  # the window is the measurement: the Edge is left alone
    after = await process_cpu_seconds(pid)
    return None if before is None or after is None else after - before


async def _catalog_latencies(admin: httpx2.AsyncClient, count: int) -> tuple[list[float], int]:
    latencies: list[float] = []
    size = 0
    for _ in range(count):
        began = time.perf_counter()
        response = await admin.get("/catalog")
        size = len(response.content)
        latencies.append(time.perf_counter() - began)
        response.raise_for_status()
    return latencies, size


async def _dry_run(admin: httpx2.AsyncClient, candidate: str) -> float | None:
    """Seconds a dry run of `candidate` takes; None when the Edge refuses it."""
    body = json.dumps({"mode": "dry_run", "config_yaml": candidate})
    began = time.perf_counter()
    response = await admin.post(
        "/refresh", content=body, headers={"content-type": "application/json"}
    )
    elapsed = time.perf_counter() - began
    return elapsed if response.status_code == 200 else None


async def _refresh_everything(
    admin: httpx2.AsyncClient, candidate: str
) -> tuple[float, int, int, int, str | None]:
    """Apply `candidate`; (seconds, status, nodes reported, nodes applied, first problem)."""
    body = json.dumps({"mode": "apply", "config_yaml": candidate})
    began = time.perf_counter()
    response = await admin.post(
        "/refresh", content=body, headers={"content-type": "application/json"}
    )
    elapsed = time.perf_counter() - began
    try:
        report = response.json()
    except ValueError:
        report = {"errors": response.text[:300]}
    nodes = report.get("nodes", []) if isinstance(report, dict) else []
    applied = sum(1 for node in nodes if node.get("status") == "applied")
    problem: str | None = None
    for node in nodes:
        if node.get("status") != "applied":
            problem = f"node {node.get('id')}: {node.get('status')}: {node.get('detail')}"
            break
    if response.status_code != 200:
        errors = report.get("errors") if isinstance(report, dict) else None
        problem = f"HTTP {response.status_code}: {json.dumps(errors or report)[:300]}"
    return elapsed, response.status_code, len(nodes), applied, problem


async def measure_many_nodes(
    shape: ManyNodesShape, workdir: Path, *, handshakes: int = DEFAULT_HANDSHAKES
) -> ManyNodesMeasurement:
    """Start an Edge with `shape.nodes` Nodes configured, connect them, measure, stop both.

    The caller owns the deadline (a thousand Nodes take a minute or two on 2 cores)."""
    await trio.Path(workdir).mkdir(parents=True, exist_ok=True)
    credentials = node_credentials(shape.nodes)
    config_path = workdir / "edge.yaml"
    state_dir = workdir / "edge-state"
    text = fleet_config(shape, credentials, state_dir, capacity=_CAPACITY)
    await trio.Path(config_path).write_text(text, encoding="utf-8")
    nodes_file = workdir / "light-nodes.json"
    # Tokens only in a file readable by this user, never on a command line.
    await trio.Path(nodes_file).touch(mode=0o600)
    await trio.Path(nodes_file).write_text(json.dumps(credentials), encoding="utf-8")
    candidate = fleet_config(shape, credentials, state_dir, capacity=_CAPACITY + 1)

    async with trio.open_nursery() as edge_scope:
        edge = await start_service(
            edge_scope,
            "iop-edge (many nodes)",
            # INFO: the Edge logs the URLs it bound at INFO (and a line per Node connect).
            python_argv("iop_edge", "serve", "--config", str(config_path), "--log-level", "INFO"),
            EdgeLog(),
            stop_grace_s=_EDGE_STOP_GRACE_S,
        )
        rss_empty = await rss_bytes(edge.pid)
        async with (
            trio.open_nursery() as nodes_scope,
            httpx2.AsyncClient(base_url=edge.ready.admin, timeout=_ADMIN_TIMEOUT_S) as admin,
        ):
            began = time.perf_counter()
            await start_service(
                nodes_scope,
                "light-nodes",
                python_argv(
                    "bench.light_nodes",
                    "--edge", edge.ready.node,
                    "--nodes-file", str(nodes_file),
                    "--handshakes", str(handshakes),
                ),
                lambda line: line if line.startswith(NODES_READY_PREFIX) else None,
            )  # fmt: skip
            await _wait_all_available(admin, shape.providers)
            connect_s = time.perf_counter() - began
            await trio.sleep(_SETTLE_S)
            idle_cpu_s = await _idle_cpu(edge.pid, shape.idle_window_s)
            rss_connected = await rss_bytes(edge.pid)
            latencies, catalog_bytes = await _catalog_latencies(admin, shape.catalog_requests)
            dry_run_s = await _dry_run(admin, candidate)
            refresh_s, status, reported, applied, problem = await _refresh_everything(
                admin, candidate
            )
            rss_after_refresh = await rss_bytes(edge.pid)
            nodes_scope.cancel_scope.cancel()
        edge_scope.cancel_scope.cancel()
    return ManyNodesMeasurement(
        shape=shape,
        connect_s=connect_s,
        rss_empty=rss_empty,
        rss_connected=rss_connected,
        rss_after_refresh=rss_after_refresh,
        idle_cpu_s=idle_cpu_s,
        idle_window_s=shape.idle_window_s,
        catalog_s=tuple(sorted(latencies)),
        catalog_bytes=catalog_bytes,
        dry_run_s=dry_run_s,
        refresh_s=refresh_s if status == 200 else None,
        refresh_status=status,
        refresh_nodes=reported,
        refresh_applied=applied,
        refresh_problem=problem,
    )
