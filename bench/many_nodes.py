"""Many Nodes on one Edge: what a fleet of connected Nodes costs the Edge, idle and while
its config is refreshed, and what callers feel meanwhile.

A real Edge process (`python -m iop_edge serve`) gets a generated config with `nodes`
Node entries (each with its own token, stored only as its sha256 in the config) of
`providers_per_node` providers each, spread over `models` models, and one more Node, a
real one (`python -m iop_node run`) with a `sim` provider serving `sim-model`, for the
callers. `node_processes` child processes (`bench.light_nodes`) connect a light Node for
every fleet entry between them (ten thousand light Nodes are more than one Python
process keeps up with on a small machine). Then, from outside, as an operator would see
it:

- **connect**: from starting the light Nodes until the Edge's `/catalog` shows every
  provider connected and available;
- **Edge RSS** before any Node connected, with all of them connected (idle), and after
  the refresh;
- **idle Edge CPU**: its CPU time over `idle_window_s` seconds of doing nothing but
  keeping the links (every Node pings every `heartbeat_s`), as a share of one core;
- **`/catalog` latency**: `catalog_requests` requests one after the other, each timed to
  its last byte, of the whole catalog and of filtered ones (one Node's providers; one
  model's available providers, a page of 100);
- **dry run of a few Nodes' change**: `POST /refresh` (dry run) with a candidate that
  changes the capacity of `FEW_NODES` light Nodes' providers, the refresh an operator
  makes most: validating and planning, proportional to the change;
- **refresh of every Node**: `POST /refresh` (apply) with a candidate that changes the
  capacity of every provider of every light Node (a live change), timed until the Edge
  answers: it answers once every Node acked (or its push timed out), and the report it
  returns says, per Node, whether the Node applied the new revision. The same candidate
  as a dry run first, timed too: validating and planning every Node. Each refresh is
  sent from a child process (`bench.admin_post`), as an operator's comes from elsewhere:
  its megabytes, sent and read on this process's event loop, would hold the callers';
- **churn**: a little more than a tenth of the light Nodes (`churn_nodes`) leave at once
  and connect again, `CHURN_ROUNDS` times, and the Edge is left `LEAK_GRACE_S` and a
  little more after the last leave: an ended session its heap keeper finds still alive
  by then counts as leaked, and enough of them bring a thaw, a full collection of its
  heap (`runtime.lifecycle.heap`, Rule 4). The loop holds of the whole window, whether a
  full collection ran, and the Edge's RSS before the churn and after each round (sessions
  freed as they end leave it flat);
- **callers**: `caller_rate` chat requests a second to `sim-model`, open loop, for
  `caller_window_s` while the Edge is idle, then throughout the dry runs and the apply,
  then for `caller_window_s` once more, idle again: each request's latency to its last
  byte, and the p99 of each phase (the refresh must not make callers wait; the second
  idle window shows how far the machine alone moves a p99).

Every process of the scenario shares the machine: on a small one the light Nodes' own
work (ten thousand of them acking a refresh, a thousand a second, take a core or more)
competes with the Edge's, which a deployed fleet, on machines of its own, does not. So
the light Nodes run at a lower priority (`light_nodes_niceness`, as the Edge's refresh
worker does): the operating system gives a busy core to the Edge, the callers' Node and
the callers first, and the light Nodes take what they leave; their acks then come as
fast as the rest of the machine allows (on a machine shared with other work, slower,
and the apply takes longer). With a niceness of 0 they compete as equals. The light
Nodes stop before the Edge does, so the Edge is not stopped while a thousand links break
at once.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import subprocess
import time
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

import httpx2
import trio
import yaml

from bench.admin_post import READY_LINE as ADMIN_READY
from bench.gateway import EdgeLog
from bench.light_nodes import DEFAULT_HANDSHAKES
from bench.light_nodes import READY_PREFIX as NODES_READY_PREFIX
from bench.load import open_client, percentile
from bench.loop_holds import ENV as HOLDS_ENV
from bench.loop_holds import LoopHolds, read_holds
from bench.procfs import process_cpu_seconds, rss_bytes
from bench.services import (
    REPO_ROOT,
    ServiceFailed,
    admin_headers,
    child_env,
    output_lines,
    python_argv,
    spawn_service,
    start_service,
)
from iop_edge.runtime.lifecycle.admin_credential import ADMIN_TOKEN_FILE
from iop_edge.runtime.lifecycle.heap import BURST, LEAK_GRACE_S

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
#: The real Node the callers' requests run on, and its model.
SIM_NODE: Final = "sim-node"
SIM_PROVIDER: Final = "sim-node-p0"
SIM_MODEL: Final = "sim-model"
#: A caller's request: a short answer from the sim provider (its default pace: 20 ms to
#: the first token, 200 tokens/s), about 60 ms when nothing is in the way.
_CALLER_BODY: Final = json.dumps(
    {
        "model": SIM_MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
    }
).encode()
#: A filtered catalog: one model's available providers, a page of this many.
_CATALOG_PAGE: Final = 100
#: Light Nodes whose providers the few-Nodes dry run's candidate changes.
FEW_NODES: Final = 10
#: The share of the fleet that leaves at once in each churn round: a little more than a
#: tenth.
CHURN_SHARE: Final = 0.11
#: Churn rounds: the churn's Nodes leave at once, then connect again.
CHURN_ROUNDS: Final = 2
#: After the last round's leave, past the heap keeper's grace for ended sessions: one
#: still alive by then is counted as leaked (`runtime.lifecycle.heap`, Rule 4).
_CHURN_SETTLE_S: Final = LEAK_GRACE_S + 2.0
#: The light Nodes' niceness: they stand in for a fleet on machines of its own, so on
#: the one machine the scenario shares they take a core only when the Edge, the callers'
#: Node and the callers leave it (the refresh worker's niceness, for the same reason).
LIGHT_NODES_NICENESS: Final = 10

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
    node_processes: int = 1
    """Processes the light Nodes are spread over."""
    caller_rate: float = 50.0
    """Caller requests a second, idle and during the refresh."""
    caller_window_s: float = 6.0
    """How long the callers are measured while the Edge is idle."""
    light_nodes_niceness: int = LIGHT_NODES_NICENESS
    """Added to the light Nodes' processes' niceness (0: they compete with the Edge as
    equals)."""

    def __post_init__(self) -> None:
        least = min(
            self.nodes,
            self.providers_per_node,
            self.models,
            self.catalog_requests,
            self.node_processes,
        )
        if least < 1:
            raise ValueError(
                "nodes, providers per node, models, catalog requests and node processes "
                "must be >= 1"
            )
        if self.light_nodes_niceness < 0:
            raise ValueError("the light Nodes' niceness must be >= 0")
        if self.node_processes > self.nodes:
            raise ValueError("more node processes than nodes")
        if min(self.idle_window_s, self.caller_rate, self.caller_window_s) <= 0:
            raise ValueError("the idle window, the caller rate and window must be > 0")

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
    """The apply's candidate (every Node changed) as a dry run: validation and plan."""
    refresh_s: float | None
    refresh_status: int
    refresh_nodes: int
    """Nodes the refresh report lists (those whose config changed)."""
    refresh_applied: int
    """... of which acked the new revision as applied."""
    refresh_problem: str | None = None
    """The first Node that did not apply, and why; or why the refresh was refused."""
    catalog_filtered_s: tuple[float, ...] = ()
    """Filtered `/catalog` latencies (one Node; a page of one model's available
    providers), sorted."""
    caller_idle_s: tuple[float, ...] = ()
    """Callers' latencies while the Edge was idle, sorted."""
    caller_refresh_s: tuple[float, ...] = ()
    """Callers' latencies of requests sent during the dry run or the apply, sorted."""
    caller_dry_run_s: tuple[float, ...] = ()
    """... of those sent during the dry run."""
    caller_apply_s: tuple[float, ...] = ()
    """... of those sent during the apply."""
    caller_errors: int = 0
    """Callers' requests that failed, in both phases."""
    dry_run_few_s: float | None = None
    """A dry run of a candidate that changes `FEW_NODES` Nodes."""
    caller_after_s: tuple[float, ...] = ()
    """Callers' latencies once the refresh is over, idle again, sorted: what the machine
    itself spreads them by, with no refresh to blame."""
    holds_refresh: LoopHolds | None = None
    """The Edge's loop holds during the dry runs and the apply (`bench.loop_holds`)."""
    holds_apply: LoopHolds | None = None
    """... during the apply."""
    holds_all: LoopHolds | None = None
    """... over the Edge's whole run: its start, the connects, the idle windows too."""
    holds_churn: LoopHolds | None = None
    """... from the first churn round (`churn_nodes` Nodes leaving at once) to
    `LEAK_GRACE_S` and more after the last (every round's leave and reconnect); None when
    the fleet is too small for a churn."""
    holds_fleet: LoopHolds | None = None
    """... from every Node connected to the churn's end: the idle windows, the catalog,
    the refresh and the churn (the guard's window)."""
    churned: int = 0
    """Nodes that left at once in each churn round, and connected again."""
    rss_before_churn: int | None = None
    """The Edge's resident memory before the churn."""
    rss_churn: tuple[int | None, ...] = ()
    """... after each churn round (every Node connected again), then once more at the
    churn's end."""

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

    @property
    def catalog_filtered_max_ms(self) -> float | None:
        return self.catalog_filtered_s[-1] * 1000 if self.catalog_filtered_s else None

    def caller_ms(self, phase: str, q: float) -> float | None:
        """A percentile of the callers' latency in `phase`: `idle`, `refresh` (the dry
        run and the apply), `dry_run`, `apply` or `after` (idle again)."""
        values = {
            "idle": self.caller_idle_s,
            "refresh": self.caller_refresh_s,
            "dry_run": self.caller_dry_run_s,
            "apply": self.caller_apply_s,
            "after": self.caller_after_s,
        }[phase]
        return percentile(values, q) * 1000 if values else None

    @property
    def caller_p99_ratio(self) -> float | None:
        """Callers' p99 during the refresh over their p99 while idle."""
        idle, busy = self.caller_ms("idle", 99.0), self.caller_ms("refresh", 99.0)
        return None if idle is None or busy is None or idle <= 0 else busy / idle


