"""`python -m bench.soak` (`just soak`): minutes of mixed load with chaos, then the books.

One Edge and two Nodes, each a real process, serving one model from two `sim`
providers and one `vllm` provider in front of the bench's upstream (its streams paced,
so hang-ups cut some of them: the HTTP adapter's connections live through the chaos
too). For `--minutes`, `--concurrency` callers send stream and non-stream requests
of random lengths and hang up on a random fraction of them; meanwhile one Node is
killed with SIGKILL and restarted, live refreshes change a provider's capacity back
and forth, and, at two thirds of the run, the disk under `state_dir` is full for
`--full-disk-s` seconds (a tmpfs of `STATE_DISK_SIZE` filled with a ballast file, then
emptied: the usage ledger keeps the records in memory meanwhile; mounting needs root,
else the window is skipped, saying so). At five sixths of the run the Edge restarts
(`POST /restart`, a zero-downtime handover to a new process): callers have no retries,
so every request that started while the old process drained must be answered
(`--no-restart` skips it). All along, one caller stores large Responses
(`store: true`, `STORE_FILLER_INPUT` each) as fast as it is answered, with no share of
its own (`max_bytes_per_principal` above `STATE_DISK_SIZE`): the store fills the disk up to
`edge.responses.min_free_bytes` and then answers it `store: false`
(`x-iop-response-stored`, counted by that header's value), never taking the room the
usage ledger needs; and as the usage records grow into that room (about 250 bytes a
run: a 15-minute run's take more than the default reserve), the store drops its least
recently used responses to give it back. The other callers see no 503 for it and no row
is lost.

**Shared runtime.** The upstream is a runtime IOP shares with another application
(`bench.upstream --slots`): node-2 also relays a second model, `SHARED_MODEL`, to it
through `SHARED_PROVIDER`, the only provider of that model, which `SHARED_CALLERS`
callers ask now and then (a pause between requests), so the provider is often idle
on IOP's side when its health probe runs (every `SHARED_HEALTH_INTERVAL_S`). At half
the run, between the Node's SIGKILL and the full disk, a process that is not IOP
(`bench.shared_runtime`) keeps the runtime saturated for `--shared-runtime-s` seconds:
IOP's streams there come slower and the runtime's model list does not answer, so the
probe times out on a connection the runtime accepted. Busy is not down: the phase holds
when, from the moment the other application's streams are all answered until it is
stopped,
- every look at the catalog (every `HEALTH_SAMPLE_S`) shows both providers on the
  runtime (`vllm-2`, `SHARED_PROVIDER`) `available` or `busy`, never anything else;
- every `SHARED_MODEL` request that started in the window was served (200, or a
  stream to `[DONE]`) unless its own caller hung up: no `503 no_provider`, which is
  what callers got when such a probe timeout marked the provider down, and no other
  error; and at least one was served.

Then the load stops and the report says:

- every request's end, by class (200, each HTTP error code, a stream cut by an error
  event, the callers' own hang-ups);
- ledger rows lost: responses a caller received completely whose run is not in the
  usage ledger after the Edge stopped (must be 0);
- slot counters once idle: `in_flight` and `queued` of every provider and model in the
  catalog (must be 0);
- Edge and Node resident memory over time (must stay bounded);
- the shared-runtime phase: the providers' health as the catalog showed it, and how
  the `SHARED_MODEL` requests that started in the window ended, against those of the
  rest of the run;
- the restart: how the requests that started from `POST /restart` until the old process
  exited ended (every one answered, or hung up by its own caller).

Then the reliability phases (`bench.soak_phases`: budgets across replicas, fair
queueing by work, hostile upstream replies, a runtime that restarts), each with its own
Edge and Node, each printing its books.

Exit status 0 when the books balance (0 lost rows, 0 leaked slots), the shared-runtime
phase held, the restart failed no request and no reliability phase failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import trio
import yaml

from bench.ballast import fill_disk, state_disk
from bench.gateway import EdgeLog, EdgeUrls, wait_servable
from bench.services import (
    REPO_ROOT,
    Service,
    ServiceFailed,
    admin_headers,
    child_env,
    python_argv,
    start_service,
)
from bench.shared_runtime import PROGRESS_PREFIX
from bench.soak_catalog import (
    HEALTH_SAMPLE_S,
    all_answered,
    routable,
    until_available,
    watch_runtime_health,
)
from bench.soak_phases import PHASES, run_phases
from bench.upstream import SERVED_MODEL, start_upstream

NODE_TOKEN = "soak-node-token-not-a-secret"
#: The tmpfs `state_dir` lives on when the soak can mount one (the full-disk window).
STATE_DISK_SIZE = "256m"
#: The upstream's pace: a 22-token stream takes about 55 ms, so some hang-ups land in it.
UPSTREAM_TOKENS_PER_SECOND = 400
MESSAGES = [{"role": "user", "content": "soak"}]
#: The model only the shared runtime serves, through node-2's `SHARED_PROVIDER`.
SHARED_MODEL = "m-shared"
SHARED_PROVIDER = "shared-2"
SHARED_CAPACITY = 2
#: `SHARED_PROVIDER`'s `health_interval_s` (its probe timeout is the same, the shorter of
#: the two): a shared-runtime window of 15 s holds several of its probes.
SHARED_HEALTH_INTERVAL_S = 2.0
SHARED_CALLERS = 2
#: The store filler's input: about 250 KB, so it reaches the disk's reserve in minutes.
STORE_FILLER_INPUT = "lorem ipsum " * 21_000
#: Seconds a `SHARED_MODEL` caller waits between two requests (uniform), so that the
#: provider has no run of IOP's in flight at most of its health probes.
SHARED_PAUSE_S = (0.5, 1.5)
#: The runtime's full-pace sequences: vllm-2's capacity (8) and `SHARED_CAPACITY`, so
#: IOP alone never saturates it; only the other application does.
UPSTREAM_SLOTS = 10
#: The other application's streams: enough above the slots that the runtime stays
#: saturated when some of them are between two requests.
OTHER_APP_STREAMS = UPSTREAM_SLOTS + 4
#: The providers in front of the shared runtime.
RUNTIME_PROVIDERS = ("vllm-2", SHARED_PROVIDER)
#: How long the report waits for `SHARED_PROVIDER` to be `available` again after the
#: phase: a few of its health intervals (a probe waiting on the model list is answered
#: as soon as the runtime has a free slot).
RECOVERY_BOUND_S = 5 * SHARED_HEALTH_INTERVAL_S
#: Kept free between the shared-runtime and full-disk windows: the other application's
#: start-up.
PHASE_GAP_S = 5.0


@dataclass
class Books:
    outcomes: Counter[str] = field(default_factory=Counter)
    completed: list[str] = field(default_factory=list)
    """Run ids of responses their caller received to the end."""
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    shared_ends: list[tuple[float, str]] = field(default_factory=list)
    """(start, in seconds into the run; end class) of every `SHARED_MODEL` request."""
    window: tuple[float, float] | None = None
    """The shared-runtime window, in seconds into the run (None: it did not run)."""
    health: dict[str, Counter[str]] = field(default_factory=dict)
    """Catalog looks during the window: per runtime provider, how many saw each state."""
    ends: list[tuple[float, str]] = field(default_factory=list)
    """(start, in seconds into the run; end class) of every request."""
    restart: tuple[float, float] | None = None
    """From `POST /restart` until the old Edge exited, in seconds into the run."""
    successor: int | None = None
    """The pid of the Edge process that took over, once one did."""
    responses_held: int = 0
    """The responses the store held at the end."""

    def end(self, model: str, started_s: float, outcome: str, run_id: str | None) -> None:
        """Book one request's end; `run_id` when its caller received it to the end."""
        self.outcomes[outcome] += 1
        self.ends.append((started_s, outcome))
        if run_id is not None:
            self.completed.append(run_id)
        if model == SHARED_MODEL:
            self.shared_ends.append((started_s, outcome))


