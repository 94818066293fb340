"""OpenAICompatAdapter's run transport: the pool it sends runs into (direct or the
environment's proxy), the exact request head it sends, and its refusal of encoded bodies.

The upstreams here are `RecordingServer`s (`tests/recording_server.py`), which record each
request as it arrived on the wire, so a test sees what `FakeUpstream` normalises away and
can answer what it never would. Which pool httpx2 routes a URL to, for every proxy
setting, is the capability `tests/compat/test_httpx2.py` checks.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable

import httpx2
import pytest
import trio

from iop_node.adapters.base import AdapterError
from iop_node.adapters.upstream_http.exchange import host_header
from iop_node.compat.httpx2 import connection_pool_for
from schemas.wire import Usage
from tests.timing import GUARD_S

from ..recording_server import Answer, RecordingServer, Seen, clear_proxy_env
from .conftest import ADAPTER_CAPACITY, MODEL, MakeAdapter
from .fake_upstream import FakeUpstream, expected_events, expected_response
from .test_openai_compat import Collector, make_run

KEY_ENV = "IOP_TEST_TRANSPORT_KEY"
KEY_VALUE = "test-key-value"


def reply(
    body: bytes, *, stream: bool = False, encoding: bytes | None = None
) -> Callable[[Seen], Answer]:
    """Answer every request 200 with `body` (an event stream or JSON), maybe labelled with a
    Content-Encoding."""
    headers = [(b"content-type", b"text/event-stream" if stream else b"application/json")]
    if encoding is not None:
        headers.append((b"content-encoding", encoding))
    return lambda _seen: (200, headers, body)


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start every test from an environment without proxy settings, in either case."""
    clear_proxy_env(monkeypatch)


# --- routing: which pool runs go into ---------------------------------------------------------


async def test_runs_connections_come_from_the_pool_the_client_routes_base_url_to(
    make_adapter: MakeAdapter,
) -> None:
    """Runs' connections are made by the pool the client routes `base_url` to, and kept
    as the client keeps its own (capacity + 2 idle, 4 s)."""
    base_url = "http://127.0.0.1:8000/v1"
    adapter = make_adapter(base_url)
    pool = adapter._pool
    assert pool is connection_pool_for(adapter._client, httpx2.URL(base_url))
    assert pool._max_keepalive_connections == ADAPTER_CAPACITY + 2
    assert pool._keepalive_expiry == 4.0
    connections = adapter._connections
    assert connections._pool is pool
    assert connections._keep == ADAPTER_CAPACITY + 2
    assert connections._expiry_s == 4.0


PROXY_BODY = json.dumps(
    {
        "id": "chatcmpl-proxy",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "via proxy"}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
    }
).encode()
PROXY_MODELS = json.dumps({"object": "list", "data": [{"id": "proxied-model"}]}).encode()


def proxy_answer(seen: Seen) -> Answer:
    body = PROXY_MODELS if seen.method == b"GET" else PROXY_BODY
    return 200, [(b"content-type", b"application/json")], body


async def test_runs_and_probes_go_through_the_environment_proxy(
    upstream: FakeUpstream,
    make_adapter: MakeAdapter,
    monkeypatch: pytest.MonkeyPatch,
    nursery: trio.Nursery,
) -> None:
    """A plain-HTTP forward proxy receives absolute-form requests for the upstream and
    answers them itself; the upstream never hears from the adapter."""
    proxy = RecordingServer(proxy_answer)
    proxy_url = await nursery.start(proxy.serve)
    monkeypatch.setenv("HTTP_PROXY", proxy_url)
    adapter = make_adapter(upstream.base_url)
    runs = [make_run(n=i) for i in range(2)]
    with trio.fail_after(GUARD_S):
        results = [await adapter.execute(run, Collector()) for run, _ in runs]
        status = await adapter.probe()

    for result in results:
        assert result.response == PROXY_BODY
        assert result.usage == Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5)
    assert status.health == "available"
    assert status.models == ["proxied-model"]
    assert upstream.connections_total == 0
    chat_url = f"{upstream.base_url}/chat/completions".encode()
    models_url = f"{upstream.base_url}/models".encode()
    sleep_url = f"{upstream.root_url}/is_sleeping".encode()  # a vllm may have sleep mode
    assert [(s.method, s.target) for s in proxy.seen] == [
        (b"POST", chat_url),
        (b"POST", chat_url),
        (b"GET", models_url),
        (b"GET", sleep_url),
    ]
    host = upstream.root_url.removeprefix("http://").encode()
    for seen in proxy.seen:
        assert seen.values(b"host") == [host]
    assert [s.body for s in proxy.seen[:2]] == [body for _, body in runs]
    # Runs keep one keep-alive connection to the proxy; the probe has the client's.
    assert proxy.connections == 2


async def test_no_proxy_keeps_runs_direct(
    upstream: FakeUpstream,
    make_adapter: MakeAdapter,
    monkeypatch: pytest.MonkeyPatch,
    nursery: trio.Nursery,
) -> None:
    proxy = RecordingServer(proxy_answer)
    proxy_url = await nursery.start(proxy.serve)
    monkeypatch.setenv("HTTP_PROXY", proxy_url)
    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S):
        result = await adapter.execute(make_run()[0], Collector())
    assert result.response == expected_response(MODEL, upstream.chunks)
    assert upstream.requests[-1].path == "/v1/chat/completions"
    assert proxy.seen == []
    assert proxy.connections == 0