# --- the config -----------------------------------------------------------------------------------


def node_credentials(count: int) -> dict[str, str]:
    """A fresh random token for each of `count` Node ids."""
    return {f"node-{i:04d}": secrets.token_urlsafe(18) for i in range(count)}


def fleet_config(
    shape: ManyNodesShape,
    credentials: Mapping[str, str],
    state_dir: Path,
    *,
    capacity: int,
    sim_token: str | None = None,
    capacities: Mapping[str, int] | None = None,
) -> str:
    """The Edge config (YAML): every Node with its providers, each model on its providers,
    and with `sim_token` the callers' real Node (`SIM_NODE`) serving `SIM_MODEL`.
    Every provider has `capacity`, but those of the Nodes in `capacities`.

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
                    "capacity": (capacities or {}).get(node_id, capacity),
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
    models = [{"id": f"model-{m}", "providers": served[m]} for m in range(shape.models)]
    if sim_token is not None:
        nodes.append(
            {
                "id": SIM_NODE,
                "token_hash_sha256": hashlib.sha256(sim_token.encode()).hexdigest(),
                "providers": [
                    {"id": SIM_PROVIDER, "type": "sim", "models": [SIM_MODEL], "capacity": 64}
                ],
            }
        )
        models.append({"id": SIM_MODEL, "providers": {SIM_PROVIDER: SIM_MODEL}})
    config = {
        "edge": {"id": "bench-edge", "listen": "127.0.0.1:0", "state_dir": str(state_dir)},
        "admin": {"listen": "127.0.0.1:0"},
        "openai": {"listen": "127.0.0.1:0"},
        "models": models,
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


async def _catalog_latencies(
    admin: httpx2.AsyncClient, count: int, paths: list[str] | None = None
) -> tuple[list[float], int]:
    """`count` requests one after the other, cycling through `paths` (the whole catalog
    by default); their latencies and the last answer's size."""
    latencies: list[float] = []
    size = 0
    paths = paths or ["/catalog"]
    for index in range(count):
        began = time.perf_counter()
        response = await admin.get(paths[index % len(paths)])
        size = len(response.content)
        latencies.append(time.perf_counter() - began)
        response.raise_for_status()
    return latencies, size