def _config(state: Path, capacity: int, upstream_url: str) -> str:
    token_hash = hashlib.sha256(NODE_TOKEN.encode()).hexdigest()
    adapter = {"ttft_ms": 20, "tokens_per_second": 400}
    runtime = {"base_url": f"{upstream_url}/v1"}
    http = {"id": "vllm-2", "type": "vllm", "models": [SERVED_MODEL], "capacity": 8,
            "adapter": runtime}  # fmt: skip
    shared = {"id": SHARED_PROVIDER, "type": "vllm", "models": [SERVED_MODEL],
              "capacity": SHARED_CAPACITY,
              "adapter": {**runtime, "health_interval_s": SHARED_HEALTH_INTERVAL_S}}  # fmt: skip

    def node(index: int, cap: int) -> dict[str, Any]:
        provider = {"id": f"sim-{index}", "type": "sim", "models": ["sim-small"],
                    "capacity": cap, "adapter": adapter}  # fmt: skip
        # The second Node, killed and restarted, also relays to the HTTP upstream.
        providers = [provider, http, shared] if index == 2 else [provider]
        return {"id": f"node-{index}", "token_hash_sha256": token_hash, "providers": providers}

    config = {
        "edge": {
            "listen": "127.0.0.1:0",
            "state_dir": str(state),
            "shutdown_grace_s": 5,
            # Above `STATE_DISK_SIZE`: there, only the disk's reserve bounds the filler.
            "responses": {"max_bytes_per_principal": 512 << 20, "max_bytes": 512 << 20},
        },
        "admin": {"listen": "127.0.0.1:0"},
        "openai": {"listen": "127.0.0.1:0"},
        "dispatch": {"max_queue": 512, "queue_timeout_ms": 30_000},
        "models": [
            {
                "id": "m",
                "providers": {"sim-1": "sim-small", "sim-2": "sim-small", "vllm-2": SERVED_MODEL},
            },
            {"id": SHARED_MODEL, "providers": {SHARED_PROVIDER: SERVED_MODEL}},
        ],
        "nodes": [node(1, 8), node(2, capacity)],
    }
    return yaml.safe_dump(config, sort_keys=False)


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Node:
    """A Node process that the soak may kill and restart at will."""

    def __init__(self, node_id: str, edge_url: str, log: Path) -> None:
        self.node_id = node_id
        self.edge_url = edge_url
        self.log = log
        self.process: trio.Process | None = None
        self._scope: trio.CancelScope | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        argv = python_argv("iop_node", "run", "--edge", self.edge_url, "--node-id", self.node_id)
        with self.log.open("ab") as output, trio.CancelScope() as scope:
            self._scope = scope
            self.process = await trio.lowlevel.open_process(
                argv, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                cwd=str(REPO_ROOT), env=child_env({"IOP_NODE_TOKEN": NODE_TOKEN}),
            )  # fmt: skip
            task_status.started()
            try:
                await self.process.wait()
            finally:
                if self.process.returncode is None:
                    self.process.kill()
                    with trio.CancelScope(shield=True), trio.move_on_after(5):
                        await self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)


