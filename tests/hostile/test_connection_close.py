"""`Connection: close` and HTTP/1.0 are honoured on every route,
watched on raw sockets: the Edge closes the connection once the response is written."""

from __future__ import annotations

import pytest
import trio

from tests.e2e.stack import Stack
from tests.timing import GUARD_S

OPENAI_ROUTES = [
    ("GET", "/healthz", b""),
    ("GET", "/v1/models", b""),
    ("GET", "/v1/models/m", b""),
    ("GET", "/v1/models/unknown", b""),
    ("GET", "/no/such/path", b""),
    ("DELETE", "/v1/models", b""),
    ("POST", "/v1/chat/completions", b'{"model":"m","messages":[{"role":"user","content":"x"}]}'),
    ("GET", "/v1/chat/completions", b""),
]
ADMIN_ROUTES = [
    ("GET", "/healthz", b""),
    ("GET", "/status", b""),
    ("GET", "/catalog", b""),
    ("GET", "/metrics", b""),
    ("GET", "/usage", b""),
    ("POST", "/refresh", b'{"mode":"dry_run"}'),
    ("POST", "/refresh", b"{broken"),
    ("GET", "/no/such/path", b""),
]
CLOSING = [
    pytest.param("HTTP/1.1", b"Connection: close\r\n", id="http11-close"),
    pytest.param("HTTP/1.0", b"", id="http10"),
]


def _split(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _exchange(url: str, request: bytes) -> bytes:
    """Send `request` and read until the server closes; fails if it keeps it open."""
    host, port = _split(url)
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(request)
        received = b""
        with trio.fail_after(GUARD_S):
            while data := await stream.receive_some():
                received += data
    return received


def _request(method: str, path: str, body: bytes, version: str, extra: bytes) -> bytes:
    head = f"{method} {path} {version}\r\nHost: 127.0.0.1\r\n".encode() + extra
    if body:
        head += b"content-type: application/json\r\n"
    return head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


@pytest.mark.parametrize(("version", "extra"), CLOSING)
async def test_every_route_closes_when_asked(stack_one: Stack, version: str, extra: bytes) -> None:
    for base, routes in (
        (stack_one.addresses.openai_url, OPENAI_ROUTES),
        (stack_one.addresses.admin_url, ADMIN_ROUTES),
    ):
        for method, path, body in routes:
            reply = await _exchange(base, _request(method, path, body, version, extra))
            assert reply.startswith(b"HTTP/1.1 "), (base, method, path, reply[:100])
            assert b"\r\nconnection: close\r\n" in reply.lower(), (method, path)


async def test_keep_alive_still_serves_several_requests(stack_one: Stack) -> None:
    host, port = _split(stack_one.addresses.admin_url)
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        for _ in range(3):
            await stream.send_all(_request("GET", "/healthz", b"", "HTTP/1.1", b""))
            received = b""
            with trio.fail_after(GUARD_S):
                while not received.endswith(b"}"):
                    received += await stream.receive_some()
            assert received.startswith(b"HTTP/1.1 200")
