"""The fleet-shaped stream scenario: many slow streams open at once, as a GPU fleet makes them.

The closed-loop scenarios ask how fast a gateway turns requests around when the upstream
answers at once. A gateway in front of a fleet sees something else: hundreds of streams
open at the same time, each trickling tokens at the speed of a GPU. Here `streams`
callers each hold one stream open at all times (the next starts when one ends) against
the paced upstream (`bench.upstream`, `--tokens-per-second`), which sends token `i` of a
stream `i / tokens_per_second` after its start and stamps each token with the moment it
left. Stream starts are spread evenly over one stream's length, so the gateway relays a
steady `streams x tokens_per_second` chunks per second.

The default shape, 100 streams x 10 tokens/s (1,000 chunks/s), is sized to the 2-core
development machine shared with other work: the direct path alone (the paced upstream
and these callers, both Python) costs ~0.2-0.3 ms of CPU per chunk, so 200 x 25
(5,000 chunks/s) saturates the machine before any gateway is in the path, and a gateway
meeting the performance goals (Edge ~0.3 ms per chunk, plus its Node) still fits beside the
generator at 1,000 chunks/s. `--streams` and `--tokens-per-second` change it.

Per target, after a warm-up round and a ramp (one stream length to open them all, one
more to reach a steady state), one window of `window_s` seconds is measured:

- **token delay**: each token's arrival at the caller minus its stamp (the upstream and
  the bench share the system's monotonic clock). The first token of a stream is left
  out: it includes the request's way in (time to first token), not the relay. Against
  the direct upstream this is the floor (sockets, the bench's own parsing under load);
  what a gateway adds is its percentile minus the direct one.
- **gap**: the time between two tokens of one stream as the caller sees them (the usual
  inter-token latency): a gateway that holds tokens and releases them in bursts shows
  here even if it adds little delay on average.
- **CPU per chunk** of each process of the target: its CPU time in the window over the
  chunks (`data:` events, `[DONE]` aside) the callers received in it; `chunks/s per
  core` is its inverse: how many tokens per second one core of that process could relay.
- **RSS per open stream**: the process's resident memory at its highest in the window
  minus its resident memory idle after the warm-up, over `streams`.
- **waited for a core**: the time the process was ready to run but got no core, as a
  share of the window. A target that falls behind the offered load while this is high
  was starved by other work on the machine, not (only) slow by itself.

The callers speak HTTP/1.1 themselves (`_Connection`: one keep-alive connection each, a
prebuilt request, a chunked-body reader) instead of through httpx2: at thousands of
chunks per second httpx2's per-chunk cost (~0.2 ms) made the load generator the
bottleneck of the direct baseline. Their own CPU per chunk is reported with the rest
(`caller_cpu_s`), so a run shows whether the generator had room.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Final
from urllib.parse import urlsplit

import trio

from bench.load import CHAT_PATH, Target, percentile, request_body
from bench.procfs import (
    cpu_by_process,
    cpu_delta,
    process_cpu_seconds,
    rss_by_process,
    run_delay_by_process,
)
from bench.upstream import STAMP_PATTERN

_EVENT_END: Final = b"\n\n"
_DONE: Final = b"data: [DONE]"
_HEAD_END: Final = b"\r\n\r\n"
_CRLF: Final = b"\r\n"
_RECEIVE_BYTES: Final = 64 * 1024
_MAX_HEAD_BYTES: Final = 64 * 1024
_STATUS = re.compile(rb"^HTTP/1\.[01] (\d{3})")
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[ \t]*chunked", re.IGNORECASE)
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CONNECTION_CLOSE = re.compile(rb"\r\nconnection:[ \t]*close", re.IGNORECASE)
#: Streams of the warm-up round (all at once, run to their end) before the idle RSS.
WARMUP_STREAMS: Final = 16
#: Between two resident-memory readings during the window.
_RSS_SAMPLE_INTERVAL_S: Final = 0.25
_NEVER: Final = 2**63


@dataclass(frozen=True, slots=True)
class FleetShape:
    """`streams` open at once, each `tokens` long at `tokens_per_second`; `window_s` measured."""

    streams: int = 100
    tokens_per_second: float = 10.0
    tokens: int = 30
    window_s: float = 5.0

    def __post_init__(self) -> None:
        if self.streams < 1 or self.tokens < 2:
            raise ValueError("a fleet needs >= 1 stream of >= 2 tokens")
        if self.tokens_per_second <= 0 or self.window_s <= 0:
            raise ValueError("tokens per second and the window must be > 0")

    @property
    def stream_s(self) -> float:
        """How long one stream lasts (its last token leaves then)."""
        return (self.tokens - 1) / self.tokens_per_second

    @property
    def label(self) -> str:
        return (
            f"{self.streams} streams x {self.tokens_per_second:g} tok/s, {self.tokens} tokens each"
        )


@dataclass(frozen=True, slots=True)
class FleetMeasurement:
    """One target under the fleet-shaped load, over the measured window."""

    target: str
    shape: FleetShape
    window_s: float
    chunks: int
    """`data:` events the callers received in the window (`[DONE]` aside)."""
    streams_done: int
    """Streams that ended complete in the window."""
    errors: int
    """Streams that failed, from the ramp to the window's end."""
    delays_s: tuple[float, ...]
    """Token delays (arrival minus stamp) in the window, sorted."""
    gaps_s: tuple[float, ...]
    """Gaps between consecutive tokens of a stream in the window, sorted."""
    process_cpu_s: Mapping[str, float] | None = None
    rss_idle: Mapping[str, int] | None = None
    rss_loaded: Mapping[str, int] | None = None
    process_wait_s: Mapping[str, float] | None = None
    """Time each process was runnable but waited for a core, in the window."""
    caller_cpu_s: float | None = None
    """CPU time of the load generator (this process) in the window."""
    first_error: str | None = None

    @property
    def chunks_per_s(self) -> float | None:
        return self.chunks / self.window_s if self.window_s > 0 else None

    def delay_ms(self, q: float) -> float | None:
        return percentile(self.delays_s, q) * 1000 if self.delays_s else None

    def gap_ms(self, q: float) -> float | None:
        return percentile(self.gaps_s, q) * 1000 if self.gaps_s else None

    def cpu_us_per_chunk(self, process: str | None = None) -> float | None:
        """CPU µs per relayed chunk of one process (None: all the target's processes)."""
        if self.process_cpu_s is None or not self.chunks:
            return None
        if process is None:
            spent = sum(self.process_cpu_s.values())
        elif process in self.process_cpu_s:
            spent = self.process_cpu_s[process]
        else:
            return None
        return spent / self.chunks * 1e6

    def waited_share(self, process: str) -> float | None:
        """The share of the window `process` was runnable without a core."""
        if self.process_wait_s is None or process not in self.process_wait_s:
            return None
        return self.process_wait_s[process] / self.window_s if self.window_s > 0 else None

    @property
    def caller_us_per_chunk(self) -> float | None:
        if self.caller_cpu_s is None or not self.chunks:
            return None
        return self.caller_cpu_s / self.chunks * 1e6

    def chunks_per_core_s(self, process: str | None = None) -> float | None:
        """Chunks per second one core of `process` could relay at this cost."""
        cost = self.cpu_us_per_chunk(process)
        return 1e6 / cost if cost else None

    def rss_kb_per_stream(self, process: str) -> float | None:
        if self.rss_idle is None or self.rss_loaded is None:
            return None
        if process not in self.rss_idle or process not in self.rss_loaded:
            return None
        return (self.rss_loaded[process] - self.rss_idle[process]) / 1024 / self.shape.streams


