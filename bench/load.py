"""The closed-loop load generator.

`concurrency` workers each send a request, wait for its last byte, and send the next, so
the offered load adapts to the server: at concurrency 1 it measures pure latency, at 32
it finds throughput under a fixed number of callers (what an OpenAI client pool does).
A phase ends after a fixed number of requests, or once its duration has passed (requests
in flight then complete and count).

Each target gets one long-lived `httpx2.AsyncClient`, as a real caller would hold, with
room for one keep-alive connection per worker. Every request is timed from before the
client builds it until the last byte of the body: for a stream, every SSE event is read,
so the number is the time to the end of the generation (`data: [DONE]`). A warm-up phase
(connections opened, caches filled) runs before each measured one and is discarded.

A scenario speaks one caller protocol (`Scenario.protocol`): chat completions, Anthropic
Messages (`POST /v1/messages`) or OpenAI Responses (`POST /v1/responses`, `store: false`
as Codex sends it), each asking for the same short answer; a target is measured under
the protocols it serves (`Target.models`).

Failures (a non-200 status, a transport error, a stream that lost an event or ended
without its last one: `[DONE]`, `message_stop`, `response.completed`) are counted apart
and never enter the latency numbers; the first one is kept to show why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import httpx2
import msgspec
import trio

from bench.procfs import cpu_by_process, cpu_delta
from bench.upstream import (
    MESSAGES_STREAM_EVENTS,
    MODEL,
    RESPONSES_STREAM_EVENTS,
    STREAM_CHUNKS,
    STREAM_TOKENS,
)

Protocol = Literal["chat", "messages", "responses"]
PROTOCOLS: Final[tuple[Protocol, ...]] = ("chat", "messages", "responses")
CHAT_PATH: Final = "/v1/chat/completions"
PATHS: Final[dict[Protocol, str]] = {
    "chat": CHAT_PATH,
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}
_DONE: Final = b"data: [DONE]\n\n"
#: A complete stream: every chunk of the upstream's, then `[DONE]`.
STREAM_EVENTS: Final = STREAM_CHUNKS + 1
#: The events of a stream a caller receives, by protocol (chat's `[DONE]` aside): what
#: the per-chunk cost divides by.
CALLER_EVENTS: Final[dict[Protocol, int]] = {
    "chat": STREAM_CHUNKS,
    "messages": MESSAGES_STREAM_EVENTS,
    "responses": RESPONSES_STREAM_EVENTS,
}
_REQUEST_TIMEOUT_S: Final = 60.0
#: Below uvicorn's 5 s idle timeout (LiteLLM), so no request lands on a closing connection.
_KEEPALIVE_EXPIRY_S: Final = 4.0
_HEADERS: Final = {"content-type": "application/json", "authorization": "Bearer unused"}
_PROTOCOL_HEADERS: Final[dict[Protocol, dict[str, str]]] = {
    "chat": _HEADERS,
    "messages": {**_HEADERS, "anthropic-version": "2023-06-01"},
    "responses": _HEADERS,
}
_PROMPT: Final = b'"Say hello in twenty-one tokens."'


def request_body(*, stream: bool, protocol: Protocol = "chat", model: str = MODEL) -> bytes:
    """The request every target gets, in `protocol`: a short turn asking for the same
    answer (`model` is the logical id)."""
    flag = b"true" if stream else b"false"
    name = b'{"model":"' + model.encode() + b'",'
    if protocol == "responses":
        return (
            name
            + b'"input":'
            + _PROMPT
            + b',"max_output_tokens":64,"store":false,"stream":'
            + flag
            + b"}"
        )
    return (
        name + b'"messages":[{"role":"user","content":' + _PROMPT + b'}],"max_tokens":64,'
        b'"stream":' + flag + b"}"
    )


@dataclass(frozen=True, slots=True)
class Target:
    """A server to measure: `name` labels it in the report, `root_url` is scheme://host:port.

    `processes` names the processes that make up the target and their pids (IOP: `edge`
    and `node`; a peer: its one process); the CPU time each spends during a measured
    phase is reported per request and per chunk, each process apart. `models` names the
    protocols it is measured under and the model its requests name in each."""

    name: str
    root_url: str
    processes: Mapping[str, int] = field(default_factory=dict)
    models: Mapping[Protocol, str] = field(default_factory=lambda: {"chat": MODEL})

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(self.processes.values())


@dataclass(frozen=True, slots=True)
class Scenario:
    concurrency: int
    stream: bool
    protocol: Protocol = "chat"

    @property
    def label(self) -> str:
        label = f"c={self.concurrency} {'stream' if self.stream else 'non-stream'}"
        return label if self.protocol == "chat" else f"{label} {self.protocol}"

    def like(self, protocol: Protocol) -> Scenario:
        """The same load in another protocol."""
        return Scenario(self.concurrency, self.stream, protocol)


@dataclass(frozen=True, slots=True)
class Budget:
    """How long one measured phase lasts: `requests` when set, else `duration_s`, in
    `turns` turns interleaved with the other targets' (`per_turn`): a machine whose speed
    drifts then weighs on every target alike, not on whichever was measured in a slow
    minute. Each turn warms up first."""

    requests: int | None = None
    duration_s: float = 4.0
    warmup_requests: int = 50
    turns: int = 1

    def __post_init__(self) -> None:
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be >= 1")
        if self.duration_s <= 0:
            raise ValueError("duration must be > 0")
        if self.warmup_requests < 0:
            raise ValueError("warm-up requests must be >= 0")
        if self.turns < 1:
            raise ValueError("turns must be >= 1")
        if self.requests is not None and self.requests < self.turns:
            raise ValueError("requests must be at least one per turn")

    def per_turn(self) -> Budget:
        """The budget of one turn: an equal share of the requests or of the time."""
        return Budget(
            requests=None if self.requests is None else -(-self.requests // self.turns),
            duration_s=self.duration_s / self.turns,
            warmup_requests=self.warmup_requests,
        )


@dataclass(frozen=True, slots=True)
class Measurement:
    """One target under one scenario: latencies (seconds, sorted) and failures."""

    target: str
    scenario: Scenario
    latencies_s: tuple[float, ...]
    errors: int
    wall_s: float
    first_error: str | None = None
    process_cpu_s: Mapping[str, float] | None = None
    """CPU time (user + system) of each of the target's processes during the phase."""
    turn_cpu_ms: tuple[float, ...] = ()
    """CPU ms per request of all the target's processes in each turn, in turn order, when
    the measurement combines turns (`combined`) and every turn's CPU is known."""

    @property
    def ok(self) -> int:
        return len(self.latencies_s)

    @property
    def server_cpu_s(self) -> float | None:
        """CPU time of all the target's processes together during the phase, when known."""
        return None if self.process_cpu_s is None else sum(self.process_cpu_s.values())

    @property
    def cpu_ms_per_request(self) -> float | None:
        """The target's own CPU cost of one request: what bounds its throughput per core."""
        return self.process_cpu_ms_per_request(None)

    def process_cpu_ms_per_request(self, process: str | None) -> float | None:
        """CPU ms per request of one of the target's processes (None: all of them)."""
        requests = self.ok + self.errors
        if self.process_cpu_s is None or not requests:
            return None
        if process is None:
            spent = sum(self.process_cpu_s.values())
        elif process in self.process_cpu_s:
            spent = self.process_cpu_s[process]
        else:
            return None
        return spent / requests * 1000

    def process_cpu_us_per_chunk(self, process: str | None) -> float | None:
        """CPU µs per stream event the caller receives (`CALLER_EVENTS` per request);
        streams only."""
        per_request = self.process_cpu_ms_per_request(process)
        if not self.scenario.stream or per_request is None:
            return None
        return per_request * 1000 / CALLER_EVENTS[self.scenario.protocol]

    @property
    def p50_ms(self) -> float | None:
        return percentile(self.latencies_s, 50.0) * 1000 if self.latencies_s else None

    @property
    def p99_ms(self) -> float | None:
        return percentile(self.latencies_s, 99.0) * 1000 if self.latencies_s else None

    @property
    def rps(self) -> float | None:
        return self.ok / self.wall_s if self.ok and self.wall_s > 0 else None