@dataclass(frozen=True)
class _Calls:
    """What one caller asks for: `model`, and how long it pauses between two requests
    (None: it sends the next one at once)."""

    http: httpx2.AsyncClient
    books: Books
    started: float
    model: str = "m"
    pause_s: tuple[float, float] | None = None


async def _caller(calls: _Calls, rng: random.Random, stop: trio.Event) -> None:
    while not stop.is_set():
        stream = rng.random() < 0.5
        body = {"model": calls.model, "messages": MESSAGES, "max_tokens": rng.randint(1, 64),
                "stream": stream}  # fmt: skip
        hang_up_after = rng.uniform(0.01, 0.2) if rng.random() < 0.15 else None
        started_s = time.monotonic() - calls.started
        outcome, run_id = "caller hung up" if hang_up_after else "caller timeout", None
        with trio.move_on_after(hang_up_after or 120):
            try:
                outcome, run_id = await (_stream if stream else _call)(calls.http, body)
            except httpx2.TransportError as exc:
                outcome = f"transport: {type(exc).__name__}"
        calls.books.end(calls.model, started_s, outcome, run_id)
        if calls.pause_s is not None:
            await trio.sleep(rng.uniform(*calls.pause_s))


async def _store_filler(calls: _Calls, stop: trio.Event) -> None:
    """Store large Responses until stopped (module docstring)."""
    body = {"model": calls.model, "input": STORE_FILLER_INPUT, "max_output_tokens": 8}
    while not stop.is_set():
        started_s = time.monotonic() - calls.started
        outcome, run_id = "caller timeout", None
        with trio.move_on_after(120):
            try:
                response = await calls.http.post("/v1/responses", json=body)
                if response.status_code == 200:
                    stored = response.headers.get("x-iop-response-stored")
                    outcome, run_id = (
                        f"200 responses stored={stored}",
                        response.headers["x-request-id"],
                    )
                else:
                    outcome = f"{response.status_code} {_code(response.content)}"
            except httpx2.TransportError as exc:
                outcome = f"transport: {type(exc).__name__}"
        calls.books.end(calls.model, started_s, outcome, run_id)


