"""The benchmark's upstream: a fake OpenAI-compatible server that costs almost nothing.

It is the baseline every other number is compared with, so it must add as little as
possible of its own: a raw HTTP/1.1 server on Trio sockets (keep-alive, no HTTP library,
no routing framework) whose answers are built once, at start, as ready-to-send bytes.
Per request it only finds the end of the head, reads `Content-Length` bytes of body and
looks for `"stream": true`; it never decodes the JSON.

- `POST /v1/chat/completions`, non-stream: one fixed `chat.completion` (with `usage`).
- `POST /v1/chat/completions`, `"stream": true`: one `data:` event per token (21 by
  default, `--stream-tokens`), one with the finish reason (`STREAM_CHUNKS` = 22 events
  by default), then `data: [DONE]`, each in its own chunked-encoding write. When the
  request asks for `stream_options.include_usage` (the IOP Edge always does, to meter
  usage), one usage chunk comes before `[DONE]`, as vLLM sends it; the caller-visible
  stream is the same.
- `POST /v1/messages` and `POST /v1/responses` (`?beta=true` too), stream or not: the
  same answer in Anthropic's and OpenAI's caller protocols, as a runtime that speaks
  them natively sends it (`bench.upstream_protocols`). Never paced.
- `GET /v1/models`, `GET /health`: what gateways probe.

**Paced mode** (`--tokens-per-second T`, the fleet-shaped scenario's upstream): token `i`
of a stream leaves at `i / T` seconds after the request, the way a busy GPU emits them,
and its content carries the moment it left, `tok@<time.monotonic_ns()> `
(`STAMP_PATTERN`). The clock is the system-wide monotonic one, so a client on the same
machine computes each token's delay through a gateway as its own arrival time minus the
stamp. Without pacing there is no artificial delay. (Trio's socket streams set
TCP_NODELAY, so every write leaves at once.)

**Prefix-cache mode** (`--prefill-us-per-token U`, the agent-cache scenario's upstream):
before it answers an inference request the upstream waits for the prompt's prefill as
`bench.prefix_cache` models it (each token it computes costs U µs, each token it reuses
from a recent prompt `--cached-prefill-us-per-token`), and a non-stream answer reports
the prompt's tokens and cached tokens in its usage. This mode decodes each request's
JSON, as a runtime does; it is not a baseline for overhead.

**Saturation** (`--slots N`, the soak's shared-runtime phase): the runtime generates N
sequences at full pace. With more inference requests in flight than that (whoever sent
them), it is saturated, as a runtime that another application keeps busy is: its
throughput is shared, so every paced stream's tokens come `in_flight / N` times further
apart, and `GET /v1/models` is answered only once no more than N requests are in flight
(llama.cpp's Python server answers its model list under the lock its generation holds).
Completions are still served, only slower; a health probe of the model list meanwhile
times out on a connection the runtime accepted. Without `--slots` nothing saturates.
The other application's generations are long: a chat stream request with the header
`x-bench-stream-tokens: N` gets N content tokens instead of `--stream-tokens` (the
shared-runtime client, `bench.shared_runtime`, sends it; nothing else does).

    python -m bench.upstream [--port 0] [--stream-tokens 21] [--tokens-per-second T]
                             [--prefill-us-per-token U [--cached-prefill-us-per-token C]]
                             [--slots N]

prints `bench-upstream listening on http://127.0.0.1:PORT` once accepting, then serves
until stopped (SIGINT/SIGTERM). In-process: `url = await nursery.start(upstream.serve)`.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import trio

from bench.services import Service, python_argv, start_service, url_after
from bench.upstream_protocols import (
    messages_body,
    messages_events,
    responses_body,
    responses_events,
    with_usage,
)
from iop_node.adapters.sim.prefix_cache import (
    DEFAULT_SLOTS,
    PrefillCost,
    PrefixCache,
    render_prompt,
)

#: The logical model id callers name; the gateways under test map it to SERVED_MODEL.
MODEL: Final = "bench-model"
#: The logical id of the same model where a gateway is set up to treat the upstream as
#: speaking chat completions only, so it translates Messages and Responses requests.
MODEL_TRANSLATED: Final = "bench-model-translated"
#: The model name the upstream serves (what a gateway puts in `model` upstream).
SERVED_MODEL: Final = "bench-served"
#: Content tokens of one stream by default (one `data:` event each).
STREAM_TOKENS: Final = 21
#: `data:` events of a default stream: the tokens (the first also carries the role) and
#: the one with the finish reason.
STREAM_CHUNKS: Final = STREAM_TOKENS + 1
PROMPT_TOKENS: Final = 12
READY_PREFIX: Final = "bench-upstream listening on "
CHAT_PATH: Final = b"/v1/chat/completions"
MESSAGES_PATH: Final = b"/v1/messages"
RESPONSES_PATH: Final = b"/v1/responses"
#: The cost of a reused prompt token when only the uncached one's is given: reading a
#: cached prefix is one to two orders cheaper than computing it.
CACHED_COST_SHARE: Final = 0.02
#: Finds the send time (`time.monotonic_ns()`) in a paced token's content.
STAMP_PATTERN: Final = re.compile(rb"tok@(\d+) ")
_STAMP_SLOT: Final = "STAMP-SLOT"

_MAX_HEAD_BYTES: Final = 64 * 1024
_MAX_BODY_BYTES: Final = 16 * 1024 * 1024
_RECEIVE_BYTES: Final = 64 * 1024
_CLOSE_GRACE_S: Final = 1.0
_HEAD_END: Final = b"\r\n\r\n"
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CONNECTION_CLOSE = re.compile(rb"\r\nconnection:[ \t]*close", re.IGNORECASE)
_CHUNKED_BODY = re.compile(rb"\r\ntransfer-encoding:[ \t]*chunked", re.IGNORECASE)
_STREAM_TOKENS_HEADER = re.compile(rb"\r\nx-bench-stream-tokens:[ \t]*(\S*)", re.IGNORECASE)
#: The longest stream `x-bench-stream-tokens` may ask for.
MAX_STREAM_TOKENS: Final = 100_000
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')
_INCLUDE_USAGE = re.compile(rb'"include_usage"\s*:\s*true')


# --- the bytes (built once) -------------------------------------------------------------------


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _tokens(count: int = STREAM_TOKENS) -> list[str]:
    """The completion's text, one token per content chunk."""
    return [f"tok{i} " for i in range(count)]