def combined(turns: Sequence[Measurement]) -> Measurement:
    """One target's turns under one scenario as one measurement: every latency, failure,
    second and CPU second of them, and each turn's CPU per request apart."""
    first = turns[0]
    cpu: dict[str, float] | None = {}
    for turn in turns:
        if turn.process_cpu_s is None or cpu is None:
            cpu = None
            continue
        for process, seconds in turn.process_cpu_s.items():
            cpu[process] = cpu.get(process, 0.0) + seconds
    return Measurement(
        target=first.target,
        scenario=first.scenario,
        latencies_s=tuple(sorted(latency for turn in turns for latency in turn.latencies_s)),
        errors=sum(turn.errors for turn in turns),
        wall_s=sum(turn.wall_s for turn in turns),
        first_error=next((t.first_error for t in turns if t.first_error is not None), None),
        process_cpu_s=cpu,
        turn_cpu_ms=_turn_cpu_ms(turns),
    )


def _turn_cpu_ms(turns: Sequence[Measurement]) -> tuple[float, ...]:
    """Each turn's CPU ms per request, or () when any turn's is unknown."""
    costs: list[float] = []
    for turn in turns:
        cost = turn.cpu_ms_per_request
        if cost is None:
            return ()
        costs.append(cost)
    return tuple(costs)