async def _call(http: httpx2.AsyncClient, body: dict[str, Any]) -> tuple[str, str | None]:
    """A non-stream request: its end class, and its run id if it completed."""
    response = await http.post("/v1/chat/completions", json=body)
    if response.status_code == 200:
        return "200", response.headers["x-request-id"]
    return f"{response.status_code} {_code(response.content)}", None


async def _stream(http: httpx2.AsyncClient, body: dict[str, Any]) -> tuple[str, str | None]:
    """A stream request read to its end: its end class, and its run id if it completed."""
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return f"{response.status_code} {_code(response.content)}", None
        last = previous = ""
        async for line in response.aiter_lines():
            if line:
                previous, last = last, line
        if last != "data: [DONE]":
            return "stream without [DONE]", None
        if '"error"' in previous:
            return f"stream error event {_code(previous.removeprefix('data: '))}", None
        return "200 stream", response.headers["x-request-id"]


def _code(body: bytes | str) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


@dataclass(frozen=True)
class _Chaos:
    nursery: trio.Nursery
    node: Node
    admin: httpx2.AsyncClient
    state: Path
    upstream_url: str
    minutes: float
    started: float
    full_disk_s: float
    """0: no full-disk window (not asked for, or no disk of its own to fill)."""
    shared_runtime_s: float
    """0: no shared-runtime phase."""
    edge: Service[EdgeUrls] | None = None
    """The Edge process, restarted at five sixths of the run (None: no restart)."""

    def since(self) -> float:
        """Seconds into the run."""
        return time.monotonic() - self.started


async def _chaos(chaos: _Chaos, books: Books) -> None:
    """A SIGKILL of node-2 at a third of the run (restarted 3 s later), and a live
    refresh of its capacity every 20 s."""
    node, admin, started = chaos.node, chaos.admin, chaos.started
    kill_at = started + chaos.minutes * 60 / 3
    killed = False
    capacity = 8
    while True:
        await trio.sleep(min(20.0, max(0.0, kill_at - time.monotonic())) if not killed else 20.0)
        if not killed and time.monotonic() >= kill_at:
            node.kill()
            books.events.append(f"{time.monotonic() - started:6.1f}s node-2 SIGKILL")
            killed = True
            await trio.sleep(3)
            await chaos.nursery.start(node.run)
            books.events.append(f"{time.monotonic() - started:6.1f}s node-2 restarted")
            continue
        capacity = 6 if capacity == 8 else 8
        text = _config(chaos.state, capacity, chaos.upstream_url)
        body = {"mode": "apply", "config_yaml": text}
        response = await admin.post("/refresh", json=body)
        outcome = response.json().get("outcome", response.status_code)
        books.events.append(
            f"{time.monotonic() - started:6.1f}s refresh sim-2 capacity={capacity}: {outcome}"
        )