def _filtered_paths(shape: ManyNodesShape, node_ids: list[str], count: int) -> list[str]:
    """One Node's providers, and a page of one model's available providers, by turns."""
    paths: list[str] = []
    for index in range(count):
        if index % 2 == 0:
            paths.append(f"/catalog?node={node_ids[(index * 7919) % len(node_ids)]}")
        else:
            model = f"model-{index % shape.models}"
            paths.append(f"/catalog?model={model}&health=available&limit={_CATALOG_PAGE}")
    return paths


@dataclass
class _Callers:
    """Callers' requests to `SIM_MODEL`, open loop: each latency and its phase."""

    client: httpx2.AsyncClient
    url: str
    rate: float
    phase: str = "idle"
    latencies: dict[str, list[float]] = field(
        default_factory=lambda: {"idle": [], "dry_run": [], "apply": [], "after": []}
    )
    errors: int = 0
    _stopped: trio.Event = field(default_factory=trio.Event)
    _entered: trio.Event = field(default_factory=trio.Event)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Send requests at `rate` a second until `stop()`, each in its own task, and one
        at once on entering a phase (a phase shorter than the pace still has its sample);
        return once the last one finished (a slow one is what the refresh phase is about)."""
        async with trio.open_nursery() as requests:
            task_status.started()
            due = trio.current_time()
            while not self._stopped.is_set():
                requests.start_soon(self._one, self.phase)
                due += 1 / self.rate
                with trio.move_on_at(due):  # the pace of an open-loop load
                    await self._entered.wait()
                    self._entered = trio.Event()
                    due = trio.current_time()

    def enter(self, phase: str) -> None:
        """From now on requests belong to `phase`; the first is sent at once."""
        self.phase = phase
        self._entered.set()

    def stop(self) -> None:
        self._stopped.set()
        self._entered.set()

    async def _one(self, phase: str) -> None:
        began = time.perf_counter()
        try:
            response = await self.client.post(
                self.url, content=_CALLER_BODY, headers={"content-type": "application/json"}
            )
        except httpx2.HTTPError:
            self.errors += 1
            return
        if response.status_code != 200:
            self.errors += 1
            return
        self.latencies[phase].append(time.perf_counter() - began)


async def _refresh_body(workdir: Path, name: str, mode: str, candidate: str) -> Path:
    """A `POST /refresh` body, written to a file before the callers' load starts (a
    fleet's config is megabytes of JSON)."""
    path = workdir / f"refresh-{name}.json"
    body = json.dumps({"mode": mode, "config_yaml": candidate}).encode()
    await trio.Path(path).write_bytes(body)
    return path


