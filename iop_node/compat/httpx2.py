"""httpx2: the httpcore2 connection pool an `AsyncClient` sends a URL's requests through.

The OpenAI-compatible adapter sends its runs as prepared `httpcore2.Request`s straight into
a connection pool, skipping httpx2's per-request layer (see that adapter's docstring).
The pool must be the very one its `httpx2.AsyncClient` uses for the same URL, not a second
one built alongside: then runs and health probes share one set of keep-alive connections,
and every connection setting (limits, keep-alive expiry, TLS verification, the proxy the
environment asks for) is the client's, decided in one place.

httpx2 has no public way to ask a client which pool serves a URL, so `connection_pool_for`
uses two private names:

- `AsyncClient._transport_for_url(url)`: httpx2's own routing of a URL over the client's
  mounts: the proxy transport it mounted for HTTP_PROXY / HTTPS_PROXY / ALL_PROXY, unless
  NO_PROXY exempts the host, else its default transport. Re-implementing that routing (the
  NO_PROXY rules above all) would let runs and probes take different ways.
- `AsyncHTTPTransport._pool`: the httpcore2 pool behind a transport, an
  `AsyncConnectionPool` or one of its proxy subclasses (`AsyncHTTPProxy`,
  `AsyncSOCKSProxy`).

Both exist with these meanings in httpx2 and httpcore2 2.16 (`tests/compat/test_httpx2.py`
proves it on the installed versions; `pyproject.toml` allows no other minor version).
Where they are missing, `connection_pool_for` raises `UnsupportedHttpx2`, naming the
installed versions, so an adapter fails to build with that message.
"""

from __future__ import annotations

from importlib.metadata import version

import httpcore2
import httpx2

__all__ = ["KNOWN_VERSIONS", "UnsupportedHttpx2", "connection_pool_for"]

#: The httpx2 / httpcore2 releases whose private names this module is known to work with.
KNOWN_VERSIONS = "2.16"


class UnsupportedHttpx2(RuntimeError):
    """The installed httpx2/httpcore2 lacks a private name `connection_pool_for` uses."""

    def __init__(self, missing: str) -> None:
        super().__init__(
            f"httpx2 {version('httpx2')} / httpcore2 {version('httpcore2')} is not supported: "
            f"{missing}; IOP's OpenAI-compatible adapters need httpx2 and httpcore2 "
            f"{KNOWN_VERSIONS}.x (see iop_node/compat/httpx2.py)"
        )


def connection_pool_for(
    client: httpx2.AsyncClient, url: httpx2.URL
) -> httpcore2.AsyncConnectionPool:
    """The httpcore2 pool `client` sends requests for `url` through: its own pool, or the
    proxy pool it mounted for the environment's proxy settings (NO_PROXY honoured)."""
    route = getattr(client, "_transport_for_url", None)
    if not callable(route):
        raise UnsupportedHttpx2("AsyncClient has no _transport_for_url()")
    transport = route(url)
    pool = getattr(transport, "_pool", None)
    if not isinstance(pool, httpcore2.AsyncConnectionPool):
        raise UnsupportedHttpx2(
            f"the client's {type(transport).__name__} has no httpcore2 pool in _pool"
        )
    return pool