async def _shared_runtime(chaos: _Chaos, books: Books) -> None:
    """At half the run, another application saturates the runtime for
    `shared_runtime_s` seconds while the catalog is watched (module docstring)."""
    if not chaos.shared_runtime_s:
        return
    await trio.sleep(chaos.minutes * 60 / 2)
    argv = python_argv(
        "bench.shared_runtime", chaos.upstream_url, "--streams", str(OTHER_APP_STREAMS)
    )
    async with trio.open_nursery() as own:
        with trio.fail_after(30):  # its start-up, and a 200 head on each of its streams
            other = await start_service(own, "shared-runtime client", argv, all_answered)
        opened = chaos.since()
        books.events.append(
            f"{opened:6.1f}s another application keeps the runtime saturated "
            f"({OTHER_APP_STREAMS} streams, {UPSTREAM_SLOTS} slots)"
        )
        try:
            with trio.move_on_after(chaos.shared_runtime_s):
                await watch_runtime_health(chaos.admin, RUNTIME_PROVIDERS, books.health)
        finally:  # a run that ends first still reports the window it had
            books.window = (opened, chaos.since())
        progress = next(
            (
                line.removeprefix(PROGRESS_PREFIX)
                for line in reversed(other.tail)
                if line.startswith(PROGRESS_PREFIX)
            ),
            "no progress line yet",
        )
        own.cancel_scope.cancel()
    books.events.append(f"{chaos.since():6.1f}s another application stopped; its {progress}")
    with trio.move_on_after(RECOVERY_BOUND_S):
        await until_available(chaos.admin, SHARED_PROVIDER)
        books.events.append(f"{chaos.since():6.1f}s {SHARED_PROVIDER} available again")
        return
    books.events.append(
        f"{chaos.since():6.1f}s {SHARED_PROVIDER} still not available "
        f"{RECOVERY_BOUND_S:g}s after the other application stopped"
    )


async def _restart(chaos: _Chaos, books: Books) -> None:
    """At five sixths of the run, a zero-downtime restart of the Edge; books the window
    from the request until the old process exited (module docstring)."""
    edge = chaos.edge
    if edge is None:
        return
    await trio.sleep(chaos.minutes * 60 * 5 / 6)
    began = chaos.since()
    response = await chaos.admin.post("/restart")
    report = response.json()
    if report.get("outcome") != "handed_over":
        books.events.append(f"{began:6.1f}s restart {report.get('outcome')}: {report}")
        return
    books.successor = int(report["successor_pid"])
    with trio.move_on_after(60):
        await edge.process.wait()
    books.restart = (began, chaos.since())
    books.events.append(
        f"{began:6.1f}s Edge restarted: pid {edge.pid} -> {books.successor}, the old one "
        f"exited {books.restart[1] - began:.1f}s later"
    )


async def _full_disk(chaos: _Chaos, books: Books) -> None:
    """At two thirds of the run, fill the disk under `state_dir` for `full_disk_s`
    seconds, then empty it (module docstring)."""
    if not chaos.full_disk_s:
        return
    await trio.sleep(chaos.minutes * 60 * 2 / 3)
    ballast = chaos.state.parent / "ballast"
    await trio.to_thread.run_sync(fill_disk, ballast)
    since = time.monotonic() - chaos.started
    books.events.append(f"{since:6.1f}s disk under state_dir full")
    try:
        await trio.sleep(chaos.full_disk_s)
        metrics = (await chaos.admin.get("/metrics")).text
        books.events.append(f"{time.monotonic() - chaos.started:6.1f}s {_ledger_line(metrics)}")
    finally:
        ballast.unlink(missing_ok=True)
    books.events.append(f"{time.monotonic() - chaos.started:6.1f}s disk emptied")


def _ledger_line(metrics: str) -> str:
    """The usage ledger's state and backlog, from `/metrics`."""
    values = {}
    for line in metrics.splitlines():
        if line.startswith(("iop_usage_unwritten_records ", "iop_usage_ledger_state{")):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    state = next(
        (name.split('"')[1] for name, value in values.items() if "state{" in name and value),
        "?",
    )
    waiting = int(values.get("iop_usage_unwritten_records", 0))
    return f"usage ledger {state}, {waiting} record(s) waiting in memory"


def _pid(node: Node) -> int | None:
    return node.process.pid if node.process is not None else None


async def _sample_rss(
    pids: dict[str, Callable[[], int | None]], books: Books, started: float
) -> None:
    while True:
        for name, pid in pids.items():
            value = pid()
            rss = _rss_kib(value) if value else None
            if rss is not None:
                books.rss.setdefault(name, []).append((time.monotonic() - started, rss))
        await trio.sleep(5)