@dataclass
class _AdminPost:
    """One `POST /refresh` sent from a child process (`bench.admin_post`), as an
    operator's comes from elsewhere: megabytes sent and read on this process's event loop
    would hold the callers' requests, whose latency is the measurement. The child is
    started (`start`) before the measurement, so a Python starting up is not measured
    either; `send` has it send."""

    process: trio.Process
    lines: AsyncGenerator[str, None]

    @classmethod
    async def start(
        cls, nursery: trio.Nursery, admin_url: str, body: Path, answer: Path, token_file: Path
    ) -> _AdminPost:
        """The child, connected and waiting; `nursery` owns it. `token_file`: the admin
        credential it presents."""
        argv = python_argv(
            "bench.admin_post", f"{admin_url}/refresh", str(body), str(answer), str(token_file)
        )
        process: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=str(REPO_ROOT),
                env=child_env(),
            )
        )
        assert process.stdout is not None
        post = cls(process, output_lines(process.stdout))
        async for line in post.lines:
            if line == ADMIN_READY:
                return post
        raise ServiceFailed("admin post", "exited before it was ready", ())

    async def send(self) -> tuple[float, int]:
        """Send it: the seconds the Edge took to answer, and the answer's status (its
        body is left in the child's answer file)."""
        assert self.process.stdin is not None
        await self.process.stdin.send_all(b"go\n")
        async with aclosing(self.lines) as lines:
            async for line in lines:
                result = json.loads(line)
                return float(result["elapsed_s"]), int(result["status"])
        raise ServiceFailed("admin post", "exited without an answer", ())