def _usage(completion: int = STREAM_TOKENS) -> dict[str, int]:
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": completion,
        "total_tokens": PROMPT_TOKENS + completion,
    }


def asks_for_stream(body: bytes) -> bool:
    """Whether a request body says `"stream": true` (found without decoding the JSON)."""
    return _STREAM_TRUE.search(body) is not None


def completion_body() -> bytes:
    """The non-stream answer."""
    return _json(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": SERVED_MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(_tokens())},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": _usage(),
        }
    )


def _chunk(delta: dict[str, Any], finish: str | None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": SERVED_MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        **extra,
    }


def stream_events(
    *, include_usage: bool, tokens: int = STREAM_TOKENS, stamped: bool = False
) -> list[bytes]:
    """The `data:` payloads of one stream, in order, without `[DONE]`.

    `stamped`: each token's content is `tok@STAMP-SLOT `, where the paced upstream puts the
    send time."""
    texts = [f"tok@{_STAMP_SLOT} "] * tokens if stamped else _tokens(tokens)
    chunks = [_chunk({"role": "assistant", "content": texts[0]}, None)] if texts else []
    chunks += [_chunk({"content": text}, None) for text in texts[1:]]
    chunks.append(_chunk({}, "stop"))
    if include_usage:
        chunks.append({**_chunk({}, None), "choices": [], "usage": _usage(tokens)})
    return [_json(chunk) for chunk in chunks]