def percentile(sorted_values: tuple[float, ...], q: float) -> float:
    """The q-th percentile by linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        raise ValueError("no values")
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = rank - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


class _BadResponse(Exception):
    """The target answered, but not with a complete success."""


def open_client(max_concurrency: int) -> httpx2.AsyncClient:
    """The long-lived client for one target, with a keep-alive connection per worker."""
    return httpx2.AsyncClient(
        timeout=_REQUEST_TIMEOUT_S,
        limits=httpx2.Limits(
            max_connections=max_concurrency,
            max_keepalive_connections=max_concurrency,
            keepalive_expiry=_KEEPALIVE_EXPIRY_S,
        ),
        follow_redirects=False,
    )


class _Whole(msgspec.Struct):
    """What a non-stream answer of a caller protocol must say: a message with content
    (Messages), a completed response with output (Responses)."""

    type: str | None = None
    content: list[msgspec.Raw] = []
    object: str | None = None
    status: str | None = None
    output: list[msgspec.Raw] = []


_decode_whole: Final = msgspec.json.Decoder(_Whole).decode


def _check_whole(protocol: Protocol, body: bytes) -> None:
    if protocol == "chat":
        if b'"choices"' not in body:
            raise _BadResponse(f"not a chat completion: {body[:200]!r}")
        return
    try:
        whole = _decode_whole(body)
    except msgspec.DecodeError:
        raise _BadResponse(f"not a {protocol} answer: {body[:200]!r}") from None
    if protocol == "messages" and not (whole.type == "message" and whole.content):
        raise _BadResponse(f"not a message with content: {body[:200]!r}")
    if protocol == "responses" and not (
        whole.object == "response" and whole.status == "completed" and whole.output
    ):
        raise _BadResponse(f"not a completed response: {body[:200]!r}")


async def _complete(
    client: httpx2.AsyncClient, url: str, body: bytes, protocol: Protocol = "chat"
) -> None:
    response = await client.post(url, content=body, headers=_PROTOCOL_HEADERS[protocol])
    if response.status_code != 200:
        raise _BadResponse(f"HTTP {response.status_code}: {response.text[:200]}")
    _check_whole(protocol, response.content)


class _Markers:
    """Counts where `markers` occur in a body read in pieces (one may straddle two)."""

    def __init__(self, *markers: bytes) -> None:
        self.counts = dict.fromkeys(markers, 0)
        self._tail = b""
        self._keep = max(len(marker) for marker in markers) - 1

    def feed(self, chunk: bytes) -> None:
        for marker in self.counts:
            start = max(len(self._tail) - len(marker) + 1, 0)
            self.counts[marker] += (self._tail[start:] + chunk).count(marker)
        self._tail = (self._tail + chunk)[-self._keep :]


#: A caller protocol's stream is whole when it carried one text delta per token (the
#: marker each delta has once, whatever a gateway's JSON spacing) and its last event.
_DELTA: Final[dict[Protocol, bytes]] = {"messages": b"text_delta", "responses": b'"delta"'}
_LAST: Final[dict[Protocol, bytes]] = {
    "messages": b"message_stop",
    "responses": b"response.completed",
}


async def _stream(
    client: httpx2.AsyncClient, url: str, body: bytes, protocol: Protocol = "chat"
) -> None:
    headers = _PROTOCOL_HEADERS[protocol]
    async with client.stream("POST", url, content=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            raise _BadResponse(f"HTTP {response.status_code}: {response.text[:200]}")
        if protocol != "chat":
            markers = _Markers(_DELTA[protocol], _LAST[protocol])
            async for chunk in response.aiter_raw():
                markers.feed(chunk)
            deltas, last = markers.counts.values()
            if not last:
                raise _BadResponse(f"stream ended without {_LAST[protocol].decode()}")
            if deltas != STREAM_TOKENS:
                raise _BadResponse(f"{deltas} text deltas instead of {STREAM_TOKENS}")
            return
        events = 0
        tail = b""
        async for chunk in response.aiter_raw():
            # An event ends at a blank line; one may straddle two reads, hence the tail.
            events += (tail[-1:] + chunk).count(b"\n\n")
            tail = (tail + chunk)[-len(_DONE) :]
        if tail != _DONE:
            raise _BadResponse(f"stream ended without [DONE] (last bytes {tail!r})")
        if events != STREAM_EVENTS:
            raise _BadResponse(f"{events} events instead of {STREAM_EVENTS}")


@dataclass
class _Tally:
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None


async def _closed_loop(
    send: Callable[[], Awaitable[None]],
    concurrency: int,
    *,
    requests: int | None,
    duration_s: float,
) -> tuple[_Tally, float]:
    """Run `concurrency` workers until `requests` are done or `duration_s` has passed."""
    tally = _Tally()
    remaining = requests
    started = time.perf_counter()
    deadline = started + duration_s

    def another() -> bool:
        nonlocal remaining
        if remaining is None:
            return time.perf_counter() < deadline
        if remaining <= 0:
            return False
        remaining -= 1
        return True

    async def worker() -> None:
        while another():
            began = time.perf_counter()
            try:
                await send()
            except (httpx2.HTTPError, _BadResponse) as exc:
                tally.errors += 1
                if tally.first_error is None:
                    tally.first_error = f"{type(exc).__name__}: {exc}"[:300]
                continue
            tally.latencies_s.append(time.perf_counter() - began)

    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(worker, name=f"bench worker {i}")
    return tally, time.perf_counter() - started


async def measure(
    client: httpx2.AsyncClient, target: Target, scenario: Scenario, budget: Budget
) -> Measurement:
    """Warm up, then measure `target` under `scenario`."""
    protocol = scenario.protocol
    url = target.root_url.rstrip("/") + PATHS[protocol]
    body = request_body(stream=scenario.stream, protocol=protocol, model=target.models[protocol])
    request = _stream if scenario.stream else _complete

    async def send() -> None:
        await request(client, url, body, protocol)

    warmup = max(budget.warmup_requests, scenario.concurrency) if budget.warmup_requests else 0
    if warmup:
        await _closed_loop(send, scenario.concurrency, requests=warmup, duration_s=math.inf)
    cpu_before = await cpu_by_process(target.processes)
    tally, wall_s = await _closed_loop(
        send, scenario.concurrency, requests=budget.requests, duration_s=budget.duration_s
    )
    cpu_after = await cpu_by_process(target.processes)
    return Measurement(
        target=target.name,
        scenario=scenario,
        latencies_s=tuple(sorted(tally.latencies_s)),
        errors=tally.errors,
        wall_s=wall_s,
        first_error=tally.first_error,
        process_cpu_s=cpu_delta(cpu_before, cpu_after),
    )