def _applied(status: int, answer: bytes) -> tuple[int, int, str | None]:
    """An apply's answer: (Nodes reported, Nodes applied, the first problem). Read once
    the callers stopped: decoding a fleet's report takes this process's loop a while."""
    try:
        report = json.loads(answer)
    except ValueError:
        report = {"errors": answer[:300].decode(errors="replace")}
    nodes = report.get("nodes", []) if isinstance(report, dict) else []
    applied = sum(1 for node in nodes if node.get("status") == "applied")
    problem: str | None = None
    for node in nodes:
        if node.get("status") != "applied":
            problem = f"node {node.get('id')}: {node.get('status')}: {node.get('detail')}"
            break
    if status != 200:
        errors = report.get("errors") if isinstance(report, dict) else None
        problem = f"HTTP {status}: {json.dumps(errors or report)[:300]}"
    return len(nodes), applied, problem


def _nodes_ready(line: str) -> str | None:
    return line if line.startswith(NODES_READY_PREFIX) else None


def churn_nodes(nodes: int) -> int:
    """How many of `nodes` light Nodes leave at once in a churn round: `CHURN_SHARE` of
    them, and at least a burst of connects (`runtime.lifecycle.heap`, Rule 2); 0 when
    that is more than half the fleet (the churn is then not measured)."""
    churn = max(BURST, math.ceil(CHURN_SHARE * nodes))
    return churn if 2 * churn <= nodes else 0


async def _nodes_file(workdir: Path, name: str, part: Mapping[str, str]) -> Path:
    path = workdir / f"light-nodes-{name}.json"
    await trio.Path(path).touch(mode=0o600)
    await trio.Path(path).write_text(json.dumps(dict(part)), encoding="utf-8")
    return path


async def _nodes_files(
    workdir: Path, credentials: Mapping[str, str], processes: int, churn: int
) -> tuple[list[Path], Path | None]:
    """The light Nodes' credentials split into one file per process, and the first
    `churn` of them in a file of their own (a process that leaves at once). Tokens go
    only in files readable by this user, never on a command line."""
    items = list(credentials.items())
    churn_file = await _nodes_file(workdir, "churn", dict(items[:churn])) if churn else None
    items = items[churn:]
    files = [
        await _nodes_file(workdir, str(index), dict(items[index::processes]))
        for index in range(processes)
    ]
    return files, churn_file


async def _churn_service(
    scope: trio.CancelScope, argv: list[str], *, task_status: trio.TaskStatus[None]
) -> None:
    """The churn's light Nodes, in a task of their own: `scope.cancel()` stops them and
    nothing else (a nursery's own scope would cancel the body that started them)."""
    with scope:
        async with trio.open_nursery() as nursery:
            await start_service(nursery, "light-nodes (churn)", argv, _nodes_ready)
            task_status.started()


async def _wait_available_at_most(admin: httpx2.AsyncClient, providers: int) -> None:
    """Return once the catalog shows at most `providers` providers connected and
    available (Nodes left). The caller's deadline bounds the wait."""
    # Another process's catalog: nothing to wait on but re-reading it (as above).
    while await _available_providers(admin) > providers:  # noqa: ASYNC110
        await trio.sleep(_READINESS_INTERVAL_S)


@dataclass
class _Churn:
    """The churn's light Nodes: a process of their own in `nursery`, stopped and started
    again each round (`CHURN_ROUNDS`)."""

    nursery: trio.Nursery
    argv: list[str]
    admin: httpx2.AsyncClient
    providers: int
    """Every provider of the fleet (the sim Node's included)."""
    leaving: int
    """... of which the churn's Nodes have."""
    edge_pid: int
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    async def start(self) -> None:
        self.scope = trio.CancelScope()
        await self.nursery.start(_churn_service, self.scope, self.argv)

    async def rounds(self) -> tuple[int | None, ...]:
        """Every round: the churn's Nodes leave at once, the Edge sees them gone, they
        connect again and report in; the Edge's RSS after each. Then the settle past the
        heap keeper's grace, and the RSS once more."""
        rss: list[int | None] = []
        left_at = time.monotonic()
        for _ in range(CHURN_ROUNDS):
            self.scope.cancel()  # a share of the fleet leaves at once
            left_at = time.monotonic()
            await _wait_available_at_most(self.admin, self.providers - self.leaving)
            await self.start()
            await _wait_all_available(self.admin, self.providers)
            rss.append(await rss_bytes(self.edge_pid))
        # The settle is the measurement: a leaked session would bring a thaw within it.
        await trio.sleep(max(0.0, left_at + _CHURN_SETTLE_S - time.monotonic()))
        rss.append(await rss_bytes(self.edge_pid))
        return tuple(rss)