def _http_chunk(payload: bytes) -> bytes:
    """One chunk of a chunked-encoding body."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


_LAST_CHUNK: Final = b"0\r\n\r\n"


@dataclass(frozen=True, slots=True)
class _StreamBody:
    """The socket writes of one stream's body, built once: one per event, then [DONE].

    A paced token's write is a template split around its stamp (`stamped`), framed when
    it is sent; every other write is ready bytes. `tokens` writes come first."""

    writes: tuple[bytes | tuple[bytes, bytes], ...]
    tokens: int

    @classmethod
    def build(cls, *, include_usage: bool, tokens: int, stamped: bool) -> _StreamBody:
        writes: list[bytes | tuple[bytes, bytes]] = []
        events = stream_events(include_usage=include_usage, tokens=tokens, stamped=stamped)
        for index, event in enumerate(events):
            sse = b"data: " + event + b"\n\n"
            if stamped and index < tokens:
                before, _, after = sse.partition(_STAMP_SLOT.encode())
                writes.append((before, after))
            else:
                writes.append(_http_chunk(sse))
        writes.append(_http_chunk(b"data: [DONE]\n\n") + _LAST_CHUNK)
        return cls(writes=tuple(writes), tokens=tokens)

    @staticmethod
    def render(write: bytes | tuple[bytes, bytes]) -> bytes:
        """The bytes to send now: a template gets the current monotonic time."""
        if isinstance(write, bytes):
            return write
        before, after = write
        return _http_chunk(before + b"%d" % time.monotonic_ns() + after)


@functools.lru_cache(maxsize=64)
def _long_stream(*, include_usage: bool, tokens: int, stamped: bool) -> _StreamBody:
    """The writes of a stream of a length a request asked for (`x-bench-stream-tokens`),
    built on first use and kept for the next request of that length."""
    return _StreamBody.build(include_usage=include_usage, tokens=tokens, stamped=stamped)


def stream_tokens_asked(head: bytes) -> int | None:
    """The stream length a request's `x-bench-stream-tokens` header asks for (None: no
    header); ValueError when it is not an integer from 1 to `MAX_STREAM_TOKENS`."""
    match = _STREAM_TOKENS_HEADER.search(head)
    if match is None:
        return None
    value = match.group(1)
    if not value.isdigit() or not 1 <= int(value) <= MAX_STREAM_TOKENS:
        raise ValueError(f"x-bench-stream-tokens: {value!r}")
    return int(value)


def _fixed_response(status: str, body: bytes) -> bytes:
    """A whole JSON response, head and body, ready for one write."""
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


_STREAM_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


_MODELS_BODY: Final = _json(
    {"object": "list", "data": [{"id": SERVED_MODEL, "object": "model", "owned_by": "bench"}]}
)
_NOT_FOUND_BODY: Final = _json({"error": {"message": "no such route", "type": "not_found"}})

_BAD_REQUEST_BODY: Final = _json({"error": {"message": "not JSON", "type": "invalid_request"}})
_BAD_STREAM_TOKENS_BODY: Final = _json(
    {
        "error": {
            "message": f"x-bench-stream-tokens must be an integer from 1 to {MAX_STREAM_TOKENS}",
            "type": "invalid_request",
        }
    }
)

_MODELS: Final = _fixed_response("200 OK", _MODELS_BODY)
_HEALTH: Final = _fixed_response("200 OK", b"{}")
_NOT_FOUND: Final = _fixed_response("404 Not Found", _NOT_FOUND_BODY)
_BAD_REQUEST: Final = _fixed_response("400 Bad Request", _BAD_REQUEST_BODY)
_BAD_STREAM_TOKENS: Final = _fixed_response("400 Bad Request", _BAD_STREAM_TOKENS_BODY)


def _event_writes(events: list[bytes]) -> tuple[bytes, ...]:
    """A caller protocol's stream as socket writes: one per event, the body's end with
    the last (these protocols have no `[DONE]`)."""
    writes = [_http_chunk(event) for event in events]
    writes[-1] += _LAST_CHUNK
    return tuple(writes)


@dataclass(frozen=True, slots=True)
class _Answers:
    """What one inference endpoint answers: the whole body (and the response ready to
    send), and for a caller protocol, its stream's writes (chat's are `_StreamBody`s)."""

    body: bytes
    response: bytes
    stream: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, body: bytes, events: list[bytes] | None = None) -> _Answers:
        writes = _event_writes(events) if events else ()
        return cls(body=body, response=_fixed_response("200 OK", body), stream=writes)


def _answers(tokens: int) -> dict[bytes, _Answers]:
    """Every inference endpoint's answers (chat's stream aside), built once."""
    completion = completion_body()
    chunks = stream_events(include_usage=True, tokens=tokens)
    return {
        CHAT_PATH: _Answers.of(completion),
        MESSAGES_PATH: _Answers.of(
            messages_body(completion, SERVED_MODEL),
            messages_events(chunks, SERVED_MODEL, PROMPT_TOKENS),
        ),
        RESPONSES_PATH: _Answers.of(
            responses_body(completion, SERVED_MODEL), responses_events(chunks, SERVED_MODEL)
        ),
    }


#: Events of a default stream of each caller protocol, as its caller counts them.
MESSAGES_STREAM_EVENTS: Final = len(_answers(STREAM_TOKENS)[MESSAGES_PATH].stream)
RESPONSES_STREAM_EVENTS: Final = len(_answers(STREAM_TOKENS)[RESPONSES_PATH].stream)


# --- the server ---------------------------------------------------------------------------------


class _Malformed(Exception):
    """The peer sent something this tiny server does not speak; the connection is closed."""


@dataclass(order=True)
class _PacedStream:
    """One paced stream in the pacer's heap, ordered by when its next write is due."""

    due: float
    order: int
    stream: trio.SocketStream = field(compare=False)
    body: _StreamBody = field(compare=False)
    next_write: int = field(default=0, compare=False)
    finished: trio.Event = field(default_factory=trio.Event, compare=False)


