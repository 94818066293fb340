"""How a run's request and response travel on an upstream connection: the request's
progress (which drives the deadlines and the `retryable` rule), its URL and `Host`, and
the response body read as it arrives, unencoded."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Final, cast

import httpcore2
import httpx2
import trio

from iop_node.adapters.base import AdapterError
from iop_node.tracing import UpstreamCall, passed_on
from schemas.limits import MAX_PAYLOAD_BYTES
from schemas.wire import FailureCode, Run

__all__ = [
    "CORE_ERRORS",
    "DONE",
    "DRAIN_AFTER_DONE_S",
    "ERROR_BODY_LIMIT",
    "Progress",
    "body_chunks",
    "check_encoding",
    "core_url",
    "drain",
    "error_body",
    "host_header",
    "read_body",
    "whole_answer",
]

#: Bytes of an error response read to find the upstream's message; the rest is dropped.
ERROR_BODY_LIMIT: Final = 64 * 1024
#: After a stream's end, how long to wait for the end of the chunked body so the
#: connection can go back to the pool; a server that keeps talking past it just loses
#: its connection.
DRAIN_AFTER_DONE_S: Final = 1.0
DONE: Final = b"[DONE]"
#: What the run path raises from `httpcore2` (it has no common base class); the probe path
#: and anything httpx2 raises are `httpx2.HTTPError`s.
CORE_ERRORS: Final = (
    httpcore2.TimeoutException,
    httpcore2.NetworkError,
    httpcore2.ProtocolError,
    httpcore2.ProxyError,
    httpcore2.UnsupportedProtocol,
)


@dataclass(slots=True)
class Progress:
    """How far one request got: drives the deadline switch and the `retryable` rule."""

    scope: trio.CancelScope
    request_deadline: float
    first_byte: bool = False
    emitted: int = 0
    call: UpstreamCall | None = None
    """The request's span when the run is traced (`iop_node.tracing`)."""

    def saw_first_byte(self) -> None:
        if not self.first_byte:
            self.first_byte = True
            self.scope.deadline = self.request_deadline
            if self.call is not None:
                self.call.first_byte()

    def trace_headers(self, run: Run) -> list[tuple[bytes, bytes]]:
        """The W3C trace context the upstream request carries: its own span's when
        traced, else the Edge's as the run brought it."""
        return self.call.headers if self.call is not None else passed_on(run)


def core_url(url: httpx2.URL) -> httpcore2.URL:
    return httpcore2.URL(
        scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
    )


def host_header(url: httpx2.URL) -> bytes:
    """The Host header httpx2 would send: the host (IPv6 in brackets), with the port unless
    it is the scheme's default."""
    return url.netloc


async def error_body(response: httpcore2.Response, progress: Progress) -> bytes:
    """The start of an error response's body, to find the upstream's message in. An
    encoded one cannot be read: the status alone has to do."""
    body = await read_body(response, progress, limit=ERROR_BODY_LIMIT)
    return b"" if _encoded(response) else body


def _encoded(response: httpcore2.Response) -> bytes | None:
    """The response's content coding, when it has one other than `identity`."""
    for name, value in response.headers:
        if name.lower() == b"content-encoding":
            coding = value.strip().lower()
            if coding and coding != b"identity":
                return coding
    return None


def check_encoding(response: httpcore2.Response) -> None:
    """Refuse a body the upstream encoded although we asked for `identity`: we relay bytes
    as they arrive and cannot read (or relay) a compressed stream."""
    coding = _encoded(response)
    if coding is not None:
        raise AdapterError(
            FailureCode.UPSTREAM_ERROR,
            f"upstream sent a {coding.decode('latin-1')}-encoded body "
            "despite Accept-Encoding: identity",
            retryable=True,
        )


def body_chunks(response: httpcore2.Response) -> AsyncGenerator[bytes]:
    """The response body straight from the pool's stream (an async generator), one
    generator layer fewer per chunk than `response.aiter_stream()`."""
    return cast(AsyncGenerator[bytes], aiter(cast(AsyncIterable[bytes], response.stream)))


async def drain(body: AsyncGenerator[bytes]) -> None:
    """Let the end of a chunked body arrive (within `DRAIN_AFTER_DONE_S`) so the
    connection is reused. A body that breaks off after the stream's end (no last chunk,
    a `Content-Length` it never reaches) broke nothing the caller reads: the reply was
    whole, and only the connection is lost (httpcore2 does not reuse it)."""
    with trio.move_on_after(DRAIN_AFTER_DONE_S):
        try:
            async for _ in body:
                pass
        except CORE_ERRORS:
            pass


async def read_body(
    response: httpcore2.Response, progress: Progress, *, limit: int | None = None
) -> bytes:
    """Read a response body (up to `limit` bytes), marking the first byte as it arrives.
    A run's whole answer has `limit` one past what the wire carries (`whole_answer`)."""
    parts: list[bytes] = []
    size = 0
    async with aclosing(body_chunks(response)) as body:
        async for raw in body:
            if not progress.first_byte:
                progress.saw_first_byte()
            parts.append(raw)
            size += len(raw)
            if limit is not None and size >= limit:
                break
    data = b"".join(parts)
    return data if limit is None else data[:limit]


async def whole_answer(response: httpcore2.Response, progress: Progress) -> bytes:
    """A non-stream run's body, read no further than the wire carries: an upstream that
    sends more fails the run as too large without the Node holding all of it."""
    body = await read_body(response, progress, limit=MAX_PAYLOAD_BYTES + 1)
    if len(body) > MAX_PAYLOAD_BYTES:
        raise AdapterError(
            FailureCode.RESPONSE_TOO_LARGE,
            f"the response exceeds the wire's limit of {MAX_PAYLOAD_BYTES} bytes",
        )
    return body