@dataclass(frozen=True)
class SoakOptions:
    """The command line: the run's length and load, and the two windows (0: none)."""

    minutes: float
    concurrency: int
    seed: int
    full_disk_s: float
    shared_runtime_s: float
    restart: bool = True
    phases: tuple[str, ...] = tuple(PHASES)
    """The reliability phases run after the mixed load (`bench.soak_phases`)."""


async def soak(options: SoakOptions) -> int:
    folder = Path(tempfile.mkdtemp(prefix="iop-soak-"))
    with state_disk(folder, options.full_disk_s, STATE_DISK_SIZE) as window_s:
        state = folder / "disk" / "state" if window_s else folder / "state"
        status = await _soak(
            dataclasses.replace(options, full_disk_s=window_s), folder=folder, state=state
        )
    held = await run_phases(folder / "phases", options.phases)
    return status if held else 1


async def _soak(options: SoakOptions, *, folder: Path, state: Path) -> int:
    minutes, concurrency = options.minutes, options.concurrency
    books = Books()
    config = folder / "edge.yaml"
    stopping = False
    try:
        async with trio.open_nursery() as nursery:
            pace, slots = str(UPSTREAM_TOKENS_PER_SECOND), str(UPSTREAM_SLOTS)
            upstream = await start_upstream(nursery, "--tokens-per-second", pace, "--slots", slots)
            config.write_text(_config(state, 8, upstream.ready), encoding="utf-8")
            argv = python_argv("iop_edge", "serve", "--config", str(config))
            edge = await start_service(nursery, "edge", argv, EdgeLog())
            urls = edge.ready
            nodes = [Node(f"node-{i}", urls.node, folder / f"node-{i}.log") for i in (1, 2)]
            for node in nodes:
                await nursery.start(node.run)
            limits = httpx2.Limits(max_connections=concurrency * 2)
            async with (
                httpx2.AsyncClient(base_url=urls.openai, timeout=60, limits=limits) as http,
                httpx2.AsyncClient(
                    base_url=urls.admin, timeout=60, headers=admin_headers(state)
                ) as admin,
            ):
                with trio.fail_after(30):  # the soak's own start-up
                    await wait_servable(urls.admin)
                started = time.monotonic()
                stop = trio.Event()
                async with trio.open_nursery() as work:
                    pids: dict[str, Callable[[], int | None]] = {
                        "edge": lambda: books.successor or edge.pid,
                        **{node.node_id: partial(_pid, node) for node in nodes},
                    }
                    work.start_soon(_sample_rss, pids, books, started)
                    chaos = _Chaos(
                        nursery,
                        nodes[1],
                        admin,
                        state,
                        upstream.ready,
                        minutes,
                        started,
                        options.full_disk_s,
                        options.shared_runtime_s,
                        edge if options.restart else None,
                    )
                    work.start_soon(_chaos, chaos, books)
                    work.start_soon(_restart, chaos, books)
                    work.start_soon(_full_disk, chaos, books)
                    work.start_soon(_shared_runtime, chaos, books)
                    rng = random.Random(options.seed)
                    calls = _Calls(http, books, started)
                    shared = _Calls(http, books, started, SHARED_MODEL, SHARED_PAUSE_S)
                    async with trio.open_nursery() as callers:
                        for caller in [calls] * concurrency + [shared] * SHARED_CALLERS:
                            caller_rng = random.Random(rng.random())
                            callers.start_soon(_caller, caller, caller_rng, stop)
                        callers.start_soon(_store_filler, calls, stop)
                        await trio.sleep(minutes * 60)
                        stop.set()
                    work.cancel_scope.cancel()
                idle = await _catalog_when_idle(admin)
            stopping = True
            if books.successor is not None:
                # Not the soak's child: stopped by pid. Once it exits, the Edge's output
                # ends and its service says so (ServiceFailed, expected now).
                os.kill(books.successor, signal.SIGTERM)
                with trio.move_on_after(30):
                    await trio.sleep_forever()
            edge.process.send_signal(signal.SIGTERM)  # a graceful stop: the ledger drains
            with trio.move_on_after(30):
                await edge.process.wait()
            nursery.cancel_scope.cancel()
    except* ServiceFailed:
        if not stopping:  # the Edge died under load: that is a finding, not the end
            raise
    ledger = state / "usage.sqlite3"
    lost = _lost_rows(ledger, books.completed)
    served = _runs_by_provider(ledger)
    books.responses_held = _responses_held(ledger)
    run = f"{minutes:g} min, {concurrency} callers + {SHARED_CALLERS} on {SHARED_MODEL} ({folder})"
    return _report(books, idle, lost, served, run)