class _Pacer:
    """Sends the writes of every paced stream from one task, each when it is due.

    A task per stream sleeping between its tokens costs a wake-up per token; at
    thousands of tokens per second that made the upstream the bottleneck of the direct
    baseline. One task with a heap wakes once for every token due within `TICK_S` of
    the same moment and writes them one after the other, as a GPU emits the tokens of
    a batch together. The stamp is taken at each write, so what the callers measure is
    unaffected by the grouping. A stream whose caller is gone is dropped; the writes of
    one stream are small (a few KiB), so a write never waits on a full socket buffer.
    Each token is due `interval_s` times the `slowdown` of that moment after the one
    before it (1 unless the runtime is saturated).
    """

    TICK_S: Final = 0.002

    def __init__(self, interval_s: float, slowdown: Callable[[], float]) -> None:
        self._interval_s = interval_s
        self._slowdown = slowdown
        self._heap: list[_PacedStream] = []
        self._order = itertools.count()
        self._wake = trio.Event()

    async def stream(self, stream: trio.SocketStream, body: _StreamBody) -> None:
        """Send `body` on `stream`, paced; return once it is all sent (or the caller left)."""
        now = trio.current_time()
        paced = _PacedStream(now, next(self._order), stream, body)
        heapq.heappush(self._heap, paced)
        self._wake.set()
        await paced.finished.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        heap = self._heap
        while True:
            if not heap:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            await trio.sleep_until(heap[0].due)
            horizon = trio.current_time() + self.TICK_S
            while heap and heap[0].due <= horizon:
                paced = heapq.heappop(heap)
                if await self._write(paced):
                    heapq.heappush(heap, paced)
                else:
                    paced.finished.set()

    async def _write(self, paced: _PacedStream) -> bool:
        """Send the stream's next token (with everything after the last); True if more follow."""
        body = paced.body
        index = paced.next_write
        last = index + 1 >= body.tokens
        writes = body.writes[index:] if last else body.writes[index : index + 1]
        try:
            await paced.stream.send_all(b"".join(_StreamBody.render(w) for w in writes))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        if last:
            return False
        paced.next_write = index + 1
        paced.due += self._interval_s * self._slowdown()
        return True


