"""The benchmark's upstream: a fake OpenAI-compatible server that costs almost nothing.

It is the baseline every other number is compared with, so it must add as little as
possible of its own: a raw HTTP/1.1 server on Trio sockets (keep-alive, no HTTP library,
no routing framework) whose answers are built once, at start, as ready-to-send bytes.
Per request it only finds the end of the head, reads `Content-Length` bytes of body and
looks for `"stream": true`; it never decodes the JSON.

- `POST /v1/chat/completions`, non-stream: one fixed `chat.completion` (with `usage`).
- `POST /v1/chat/completions`, `"stream": true`: `STREAM_CHUNKS` (22) `data:` events in
  separate chunked-encoding writes, then `data: [DONE]`. When the request asks for
  `stream_options.include_usage` (the IOP Edge always does, to meter usage), one usage
  chunk comes before `[DONE]`, as vLLM sends it; the caller-visible stream is the same.
- `GET /v1/models`, `GET /health`: what gateways probe.

There is no artificial delay unless `--chunk-interval-ms` asks for one. (Trio's socket
streams set TCP_NODELAY, so every write leaves at once.)

    python -m bench.upstream [--port 0] [--chunk-interval-ms 0]

prints `bench-upstream listening on http://127.0.0.1:PORT` once accepting, then serves
until stopped (SIGINT/SIGTERM). In-process: `url = await nursery.start(upstream.serve)`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Final

import trio

#: The logical model id callers name; the gateways under test map it to SERVED_MODEL.
MODEL: Final = "bench-model"
#: The model name the upstream serves (what a gateway puts in `model` upstream).
SERVED_MODEL: Final = "bench-served"
#: `data:` events of one stream (first carries the role, last the finish reason).
STREAM_CHUNKS: Final = 22
PROMPT_TOKENS: Final = 12
READY_PREFIX: Final = "bench-upstream listening on "

_MAX_HEAD_BYTES: Final = 64 * 1024
_MAX_BODY_BYTES: Final = 16 * 1024 * 1024
_RECEIVE_BYTES: Final = 64 * 1024
_CLOSE_GRACE_S: Final = 1.0
_HEAD_END: Final = b"\r\n\r\n"
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CONNECTION_CLOSE = re.compile(rb"\r\nconnection:[ \t]*close", re.IGNORECASE)
_CHUNKED_BODY = re.compile(rb"\r\ntransfer-encoding:[ \t]*chunked", re.IGNORECASE)
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')
_INCLUDE_USAGE = re.compile(rb'"include_usage"\s*:\s*true')


# --- the bytes (built once) -------------------------------------------------------------------


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _tokens() -> list[str]:
    """The completion's text, one token per content chunk."""
    return [f"tok{i} " for i in range(STREAM_CHUNKS - 1)]


def _usage() -> dict[str, int]:
    completion = STREAM_CHUNKS - 1
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


def stream_events(*, include_usage: bool) -> list[bytes]:
    """The `data:` payloads of one stream, in order, without `[DONE]`."""
    tokens = _tokens()
    chunks = [_chunk({"role": "assistant", "content": tokens[0]}, None)]
    chunks += [_chunk({"content": token}, None) for token in tokens[1:]]
    chunks.append(_chunk({}, "stop"))
    if include_usage:
        chunks.append({**_chunk({}, None), "choices": [], "usage": _usage()})
    return [_json(chunk) for chunk in chunks]


def _http_chunk(payload: bytes) -> bytes:
    """One chunk of a chunked-encoding body."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse_writes(*, include_usage: bool) -> tuple[bytes, ...]:
    """The socket writes of a stream's body: one per event, then [DONE] and the last chunk."""
    writes = [
        _http_chunk(b"data: " + event + b"\n\n")
        for event in stream_events(include_usage=include_usage)
    ]
    writes.append(_http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return tuple(writes)


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

_COMPLETION: Final = _fixed_response("200 OK", completion_body())
_STREAM: Final = _sse_writes(include_usage=False)
_STREAM_WITH_USAGE: Final = _sse_writes(include_usage=True)
_MODELS: Final = _fixed_response("200 OK", _MODELS_BODY)
_HEALTH: Final = _fixed_response("200 OK", b"{}")
_NOT_FOUND: Final = _fixed_response("404 Not Found", _NOT_FOUND_BODY)


# --- the server ---------------------------------------------------------------------------------


class _Malformed(Exception):
    """The peer sent something this tiny server does not speak; the connection is closed."""


@dataclass(frozen=True, slots=True)
class BenchUpstream:
    """A fast fake OpenAI upstream; `chunk_interval_s` paces stream events (default: none)."""

    chunk_interval_s: float = 0.0

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen; `task_status.started(root_url)` once accepting, then serve forever."""
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
        if method == b"POST" and path == b"/v1/chat/completions":
            if not asks_for_stream(body):
                await stream.send_all(_COMPLETION)
                return
            with_usage = _INCLUDE_USAGE.search(body) is not None
            writes = _STREAM_WITH_USAGE if with_usage else _STREAM
            await stream.send_all(_STREAM_HEAD)
            for i, write in enumerate(writes):
                if i and self.chunk_interval_s:
                    await trio.sleep(self.chunk_interval_s)
                await stream.send_all(write)
        elif method == b"GET" and path == b"/v1/models":
            await stream.send_all(_MODELS)
        elif method == b"GET" and path in (b"/health", b"/healthz"):
            await stream.send_all(_HEALTH)
        else:
            await stream.send_all(_NOT_FOUND)


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
        "--chunk-interval-ms",
        type=float,
        default=0.0,
        help="pause between stream events (default 0: no artificial delay)",
    )
    args = parser.parse_args(argv)
    upstream = BenchUpstream(chunk_interval_s=args.chunk_interval_ms / 1000)
    try:
        trio.run(_serve_process, upstream, args.host, args.port)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