async def _catalog_when_idle(admin: httpx2.AsyncClient) -> dict[str, int]:
    """Every slot and queue counter once the load stopped (bounded wait for the cancels
    the Nodes still have to answer)."""
    counters: dict[str, int] = {}
    with trio.move_on_after(30):
        while True:
            catalog = (await admin.get("/catalog")).json()
            counters = {f"{p['id']}.in_flight": p["in_flight"] for p in catalog["providers"]}
            counters |= {f"{p['id']}.queued": p["queued"] for p in catalog["providers"]}
            counters |= {f"{m['id']}.queued": m["queued"] for m in catalog["models"]}
            if not any(counters.values()):
                return counters
            await trio.sleep(0.5)
    return counters


def _lost_rows(ledger: Path, completed: list[str]) -> int:
    with sqlite3.connect(ledger) as db:
        rows = {row[0] for row in db.execute("SELECT run_id FROM usage")}
    return len(set(completed) - rows)


def _runs_by_provider(ledger: Path) -> Counter[str]:
    """The ledger's runs by the provider that served them ("" for none)."""
    with sqlite3.connect(ledger) as db:
        query = "SELECT provider, COUNT(*) FROM usage GROUP BY provider"
        return Counter({provider: count for provider, count in db.execute(query)})


def _responses_held(ledger: Path) -> int:
    """The responses the store holds at the end."""
    with sqlite3.connect(ledger) as db:
        return int(db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])


def _answered(ends: Counter[str]) -> int:
    """The requests among `ends` that were answered: every 200, whole or streamed, the
    store filler's (`200 responses stored=...`) included."""
    return sum(count for end, count in ends.items() if end.split(" ", 1)[0] == "200")


def _report_restart(books: Books) -> bool:
    """Print how the requests that started during the restart ended; whether none
    failed. True when there was no restart."""
    if books.restart is None:
        print("\nrestart: none")
        return True
    opened, closed = books.restart
    inside = Counter(end for at, end in books.ends if opened <= at <= closed)
    answered = _answered(inside)
    failed = sum(inside.values()) - answered - inside["caller hung up"]
    summary = ", ".join(f"{count} {end}" for end, count in inside.most_common()) or "none"
    print(f"\nrestart, {opened:.1f}s-{closed:.1f}s (callers without retries): {summary}")
    print(f"  {'held' if failed == 0 else 'FAILED'}: {failed} failed of {sum(inside.values())}")
    return failed == 0