class _BadStream(Exception):
    """The target answered, but not with a complete stream."""


class _NothingReceived(_BadStream):
    """The connection failed before a byte of the answer arrived."""


@dataclass
class _Tally:
    """What the callers saw; only what arrives inside the window counts."""

    expected_tokens: int
    window_start_ns: int = _NEVER
    window_end_ns: int = _NEVER
    chunks: int = 0
    streams_done: int = 0
    errors: int = 0
    first_error: str | None = None
    delays_ns: list[int] = field(default_factory=list)
    gaps_ns: list[int] = field(default_factory=list)

    def in_window(self, now_ns: int) -> bool:
        return self.window_start_ns <= now_ns < self.window_end_ns

    def failed(self, exc: Exception) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = f"{type(exc).__name__}: {exc}"[:300]


class _Connection:
    """One caller's keep-alive HTTP/1.1 connection to the target, for streams only.

    It sends a prebuilt request and reads the answer's head and its body (chunked, or
    `Content-Length` long, or until close), handing each piece of body to `on_body` with
    the moment the socket read returned. Anything unexpected raises `_BadStream` and
    drops the connection; the next stream opens a new one."""

    def __init__(self, host: str, port: int, request: bytes) -> None:
        self._host = host
        self._port = port
        self._request = request
        self._stream: trio.SocketStream | None = None
        self._buffer = bytearray()

    async def aclose(self) -> None:
        stream, self._stream = self._stream, None
        self._buffer.clear()
        if stream is not None:
            await stream.aclose()

    async def exchange(self, on_body: Callable[[bytes, int], None]) -> None:
        """Send the request and hand the answer's body to `on_body` as it arrives.

        A kept-alive connection the target closed while it sat idle fails before a byte
        of the answer arrives; then the request goes once more on a new connection."""
        if self._stream is not None:
            try:
                await self._exchange_or_drop(on_body)
                return
            except _NothingReceived:
                pass  # dropped: once more, on a new connection
        await self._exchange_or_drop(on_body)

    async def _exchange_or_drop(self, on_body: Callable[[bytes, int], None]) -> None:
        try:
            await self._exchange(on_body)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            await self.aclose()
            raise _BadStream(f"connection failed: {exc!r}") from None
        except _BadStream:
            await self.aclose()  # the answer may be half read: start afresh
            raise
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.aclose()  # a stream cut short leaves the connection unusable
            raise

    async def _receive(self) -> int:
        assert self._stream is not None
        data = await self._stream.receive_some(_RECEIVE_BYTES)
        if not data:
            raise _BadStream("the target closed the connection mid-answer")
        self._buffer += data
        return time.monotonic_ns()

    async def _exchange(self, on_body: Callable[[bytes, int], None]) -> None:
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self._host, self._port)
        buffer = self._buffer
        try:
            await self._stream.send_all(self._request)
            now_ns = await self._receive()
        except (_BadStream, trio.BrokenResourceError, OSError) as exc:
            raise _NothingReceived(str(exc)) from None
        while (end := buffer.find(_HEAD_END)) < 0:
            if len(buffer) > _MAX_HEAD_BYTES:
                raise _BadStream("answer head too large")
            now_ns = await self._receive()
        head = bytes(buffer[: end + 2])
        del buffer[: end + 4]
        status = _STATUS.match(head)
        if status is None:
            raise _BadStream(f"not an HTTP/1.1 answer: {head[:80]!r}")
        body_parts: list[bytes] = []
        sink = on_body if status.group(1) == b"200" else (lambda data, _: body_parts.append(data))
        if _CHUNKED.search(head):
            await self._chunked_body(sink, now_ns)
        elif length := _CONTENT_LENGTH.search(head):
            await self._sized_body(sink, now_ns, int(length.group(1)))
        else:
            await self._body_until_close(sink, now_ns)
            return
        if _CONNECTION_CLOSE.search(head):
            await self.aclose()
        if status.group(1) != b"200":
            raise _BadStream(f"HTTP {status.group(1).decode()}: {b''.join(body_parts)[:200]!r}")

    async def _chunked_body(self, sink: Callable[[bytes, int], None], now_ns: int) -> None:
        buffer = self._buffer
        while True:
            while (line_end := buffer.find(_CRLF)) < 0:
                now_ns = await self._receive()
            size = int(bytes(buffer[:line_end]).partition(b";")[0], 16)
            del buffer[: line_end + 2]
            if size == 0:
                while (trailer_end := buffer.find(_CRLF)) < 0:
                    await self._receive()
                del buffer[: trailer_end + 2]  # no trailers expected: the empty line
                return
            while len(buffer) < size + 2:
                taken = min(size, len(buffer))
                if taken:  # hand on what arrived; the rest of the chunk comes later
                    sink(bytes(buffer[:taken]), now_ns)
                    del buffer[:taken]
                    size -= taken
                now_ns = await self._receive()
            if size:
                sink(bytes(buffer[:size]), now_ns)
            del buffer[: size + 2]

    async def _sized_body(
        self, sink: Callable[[bytes, int], None], now_ns: int, length: int
    ) -> None:
        buffer = self._buffer
        while length:
            if not buffer:
                now_ns = await self._receive()
            taken = min(length, len(buffer))
            sink(bytes(buffer[:taken]), now_ns)
            del buffer[:taken]
            length -= taken

    async def _body_until_close(self, sink: Callable[[bytes, int], None], now_ns: int) -> None:
        assert self._stream is not None
        while True:
            if self._buffer:
                sink(bytes(self._buffer), now_ns)
                self._buffer.clear()
            data = await self._stream.receive_some(_RECEIVE_BYTES)
            if not data:
                await self.aclose()
                return
            self._buffer += data
            now_ns = time.monotonic_ns()


