"""The rules of `iop_edge.http.browser_guard`, one case each."""

from __future__ import annotations

import pytest

from iop_edge.http.browser_guard import browser_refusal


@pytest.mark.parametrize(
    ("host", "origin", "listen"),
    [
        ("127.0.0.1:8080", None, "127.0.0.1:8080"),  # a program: no Origin
        ("127.0.0.1:8080", "http://127.0.0.1:8080", "127.0.0.1:8080"),  # the API's own origin
        ("localhost:8080", "https://localhost:8080", "localhost:8080"),  # behind TLS
        ("[::1]:8080", "http://[::1]:8080", "[::1]:8080"),
        # Other machines reach a wildcard or another address by names unknown here: a
        # connection over loopback (a proxy on this machine that keeps the caller's Host,
        # the machine's own name on 127.0.1.1) is not judged by its Host.
        ("gpu-box:8080", None, "0.0.0.0:8080"),
        ("gpu-box:8080", "http://gpu-box:8080", "[::]:8080"),
        ("gpu-box:8080", "http://gpu-box:8080", "10.0.0.5:8080"),
        (None, None, "127.0.0.1:8080"),  # HTTP/1.0 without Host: no browser
    ],
)
def test_what_is_served(host: str | None, origin: str | None, listen: str) -> None:
    assert browser_refusal(host=host, origin=origin, listen=listen) is None


@pytest.mark.parametrize(
    ("host", "origin", "listen", "code"),
    [
        # Rule 1: another origin, a sandboxed page's "null", another port of this host.
        ("127.0.0.1:8080", "http://evil.example", "127.0.0.1:8080", "cross_origin"),
        ("127.0.0.1:8080", "null", "127.0.0.1:8080", "cross_origin"),
        ("127.0.0.1:8080", "http://127.0.0.1:3000", "127.0.0.1:8080", "cross_origin"),
        ("gpu-box:8080", "http://evil.example", "0.0.0.0:8080", "cross_origin"),
        # Rule 2: a name rebound to a loopback listener, its own origin or none.
        ("evil.example:8080", "http://evil.example:8080", "127.0.0.1:8080", "untrusted_host"),
        ("localhost.evil.example:8080", None, "[::1]:8080", "untrusted_host"),
        ("evil.example:8080", None, "localhost:8080", "untrusted_host"),
    ],
)
def test_what_is_refused(host: str, origin: str | None, listen: str, code: str) -> None:
    refused = browser_refusal(host=host, origin=origin, listen=listen)
    assert refused is not None
    assert (refused.status, refused.type, refused.code) == (403, "permission_error", code)