class BenchUpstream:
    """A fast fake OpenAI upstream.

    `stream_tokens` content tokens per stream; `tokens_per_second` paces and stamps chat
    streams' (None: neither, every write leaves at once); `prefill` models a prefix
    cache (None: no prefill time at all); `slots`, the sequences generated at full pace,
    beyond which the runtime is saturated (None: never; module docstring)."""

    def __init__(
        self,
        *,
        stream_tokens: int = STREAM_TOKENS,
        tokens_per_second: float | None = None,
        prefill: PrefillCost | None = None,
        cache_slots: int = DEFAULT_SLOTS,
        slots: int | None = None,
    ) -> None:
        if stream_tokens < 1:
            raise ValueError("stream_tokens must be >= 1")
        if tokens_per_second is not None and tokens_per_second <= 0:
            raise ValueError("tokens_per_second must be > 0")
        if slots is not None and slots < 1:
            raise ValueError("slots must be >= 1")
        self.stream_tokens = stream_tokens
        self.tokens_per_second = tokens_per_second
        stamped = tokens_per_second is not None
        self._streams = {
            usage: _StreamBody.build(include_usage=usage, tokens=stream_tokens, stamped=stamped)
            for usage in (False, True)
        }
        self._answers = _answers(stream_tokens)
        self._slots = slots
        self._in_flight = 0
        """Inference requests being answered now, from every client."""
        self._unsaturated = trio.Event()
        """Set while no more than `slots` requests are in flight; replaced when that ends."""
        self._unsaturated.set()
        pacer = _Pacer(1.0 / tokens_per_second, self._slowdown) if tokens_per_second else None
        self._pacer = pacer
        self._cache = None if prefill is None else PrefixCache(prefill, slots=cache_slots)

    @property
    def in_flight(self) -> int:
        """Inference requests being answered now."""
        return self._in_flight

    @property
    def saturated(self) -> bool:
        """More inference requests in flight than `slots` (never without `slots`)."""
        return self._slots is not None and self._in_flight > self._slots

    def _slowdown(self) -> float:
        """How many times further apart paced tokens come now: the runtime's throughput
        (`slots` sequences at full pace) shared among every request in flight."""
        if self._slots is None or self._in_flight <= self._slots:
            return 1.0
        return self._in_flight / self._slots

    def _occupy(self) -> None:
        self._in_flight += 1
        if self.saturated and self._unsaturated.is_set():
            self._unsaturated = trio.Event()

    def _release(self) -> None:
        self._in_flight -= 1
        if not self.saturated:
            self._unsaturated.set()

    async def _until_unsaturated(self) -> None:
        """Return once no more than `slots` requests are in flight (at once if so now)."""
        while self.saturated:
            await self._unsaturated.wait()

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen; `task_status.started(root_url)` once accepting, then serve forever."""
        async with trio.open_nursery() as nursery:
            if self._pacer is not None:
                await nursery.start(self._pacer.run)
            listeners = await trio.open_tcp_listeners(port, host=host, backlog=1024)
            bound_host, bound_port = listeners[0].socket.getsockname()[:2]
            task_status.started(f"http://{bound_host}:{bound_port}")
            await trio.serve_listeners(self._serve_connection, listeners)

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        buffer = bytearray()
        try:
            while True:
                end = buffer.find(_HEAD_END)
                while end < 0:
                    if len(buffer) > _MAX_HEAD_BYTES:
                        raise _Malformed
                    data = await stream.receive_some(_RECEIVE_BYTES)
                    if not data:
                        return  # the client closed an idle keep-alive connection
                    buffer += data
                    end = buffer.find(_HEAD_END)
                head = bytes(buffer[: end + 2])  # keep the last CRLF so headers all end alike
                body_start = end + len(_HEAD_END)
                body_length = _body_length(head)
                while len(buffer) - body_start < body_length:
                    data = await stream.receive_some(_RECEIVE_BYTES)
                    if not data:
                        return
                    buffer += data
                body = bytes(buffer[body_start : body_start + body_length])
                del buffer[: body_start + body_length]
                await self._answer(stream, head, body)
                if _CONNECTION_CLOSE.search(head):
                    return
        except (_Malformed, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            with trio.move_on_after(_CLOSE_GRACE_S, shield=True):
                await stream.aclose()

    async def _answer(self, stream: trio.SocketStream, head: bytes, body: bytes) -> None:
        request_line = head[: head.find(b"\r\n")]
        method, _, rest = request_line.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if method == b"POST" and path in self._answers:
            self._occupy()
            try:
                await self._infer(stream, path, head, body)
            finally:
                self._release()
        elif method == b"GET" and path == b"/v1/models":
            await self._until_unsaturated()
            await stream.send_all(_MODELS)
        elif method == b"GET" and path in (b"/health", b"/healthz"):
            await stream.send_all(_HEALTH)
        else:
            await stream.send_all(_NOT_FOUND)

    async def _infer(
        self, stream: trio.SocketStream, path: bytes, head: bytes, body: bytes
    ) -> None:
        """Answer an inference request at `path` (after its prefill, in prefix-cache mode)."""
        answers = self._answers[path]
        try:
            tokens = stream_tokens_asked(head)
        except ValueError:
            await stream.send_all(_BAD_STREAM_TOKENS)
            return
        prefill = None
        if self._cache is not None:
            try:
                payload = json.loads(body)
            except ValueError:
                await stream.send_all(_BAD_REQUEST)
                return
            prefill = self._cache.prefill(
                render_prompt(payload if isinstance(payload, dict) else {})
            )
            await trio.sleep(prefill.seconds)
        if not asks_for_stream(body):
            if prefill is None:
                await stream.send_all(answers.response)
            else:
                counted = with_usage(
                    answers.body,
                    path,
                    prompt_tokens=prefill.tokens,
                    cached_tokens=prefill.cached_tokens,
                )
                await stream.send_all(_fixed_response("200 OK", counted))
            return
        await stream.send_all(_STREAM_HEAD)
        if path != CHAT_PATH:
            for event in answers.stream:
                await stream.send_all(event)
            return
        include_usage = _INCLUDE_USAGE.search(body) is not None
        if tokens is None or tokens == self.stream_tokens:
            stream_body = self._streams[include_usage]
        else:
            stamped = self.tokens_per_second is not None
            stream_body = _long_stream(include_usage=include_usage, tokens=tokens, stamped=stamped)
        if self._pacer is not None:
            await self._pacer.stream(stream, stream_body)
        else:
            for write in stream_body.writes:
                await stream.send_all(_StreamBody.render(write))


def _body_length(head: bytes) -> int:
    if _CHUNKED_BODY.search(head):
        raise _Malformed  # no client of the bench sends chunked request bodies
    match = _CONTENT_LENGTH.search(head)
    if match is None:
        return 0
    length = int(match.group(1))
    if length > _MAX_BODY_BYTES:
        raise _Malformed
    return length


# --- process entry point ------------------------------------------------------------------------


async def start_upstream(nursery: trio.Nursery, *args: str) -> Service[str]:
    """`python -m bench.upstream ARGS` as a child owned by `nursery`, once accepting (its
    `ready` is its root URL). The caller owns the deadline for startup."""
    return await start_service(
        nursery, "bench-upstream", python_argv("bench.upstream", *args), url_after(READY_PREFIX)
    )


async def _serve_process(upstream: BenchUpstream, host: str, port: int) -> None:
    async with trio.open_nursery() as nursery:
        url = await nursery.start(upstream.serve, host, port)
        print(READY_PREFIX + url, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.upstream", description="The benchmark's fast fake upstream."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--stream-tokens", type=int, default=STREAM_TOKENS, help="content tokens per stream"
    )
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=None,
        help="pace and time-stamp stream tokens (default: no artificial delay)",
    )
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=None,
        metavar="U",
        help="model a prompt prefix cache: U µs to prefill each uncached prompt token "
        "(default: no prefill time)",
    )
    parser.add_argument(
        "--cached-prefill-us-per-token",
        type=float,
        default=None,
        metavar="C",
        help=f"µs per prompt token reused from the cache ({CACHED_COST_SHARE:g} x U)",
    )
    parser.add_argument(
        "--cache-slots", type=int, default=DEFAULT_SLOTS, help="prompts the cache keeps"
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=None,
        metavar="N",
        help="sequences generated at full pace; with more requests in flight the runtime "
        "is saturated: paced tokens slow down and GET /v1/models waits (default: never)",
    )
    args = parser.parse_args(argv)
    try:
        prefill = None
        if args.prefill_us_per_token is not None:
            cached = args.cached_prefill_us_per_token
            if cached is None:
                cached = CACHED_COST_SHARE * args.prefill_us_per_token
            prefill = PrefillCost(uncached_us=args.prefill_us_per_token, cached_us=cached)
        elif args.cached_prefill_us_per_token is not None:
            parser.error("--cached-prefill-us-per-token needs --prefill-us-per-token")
        upstream = BenchUpstream(
            stream_tokens=args.stream_tokens,
            tokens_per_second=args.tokens_per_second,
            prefill=prefill,
            cache_slots=args.cache_slots,
            slots=args.slots,
        )
    except ValueError as exc:
        parser.error(str(exc))
    try:
        trio.run(_serve_process, upstream, args.host, args.port)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