class _StreamReader:
    """Turns one stream's body into events: chunks, token delays and gaps (Tally rules)."""

    def __init__(self, tally: _Tally | None) -> None:
        self._tally = tally
        self._pending = b""
        self.tokens = 0
        self._previous_ns = 0
        self.done = False

    def __call__(self, data: bytes, now_ns: int) -> None:
        tally = self._tally
        counted = tally is not None and tally.in_window(now_ns)
        *events, self._pending = (self._pending + data).split(_EVENT_END)
        for event in events:
            if event.endswith(_DONE):
                self.done = True
                continue
            if counted:
                assert tally is not None
                tally.chunks += 1
            stamp = STAMP_PATTERN.search(event)
            if stamp is None:
                continue  # the finish-reason chunk
            if self.tokens and counted:
                assert tally is not None
                tally.delays_ns.append(now_ns - int(stamp.group(1)))
                tally.gaps_ns.append(now_ns - self._previous_ns)
            self.tokens += 1
            self._previous_ns = now_ns


async def _one_stream(connection: _Connection, tally: _Tally | None, expected: int) -> None:
    """One stream to its end; its chunks, delays and gaps go to `tally` (None: warm-up)."""
    reader = _StreamReader(tally)
    await connection.exchange(reader)
    if not reader.done or reader.tokens != expected:
        seen = "seen" if reader.done else "missing"
        raise _BadStream(f"{reader.tokens} tokens of {expected}, [DONE] {seen}")
    if tally is not None and tally.in_window(time.monotonic_ns()):
        tally.streams_done += 1


