"""iop_node.compat.httpx2 on the installed httpx2/httpcore2: the pool a client routes a URL
to, for every proxy setting, is the very pool the client sends that URL's requests through.

The routing table needs no connection (nothing listens on the proxy address); the wire
tests send one request through the pool and one through the client to `RecordingServer`s
and see both arrive on one connection, through the proxy when the environment says so.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from importlib.metadata import version

import httpcore2
import httpx2
import pytest
import trio

from iop_node.compat.httpx2 import KNOWN_VERSIONS, UnsupportedHttpx2, connection_pool_for
from tests.timing import GUARD_S

from ..recording_server import Answer, RecordingServer, Seen, clear_proxy_env

#: Nothing listens there (the discard port); the routing table never connects.
UNUSED_PROXY = "http://127.0.0.1:9"
HTTP_UPSTREAM = "http://127.0.0.1:8000/v1"
HTTPS_UPSTREAM = "https://api.example.com/v1"


@pytest.fixture(autouse=True)
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_proxy_env(monkeypatch)


@pytest.fixture
async def clients() -> AsyncIterator[list[httpx2.AsyncClient]]:
    """Clients a test makes (after setting its environment); closed at teardown."""
    made: list[httpx2.AsyncClient] = []
    yield made
    for client in made:
        await client.aclose()


def make_client(clients: list[httpx2.AsyncClient]) -> httpx2.AsyncClient:
    client = httpx2.AsyncClient(
        limits=httpx2.Limits(max_keepalive_connections=6, keepalive_expiry=4.0)
    )
    clients.append(client)
    return client


def test_the_installed_versions_are_the_known_ones() -> None:
    assert version("httpx2").startswith(f"{KNOWN_VERSIONS}.")
    assert version("httpcore2").startswith(f"{KNOWN_VERSIONS}.")


# --- routing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "base_url", "proxied"),
    [
        pytest.param({}, HTTP_UPSTREAM, False, id="no-env-http"),
        pytest.param({}, HTTPS_UPSTREAM, False, id="no-env-https"),
        pytest.param({"HTTP_PROXY": UNUSED_PROXY}, HTTP_UPSTREAM, True, id="http-proxy"),
        pytest.param({"HTTPS_PROXY": UNUSED_PROXY}, HTTPS_UPSTREAM, True, id="https-proxy"),
        pytest.param({"https_proxy": UNUSED_PROXY}, HTTPS_UPSTREAM, True, id="lowercase"),
        pytest.param({"ALL_PROXY": UNUSED_PROXY}, HTTP_UPSTREAM, True, id="all-proxy"),
        # A proxy for the other scheme does not apply.
        pytest.param({"HTTPS_PROXY": UNUSED_PROXY}, HTTP_UPSTREAM, False, id="https-proxy-http"),
        pytest.param({"HTTP_PROXY": UNUSED_PROXY}, HTTPS_UPSTREAM, False, id="http-proxy-https"),
        # NO_PROXY: an IP, a domain suffix, a wildcard; a non-matching entry changes nothing.
        pytest.param(
            {"HTTP_PROXY": UNUSED_PROXY, "NO_PROXY": "127.0.0.1"},
            HTTP_UPSTREAM,
            False,
            id="no-proxy-ip",
        ),
        pytest.param(
            {"HTTPS_PROXY": UNUSED_PROXY, "NO_PROXY": "example.com"},
            HTTPS_UPSTREAM,
            False,
            id="no-proxy-domain",
        ),
        pytest.param(
            {"ALL_PROXY": UNUSED_PROXY, "NO_PROXY": "*"}, HTTPS_UPSTREAM, False, id="no-proxy-*"
        ),
        pytest.param(
            {"HTTPS_PROXY": UNUSED_PROXY, "NO_PROXY": "other.example"},
            HTTPS_UPSTREAM,
            True,
            id="no-proxy-other",
        ),
    ],
)
async def test_pool_follows_httpx2_proxy_routing(
    clients: list[httpx2.AsyncClient],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    base_url: str,
    proxied: bool,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    client = make_client(clients)
    url = httpx2.URL(base_url)
    pool = connection_pool_for(client, url)
    assert connection_pool_for(client, url) is pool  # the client's, not a new one per call
    if proxied:
        assert isinstance(pool, httpcore2.AsyncHTTPProxy)
        assert pool._proxy_url == httpcore2.URL(UNUSED_PROXY)
    else:
        assert type(pool) is httpcore2.AsyncConnectionPool
    # Either way the pool carries the client's limits.
    assert pool._max_keepalive_connections == 6
    assert pool._keepalive_expiry == 4.0


# --- on the wire: the pool is the one the client sends through -------------------------------


def ok(_seen: Seen) -> Answer:
    return 200, [(b"content-type", b"application/json")], b"{}"


async def pool_then_client(client: httpx2.AsyncClient, url: str) -> None:
    """One request straight into the routed pool, then one through the client."""
    target = httpx2.URL(url)
    pool = connection_pool_for(client, target)
    request = httpcore2.Request(
        b"GET",
        httpcore2.URL(
            scheme=target.raw_scheme, host=target.raw_host, port=target.port, target=target.raw_path
        ),
        headers=[(b"Host", target.netloc)],
    )
    with trio.fail_after(GUARD_S):
        response = await pool.handle_async_request(request)
        try:
            await response.aread()
        finally:
            await response.aclose()
        assert response.status == 200
        assert (await client.get(url)).status_code == 200


async def test_direct_pool_shares_its_connection_with_the_client(
    clients: list[httpx2.AsyncClient], nursery: trio.Nursery
) -> None:
    upstream = RecordingServer(ok)
    base = await nursery.start(upstream.serve)
    await pool_then_client(make_client(clients), f"{base}/v1/models")
    assert [(s.method, s.target) for s in upstream.seen] == [(b"GET", b"/v1/models")] * 2
    assert upstream.connections == 1


async def test_proxy_pool_is_the_one_the_client_mounted_for_the_environment(
    clients: list[httpx2.AsyncClient], monkeypatch: pytest.MonkeyPatch, nursery: trio.Nursery
) -> None:
    """HTTP_PROXY applies: both requests reach the proxy, in absolute form, on one
    connection; the upstream (a name nobody resolves) is never dialled."""
    proxy = RecordingServer(ok)
    monkeypatch.setenv("HTTP_PROXY", await nursery.start(proxy.serve))
    url = "http://upstream.invalid:8000/v1/models"
    await pool_then_client(make_client(clients), url)
    assert [(s.method, s.target) for s in proxy.seen] == [(b"GET", url.encode())] * 2
    assert proxy.connections == 1


async def test_no_proxy_keeps_the_pool_direct(
    clients: list[httpx2.AsyncClient], monkeypatch: pytest.MonkeyPatch, nursery: trio.Nursery
) -> None:
    proxy, upstream = RecordingServer(ok), RecordingServer(ok)
    monkeypatch.setenv("HTTP_PROXY", await nursery.start(proxy.serve))
    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
    base = await nursery.start(upstream.serve)
    await pool_then_client(make_client(clients), f"{base}/v1/models")
    assert [s.target for s in upstream.seen] == [b"/v1/models"] * 2
    assert upstream.connections == 1
    assert (proxy.seen, proxy.connections) == ([], 0)


# --- when the capability is missing -----------------------------------------------------------


async def test_a_transport_without_a_pool_is_reported_with_the_versions(
    clients: list[httpx2.AsyncClient],
) -> None:
    client = httpx2.AsyncClient(transport=httpx2.MockTransport(lambda _: httpx2.Response(200)))
    clients.append(client)
    with pytest.raises(UnsupportedHttpx2) as info:
        connection_pool_for(client, httpx2.URL(HTTP_UPSTREAM))
    message = str(info.value)
    assert "MockTransport has no httpcore2 pool in _pool" in message
    assert f"httpx2 {version('httpx2')} / httpcore2 {version('httpcore2')}" in message
    assert f"need httpx2 and httpcore2 {KNOWN_VERSIONS}.x" in message


def test_a_client_without_routing_is_reported_with_the_versions() -> None:
    class Reorganised:  # what a release that renamed `_transport_for_url` would look like
        pass

    with pytest.raises(UnsupportedHttpx2, match=r"AsyncClient has no _transport_for_url\(\)"):
        connection_pool_for(Reorganised(), httpx2.URL(HTTP_UPSTREAM))  # type: ignore[arg-type]
