"""The TLS client context every upstream HTTP client of a Node shares.

Building a context loads a trust store (httpx2's default: the environment's
`SSL_CERT_FILE` / `SSL_CERT_DIR`, else the system's CAs), about 30 ms of CPU, on the event
loop when an adapter is built. Each adapter's client built its own, even for a plain-HTTP
runtime, so a refresh that rebuilt a Node's providers held its loop that long for each of
them while its runs streamed. One context, made as httpx2 makes its default for the first
adapter, serves them all: a context is safe to share, and every client verifies exactly
as with its own.
"""

from __future__ import annotations

import functools
import ssl

import httpx2

__all__ = ["upstream_tls_context"]


@functools.cache
def upstream_tls_context() -> ssl.SSLContext:
    """httpx2's default client context, made once per process."""
    return httpx2.create_ssl_context()
