"""Hostile framing on the caller port: requests whose length two parsers could read two
ways (request smuggling, RFC 9112 §6.3, §11.2) are refused with a 400 and the connection
is closed, so the bytes after them are never read as a request of their own; and every
framing error (400, 431, 501) carries OpenAI's error body like any other error.

The client is a raw socket: each test sees every byte the Edge wrote, up to its close."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
import pytest
import trio

from tests.e2e.stack import WAIT_GUARD_S, Stack

#: A request that must never be answered: smuggled behind a request whose end is ambiguous.
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


@dataclass
class Reply:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


def parse_replies(data: bytes) -> list[Reply]:
    """Every response in `data`, in order (h11 as the client reads them)."""
    replies = []
    while data:
        client = h11.Connection(h11.CLIENT)
        client.send(h11.Request(method="GET", target="/", headers=[("Host", "localhost")]))
        client.send(h11.EndOfMessage())
        client.receive_data(data)
        head = client.next_event()
        assert isinstance(head, h11.Response), (head, data[:200])
        body = b""
        while not isinstance(event := client.next_event(), h11.EndOfMessage):
            assert isinstance(event, h11.Data), (event, data[:200])
            body += event.data
        replies.append(Reply(head.status_code, dict(head.headers), body))
        data = client.trailing_data[0]
    return replies


async def exchange(stack: Stack, request: bytes) -> list[Reply]:
    """Send `request` on a fresh connection and read until the Edge closes it."""
    url = urlsplit(stack.addresses.openai_url)
    assert url.hostname is not None and url.port is not None
    stream = await trio.open_tcp_stream(url.hostname, url.port)
    received = bytearray()
    async with stream:
        await stream.send_all(request)
        with trio.fail_after(WAIT_GUARD_S):  # an Edge that keeps the connection open fails
            while chunk := await stream.receive_some():
                received += chunk
    return parse_replies(bytes(received))


def assert_refused(replies: list[Reply], status: int, says: str) -> dict[str, object]:
    """One reply only (nothing after it was read as a request), an OpenAI error body
    saying `says`, the request id every answer carries, and the connection closed;
    returns the error object."""
    assert [reply.status for reply in replies] == [status], replies
    reply = replies[0]
    assert reply.headers[b"connection"] == b"close"
    assert re.fullmatch(rb"req_[0-9a-f]{24}", reply.headers[b"x-request-id"])
    assert reply.headers[b"content-type"] == b"application/json"
    error = json.loads(reply.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert says in error["message"], error
    return dict(error)


def post(headers: bytes, body: bytes, version: bytes = b"1.1") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/" + version + b"\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\n" + headers + b"\r\n" + body
    )


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)


@pytest.mark.parametrize(
    ("request_bytes", "says"),
    [
        pytest.param(
            post(
                b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(chunked(CHAT)),
                chunked(CHAT),
            ),
            "both Content-Length and Transfer-Encoding",
            id="content-length-and-chunked",
        ),
        pytest.param(
            post(
                b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n" % len(chunked(CHAT)),
                chunked(CHAT),
            ),
            "both Content-Length and Transfer-Encoding",
            id="chunked-and-content-length",
        ),
        pytest.param(
            post(b"Content-Length: %d\r\nContent-Length: 2\r\n" % len(CHAT), CHAT),
            "Content-Length",
            id="duplicate-content-length",
        ),
        pytest.param(
            post(b"X-Note: folded\r\n  onto two lines\r\nContent-Length: %d\r\n" % len(CHAT), CHAT),
            "obsolete line folding",
            id="obs-fold",
        ),
        pytest.param(
            post(b"Transfer-Encoding: chunked\r\n", chunked(CHAT), version=b"1.0"),
            "HTTP/1.0",
            id="chunked-in-http-1.0",
        ),
    ],
)
async def test_ambiguous_framing_is_a_400_and_the_rest_is_never_read(
    stack_one: Stack, request_bytes: bytes, says: str
) -> None:
    replies = await exchange(stack_one, request_bytes + SMUGGLED)
    error = assert_refused(replies, 400, says)
    assert error["code"] == "malformed_request"


async def test_one_content_length_sent_twice_is_one_length(stack_one: Stack) -> None:
    """RFC 9110 §8.6 lets a recipient accept a repeated identical length: h11 does."""
    lengths = b"Content-Length: %d\r\nContent-Length: %d\r\n" % (len(CHAT), len(CHAT))
    replies = await exchange(stack_one, post(b"Connection: close\r\n" + lengths, CHAT))
    assert [reply.status for reply in replies] == [200]


async def test_headers_too_large_are_a_431_with_an_error_body(stack_one: Stack) -> None:
    """h11 bounds a head still incomplete (16 KiB in Hypercorn's default config)."""
    request = b"POST /v1/chat/completions HTTP/1.1\r\nX-Big: " + b"a" * 20_000  # no end
    error = assert_refused(await exchange(stack_one, request), 431, "header")
    assert error["code"] == "request_headers_too_large"


async def test_a_whole_head_too_large_is_a_431_however_it_arrived(stack_one: Stack) -> None:
    """Rule 5: one that came complete in a single read is refused as one that trickled
    in is."""
    request = post(b"X-Big: " + b"a" * 20_000 + b"\r\n", CHAT)
    error = assert_refused(await exchange(stack_one, request + SMUGGLED), 431, "too large")
    assert error["code"] == "request_headers_too_large"


async def test_http2_with_prior_knowledge_is_a_505_and_the_edge_serves_on(
    stack_one: Stack,
) -> None:
    """Rule 6: the HTTP/2 preface is refused, and nothing after it is read."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    error = assert_refused(await exchange(stack_one, preface), 505, "HTTP/2.0 is not served")
    assert error["code"] == "http_version"
    length = b"Content-Length: %d\r\n" % len(CHAT)
    replies = await exchange(stack_one, post(b"Connection: close\r\n" + length, CHAT))
    assert [reply.status for reply in replies] == [200]


async def test_an_upgrade_to_h2c_is_served_as_http11(stack_one: Stack) -> None:
    """Rule 6: the upgrade is ignored (no 101), the request answered over HTTP/1.1."""
    request = (
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade, "
        b"HTTP2-Settings, close\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
    )
    replies = await exchange(stack_one, request)
    assert [reply.status for reply in replies] == [200]


async def test_a_request_target_in_absolute_form_is_served(stack_one: Stack) -> None:
    """RFC 9112 §3.2.2: a server must accept it (a client speaking to a proxy sends it)."""
    url = stack_one.addresses.openai_url
    length = b"Content-Length: %d\r\nConnection: close\r\n" % len(CHAT)
    request = post(length, CHAT).replace(
        b"POST /v1/chat/completions", b"POST " + url.encode() + b"/v1/chat/completions", 1
    )
    replies = await exchange(stack_one, request)
    assert [reply.status for reply in replies] == [200]
    assert json.loads(replies[0].body)["object"] == "chat.completion"


async def test_an_unsupported_transfer_coding_is_a_501_with_an_error_body(
    stack_one: Stack,
) -> None:
    request = post(b"Transfer-Encoding: gzip, chunked\r\n", chunked(CHAT))
    error = assert_refused(await exchange(stack_one, request + SMUGGLED), 501, "Transfer-Encoding")
    assert error["code"] == "unsupported_transfer_coding"


async def test_a_garbled_request_line_is_a_400_with_an_error_body(stack_one: Stack) -> None:
    error = assert_refused(await exchange(stack_one, b"HELLO\r\n\r\n"), 400, "request line")
    assert error["code"] == "malformed_request"