async def _caller(
    connection: _Connection,
    tally: _Tally,
    *,
    start_after_s: float,
    retry_after_s: float,
) -> None:
    """One caller: streams back to back, from `start_after_s` on, until cancelled."""
    await trio.sleep(start_after_s)
    try:
        while True:
            try:
                await _one_stream(connection, tally, tally.expected_tokens)
            except _BadStream as exc:
                tally.failed(exc)
                # A failing target must not turn the caller into a busy loop.
                await trio.sleep(retry_after_s)
    finally:
        with trio.CancelScope(shield=True):
            await connection.aclose()


async def _warm_up(connections: list[_Connection], expected: int) -> None:
    """A round of streams run to their end: connections, caches and buffers set up."""

    async def warm(connection: _Connection) -> None:
        try:
            await _one_stream(connection, None, expected)
        except _BadStream:
            pass  # the measured run counts failures; the warm-up only prepares

    async with trio.open_nursery() as nursery:
        for connection in connections:
            nursery.start_soon(warm, connection)


def _request(root_url: str) -> tuple[str, int, bytes]:
    """(host, port, the request's bytes) of the stream request to `root_url`."""
    parts = urlsplit(root_url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"the fleet callers speak plain http only, not {root_url!r}")
    port = parts.port or 80
    body = request_body(stream=True)
    head = (
        f"POST {CHAT_PATH} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        "content-type: application/json\r\nauthorization: Bearer unused\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return parts.hostname, port, head.encode() + body


async def _highest_rss(processes: Mapping[str, int], until_ns: int) -> dict[str, int] | None:
    """Each process's highest resident memory from now until `until_ns`."""
    highest: dict[str, int] | None = None
    while time.monotonic_ns() < until_ns:
        sample = await rss_by_process(processes)
        if sample is not None:
            highest = sample if highest is None else {
                name: max(value, highest.get(name, 0)) for name, value in sample.items()
            }  # fmt: skip
        await trio.sleep(_RSS_SAMPLE_INTERVAL_S)
    return highest


async def measure_fleet(target: Target, shape: FleetShape) -> FleetMeasurement:
    """Warm up, ramp `shape.streams` callers up, measure one window, stop them."""
    host, port, request = _request(target.root_url)
    connections = [_Connection(host, port, request) for _ in range(shape.streams)]
    await _warm_up(connections[: min(shape.streams, WARMUP_STREAMS)], shape.tokens)
    rss_idle = await rss_by_process(target.processes)
    tally = _Tally(expected_tokens=shape.tokens)
    async with trio.open_nursery() as callers:
        for index, connection in enumerate(connections):
            caller = partial(
                _caller,
                connection,
                tally,
                start_after_s=index * shape.stream_s / shape.streams,
                retry_after_s=1 / shape.tokens_per_second,
            )
            callers.start_soon(caller)
        # The load is paced by the upstream: the schedule is the measurement's own.
        await trio.sleep(2 * shape.stream_s)
        cpu_before = await cpu_by_process(target.processes)
        wait_before = await run_delay_by_process(target.processes)
        caller_before = await process_cpu_seconds(os.getpid())
        tally.window_start_ns = time.monotonic_ns()
        until_ns = tally.window_start_ns + math.ceil(shape.window_s * 1e9)
        rss_loaded = await _highest_rss(target.processes, until_ns)
        tally.window_end_ns = time.monotonic_ns()
        caller_after = await process_cpu_seconds(os.getpid())
        wait_after = await run_delay_by_process(target.processes)
        cpu_after = await cpu_by_process(target.processes)
        callers.cancel_scope.cancel()
    caller_cpu_s = None
    if caller_before is not None and caller_after is not None:
        caller_cpu_s = caller_after - caller_before
    return FleetMeasurement(
        target=target.name,
        shape=shape,
        window_s=(tally.window_end_ns - tally.window_start_ns) / 1e9,
        chunks=tally.chunks,
        streams_done=tally.streams_done,
        errors=tally.errors,
        delays_s=tuple(sorted(ns / 1e9 for ns in tally.delays_ns)),
        gaps_s=tuple(sorted(ns / 1e9 for ns in tally.gaps_ns)),
        process_cpu_s=cpu_delta(cpu_before, cpu_after),
        process_wait_s=cpu_delta(wait_before, wait_after),
        rss_idle=rss_idle,
        rss_loaded=rss_loaded,
        caller_cpu_s=caller_cpu_s,
        first_error=tally.first_error,
    )