# --- content coding ---------------------------------------------------------------------------


def sse_body() -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in [*expected_events(MODEL, 2), b"[DONE]"])


@pytest.mark.parametrize("stream", [False, True])
async def test_encoded_body_is_refused_as_retryable(
    make_adapter: MakeAdapter, nursery: trio.Nursery, stream: bool
) -> None:
    """We ask for identity; an upstream that gzips anyway is refused before any chunk."""
    plain = sse_body() if stream else expected_response(MODEL, 2)
    server = RecordingServer(reply(gzip.compress(plain), stream=stream, encoding=b"gzip"))
    base = await nursery.start(server.serve)
    adapter = make_adapter(base + "/v1")
    collector = Collector()
    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as info:
        await adapter.execute(make_run(stream=stream)[0], collector)
    error = info.value
    assert error.code == "upstream_error"
    assert error.retryable
    assert "gzip" in error.message
    assert collector.chunks == []
    assert server.seen[0].values(b"accept-encoding") == [b"identity"]


async def test_encoded_error_body_is_not_read_as_text(
    make_adapter: MakeAdapter, nursery: trio.Nursery
) -> None:
    """An error status with a gzipped body fails on the status, without garbled bytes."""
    error = b'{"error": {"message": "overloaded"}}'
    headers = [(b"content-type", b"application/json"), (b"content-encoding", b"gzip")]
    server = RecordingServer(lambda _seen: (503, headers, gzip.compress(error)))
    base = await nursery.start(server.serve)
    adapter = make_adapter(base + "/v1")
    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as info:
        await adapter.execute(make_run()[0], Collector())
    assert (info.value.code, info.value.status, info.value.capacity) == ("upstream_busy", 503, True)
    assert info.value.message == "upstream busy (503)"


@pytest.mark.parametrize("coding", [b"identity", b"IDENTITY", b""])
async def test_identity_coding_is_accepted(
    make_adapter: MakeAdapter, nursery: trio.Nursery, coding: bytes
) -> None:
    body = expected_response(MODEL, 2)
    server = RecordingServer(reply(body, encoding=coding))
    base = await nursery.start(server.serve)
    adapter = make_adapter(base + "/v1")
    with trio.fail_after(GUARD_S):
        result = await adapter.execute(make_run()[0], Collector())
    assert result.response == body


# --- the request head -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_run_request_head_is_complete_and_unduplicated(
    make_adapter: MakeAdapter,
    monkeypatch: pytest.MonkeyPatch,
    nursery: trio.Nursery,
    stream: bool,
) -> None:
    """Every header a run needs, each exactly once, the target in origin-form."""
    monkeypatch.setenv(KEY_ENV, KEY_VALUE)
    answer = sse_body() if stream else expected_response(MODEL, 2)
    server = RecordingServer(reply(answer, stream=stream))
    base = await nursery.start(server.serve)
    adapter = make_adapter(base + "/v1", api_key_env=KEY_ENV)
    run, body = make_run(stream=stream)
    with trio.fail_after(GUARD_S):
        await adapter.execute(run, Collector())
    [seen] = server.seen
    assert (seen.method, seen.target) == (b"POST", b"/v1/chat/completions")
    assert seen.body == body
    assert seen.names() == sorted(
        [
            b"host",
            b"connection",
            b"accept-encoding",
            b"content-type",
            b"user-agent",
            b"authorization",
            b"accept",
            b"content-length",
        ]
    )
    assert seen.values(b"host") == [base.removeprefix("http://").encode()]
    assert seen.values(b"content-type") == [b"application/json"]
    assert seen.values(b"content-length") == [b"%d" % len(body)]
    assert seen.values(b"authorization") == [f"Bearer {KEY_VALUE}".encode()]
    assert seen.values(b"accept-encoding") == [b"identity"]
    assert seen.values(b"accept") == [b"text/event-stream" if stream else b"application/json"]


async def test_run_without_api_key_env_sends_no_authorization(
    make_adapter: MakeAdapter, nursery: trio.Nursery
) -> None:
    server = RecordingServer(reply(expected_response(MODEL, 2)))
    base = await nursery.start(server.serve)
    adapter = make_adapter(base + "/v1")
    with trio.fail_after(GUARD_S):
        await adapter.execute(make_run()[0], Collector())
    assert server.seen[0].values(b"authorization") == []
    assert len(server.seen[0].values(b"host")) == 1


@pytest.mark.parametrize(
    ("base_url", "host"),
    [
        ("http://127.0.0.1:8000/v1", b"127.0.0.1:8000"),
        ("https://api.example.com/v1", b"api.example.com"),
        ("https://api.example.com:443/v1", b"api.example.com"),  # default port left out
        ("http://api.example.com:80/v1", b"api.example.com"),
        ("https://api.example.com:8443/v1", b"api.example.com:8443"),
        ("http://API.Example.COM/v1", b"api.example.com"),
        ("http://[::1]:8000/v1", b"[::1]:8000"),
    ],
)
def test_host_header_matches_httpx2(base_url: str, host: bytes) -> None:
    url = httpx2.URL(base_url)
    assert host_header(url) == host
    assert httpx2.Request("POST", url).headers["host"].encode() == host
