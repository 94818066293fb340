"""The TLS client contexts a Node shares: one for its upstream HTTP clients, one for its
links to the Edges, each made once per trust-store setting.

Building a context loads a trust store (the environment's `SSL_CERT_FILE` /
`SSL_CERT_DIR`, else the system's CAs): 30-40 ms of CPU on the event loop. An adapter's
client built its own, even for a plain-HTTP runtime, so a refresh that rebuilt a Node's
providers held its loop that long for each of them while its runs streamed; and a link
built one at every dial, as it reconnected to a restarted Edge while its other links
streamed. A context is safe to share, and every connection verifies exactly as with its
own.

They are two, not one: httpcore2 sets the ALPN protocols of the context its connections
use, which a websocket's TLS must not offer. Each is keyed by the two variables, so a
process that changes them (a test does) gets a context that trusts what they name.
"""

from __future__ import annotations

import functools
import os
import ssl
from typing import Literal

import httpx2

__all__ = ["edge_tls_context", "upstream_tls_context"]

_Use = Literal["upstream", "edge"]


def upstream_tls_context() -> ssl.SSLContext:
    """The upstream HTTP clients' context, made as httpx2 makes its default."""
    return _context("upstream", os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


def edge_tls_context() -> ssl.SSLContext:
    """The context of a link's dial over TLS (`uplink.dial`): Python's default."""
    return _context("edge", os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.lru_cache(maxsize=8)
def _context(use: _Use, cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    """A context for `use` under one trust-store setting (the key: the context reads the
    variables itself)."""
    return httpx2.create_ssl_context() if use == "upstream" else ssl.create_default_context()