def _report(books: Books, idle: dict[str, int], lost: int, served: Counter[str], run: str) -> int:
    total = sum(books.outcomes.values())
    print(f"soak: {run}, {total} requests")
    print("\nends by class:")
    for outcome, count in books.outcomes.most_common():
        print(f"  {count:8d}  {outcome}")
    print("\nchaos:")
    for event in books.events:
        print(f"  {event}")
    print("\nruns in the ledger by provider:")
    for provider, count in sorted(served.items()):
        print(f"  {count:8d}  {provider or '(none: refused or cut before a provider)'}")
    print(f"\nledger rows lost (completed responses not in the ledger): {lost}")
    stored = books.outcomes["200 responses stored=true"]
    print(
        f"responses store: {stored} stored, {books.responses_held} held at the end (the others "
        "dropped, least recently used first, to give metering its room back)"
    )
    leaked = {name: value for name, value in idle.items() if value}
    print(f"slot counters after idle: {leaked or 'all 0'}")
    print("\nresident memory (MiB) at each fifth of the run, and the peak (sampled every 5 s)")
    for name, samples in books.rss.items():
        if not samples:
            continue
        fifths = [samples[min(len(samples) - 1, i * (len(samples) - 1) // 5)] for i in range(6)]
        series = "  ".join(f"{at:5.0f}s {rss / 1024:5.1f}" for at, rss in fifths)
        peak = max(rss for _, rss in samples) / 1024
        print(f"  {name:7s} {series}   peak {peak:5.1f}")
    held = _report_shared_runtime(books)
    restarted = _report_restart(books)
    return 0 if lost == 0 and not leaked and held and restarted else 1


def _report_shared_runtime(books: Books) -> bool:
    """Print the shared-runtime phase; whether it held (module docstring). True when it
    did not run: there is nothing to hold."""
    if books.window is None:
        print("\nshared runtime: no phase (--shared-runtime-s 0)")
        return True
    opened, closed = books.window
    print(
        f"\nshared runtime saturated by another application, {opened:.1f}s-{closed:.1f}s:"
        f" catalog looks every {HEALTH_SAMPLE_S:g}s"
    )
    not_routable = 0
    for provider in RUNTIME_PROVIDERS:
        states = books.health.get(provider, Counter())
        for state, count in states.most_common():
            print(f"  {provider:9s} {count:5d}  {state}")
            if not routable(state):
                not_routable += count
    inside = Counter(end for at, end in books.shared_ends if opened <= at <= closed)
    outside = Counter(end for at, end in books.shared_ends if not opened <= at <= closed)
    for label, ends in (("started in the window", inside), ("the rest of the run", outside)):
        summary = ", ".join(f"{count} {end}" for end, count in ends.most_common()) or "none"
        print(f"  {SHARED_MODEL} requests, {label}: {summary}")
    served = _answered(inside)
    failed = sum(inside.values()) - served - inside["caller hung up"]
    held = not_routable == 0 and failed == 0 and served > 0
    verdict = "held" if held else "FAILED"
    print(
        f"  {verdict}: {not_routable} look(s) with a runtime provider neither available nor"
        f" busy; {SHARED_MODEL} in the window: {served} served, {inside['503 no_provider']}"
        f" 503 no_provider, {failed} failed in all"
    )
    return held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--seed", type=int, default=int(os.environ.get("IOP_SOAK_SEED", "1")))
    parser.add_argument(
        "--full-disk-s",
        type=float,
        default=15.0,
        help="seconds the disk under state_dir is full, at two thirds of the run (0: none)",
    )
    parser.add_argument(
        "--shared-runtime-s",
        type=float,
        default=15.0,
        help="seconds another application keeps the runtime saturated, from half the run (0: none)",
    )
    parser.add_argument(
        "--no-restart",
        action="store_true",
        help="no zero-downtime restart of the Edge at five sixths of the run",
    )
    parser.add_argument(
        "--phase",
        action="append",
        choices=list(PHASES),
        help="run only this reliability phase after the mixed load (repeatable)",
    )
    parser.add_argument(
        "--no-phases", action="store_true", help="no reliability phases after the mixed load"
    )
    args = parser.parse_args(argv)
    options = SoakOptions(
        args.minutes,
        args.concurrency,
        args.seed,
        args.full_disk_s,
        args.shared_runtime_s,
        restart=not args.no_restart,
        phases=() if args.no_phases else tuple(args.phase or PHASES),
    )
    if options.shared_runtime_s < 0 or options.full_disk_s < 0:
        parser.error("--shared-runtime-s and --full-disk-s must be >= 0")
    run_s = options.minutes * 60
    if options.shared_runtime_s and run_s / 2 + options.shared_runtime_s + PHASE_GAP_S > (
        run_s * 2 / 3 if options.full_disk_s else run_s
    ):
        parser.error(
            f"--shared-runtime-s {options.shared_runtime_s:g} from half the run "
            f"({run_s / 2:g}s) does not end {PHASE_GAP_S:g}s before "
            + ("the full-disk window (two thirds)" if options.full_disk_s else "the run")
            + ": run longer (--minutes) or shorten it"
        )
    return trio.run(soak, options)


if __name__ == "__main__":
    sys.exit(main())