async def measure_many_nodes(
    shape: ManyNodesShape, workdir: Path, *, handshakes: int = DEFAULT_HANDSHAKES
) -> ManyNodesMeasurement:
    """Start an Edge with `shape.nodes` Nodes configured, connect them, measure, stop both.

    The caller owns the deadline (ten thousand Nodes take several minutes on 2 cores)."""
    await trio.Path(workdir).mkdir(parents=True, exist_ok=True)
    credentials = node_credentials(shape.nodes)
    sim_token = secrets.token_urlsafe(18)
    config_path = workdir / "edge.yaml"
    state_dir = workdir / "edge-state"
    text = fleet_config(shape, credentials, state_dir, capacity=_CAPACITY, sim_token=sim_token)
    await trio.Path(config_path).write_text(text, encoding="utf-8")
    churned = churn_nodes(shape.nodes)
    nodes_files, churn_file = await _nodes_files(
        workdir, credentials, shape.node_processes, churned
    )
    candidate = fleet_config(
        shape, credentials, state_dir, capacity=_CAPACITY + 1, sim_token=sim_token
    )
    spread = list(credentials)[:: max(1, shape.nodes // FEW_NODES)][:FEW_NODES]
    few_candidate = fleet_config(
        shape,
        credentials,
        state_dir,
        capacity=_CAPACITY,
        sim_token=sim_token,
        capacities=dict.fromkeys(spread, _CAPACITY + 2),
    )

    holds_path = workdir / "loop-holds.jsonl"
    await trio.Path(holds_path).unlink(missing_ok=True)
    async with trio.open_nursery() as edge_scope:
        edge = await start_service(
            edge_scope,
            "iop-edge (many nodes)",
            # INFO: the Edge logs the URLs it bound at INFO (and a line per Node connect).
            # The Edge as it is, with its loop's long steps recorded (`bench.loop_holds`).
            python_argv(
                "bench.loop_holds", "serve", "--config", str(config_path), "--log-level", "INFO"
            ),
            EdgeLog(),
            env=child_env({HOLDS_ENV: str(holds_path)}),
            stop_grace_s=_EDGE_STOP_GRACE_S,
        )
        rss_empty = await rss_bytes(edge.pid)
        sim_argv = python_argv("iop_node", "run", "--edge", edge.ready.node, "--node-id", SIM_NODE)
        await spawn_service(
            edge_scope, "iop-node (sim)", sim_argv, env={"IOP_NODE_TOKEN": sim_token}
        )
        async with (
            trio.open_nursery() as nodes_scope,
            httpx2.AsyncClient(
                base_url=edge.ready.admin,
                timeout=_ADMIN_TIMEOUT_S,
                headers=admin_headers(state_dir),
            ) as admin,
            open_client(64) as caller_client,
        ):
            began = time.perf_counter()
            # Every light Node dials from this host: the processes share the Edge's bound
            # of pending handshakes per source.
            per_process = max(1, handshakes // len(nodes_files))

            def light_argv(nodes_file: Path, handshakes: int) -> list[str]:
                return python_argv(
                    "bench.light_nodes",
                    "--edge", edge.ready.node,
                    "--nodes-file", str(nodes_file),
                    "--handshakes", str(handshakes),
                    "--niceness", str(shape.light_nodes_niceness),
                )  # fmt: skip

            async def start_light(index: int, nodes_file: Path) -> None:
                argv = light_argv(nodes_file, per_process)
                name = f"light-nodes {index + 1}/{len(nodes_files)}"
                await start_service(nodes_scope, name, argv, _nodes_ready)

            try:
                async with trio.open_nursery() as starting:
                    for index, nodes_file in enumerate(nodes_files):
                        starting.start_soon(start_light, index, nodes_file)
                churn: _Churn | None = None
                if churn_file is not None:  # after the others: the handshakes are its alone
                    churn = _Churn(
                        nodes_scope,
                        light_argv(churn_file, handshakes),
                        admin,
                        providers=shape.providers + 1,
                        leaving=churned * shape.providers_per_node,
                        edge_pid=edge.pid,
                    )
                    await churn.start()
            except* ServiceFailed as failed:
                raise failed.exceptions[0] from None
            await _wait_all_available(admin, shape.providers + 1)
            connect_s = time.perf_counter() - began
            connected = time.monotonic()
            await trio.sleep(_SETTLE_S)
            idle_cpu_s = await _idle_cpu(edge.pid, shape.idle_window_s)
            rss_connected = await rss_bytes(edge.pid)
            latencies, catalog_bytes = await _catalog_latencies(admin, shape.catalog_requests)
            filtered, _ = await _catalog_latencies(
                admin,
                shape.catalog_requests,
                _filtered_paths(shape, list(credentials), shape.catalog_requests),
            )
            callers = _Callers(
                caller_client, f"{edge.ready.openai}/v1/chat/completions", shape.caller_rate
            )
            bodies = [
                await _refresh_body(workdir, "few", "dry_run", few_candidate),
                await _refresh_body(workdir, "dry-run", "dry_run", candidate),
                await _refresh_body(workdir, "apply", "apply", candidate),
            ]
            answer = workdir / "refresh-answer.json"
            token_file = state_dir / ADMIN_TOKEN_FILE
            async with trio.open_nursery() as load:
                few_dry_run, dry_run, apply = [
                    await _AdminPost.start(load, edge.ready.admin, body, answer, token_file)
                    for body in bodies
                ]
                await load.start(callers.run)
                await trio.sleep(shape.caller_window_s)  # the idle phase is a time window
                callers.enter("dry_run")
                refresh_began = time.monotonic()
                dry_run_few = await few_dry_run.send()
                dry_run_all = await dry_run.send()
                callers.enter("apply")
                apply_began = time.monotonic()
                refresh_s, status = await apply.send()
                refresh_ended = time.monotonic()
                callers.enter("after")
                await trio.sleep(shape.caller_window_s)  # idle again: the control window
                callers.stop()  # requests still in flight finish, in their phase
            dry_run_few_s = dry_run_few[0] if dry_run_few[1] == 200 else None
            dry_run_s = dry_run_all[0] if dry_run_all[1] == 200 else None
            reported, applied, problem = _applied(status, await trio.Path(answer).read_bytes())
            rss_after_refresh = await rss_bytes(edge.pid)
            holds = str(holds_path)
            rss_before_churn = await rss_bytes(edge.pid)
            churn_began = time.monotonic()
            rss_churn = await churn.rounds() if churn is not None else ()
            churn_ended = time.monotonic()
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
        catalog_filtered_s=tuple(sorted(filtered)),
        caller_idle_s=tuple(sorted(callers.latencies["idle"])),
        caller_refresh_s=tuple(sorted(callers.latencies["dry_run"] + callers.latencies["apply"])),
        caller_dry_run_s=tuple(sorted(callers.latencies["dry_run"])),
        caller_apply_s=tuple(sorted(callers.latencies["apply"])),
        caller_errors=callers.errors,
        dry_run_few_s=dry_run_few_s,
        caller_after_s=tuple(sorted(callers.latencies["after"])),
        holds_refresh=read_holds(holds, refresh_began, refresh_ended),
        holds_apply=read_holds(holds, apply_began, refresh_ended),
        holds_all=read_holds(holds),
        holds_churn=read_holds(holds, churn_began, churn_ended) if churn is not None else None,
        holds_fleet=read_holds(holds, connected, churn_ended),
        churned=churned,
        rss_before_churn=rss_before_churn,
        rss_churn=rss_churn,
    )
