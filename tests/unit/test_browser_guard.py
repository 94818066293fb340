"""The rules of `iop_edge.http.browser_guard`, one case each."""

from __future__ import annotations

import pytest

from iop_edge.http.browser_guard import browser_refusal


@pytest.mark.parametrize(
    ("host", "origin", "listener_host"),
    [
        ("127.0.0.1:8080", None, "127.0.0.1"),  # a program: no Origin
        ("127.0.0.1:8080", "http://127.0.0.1:8080", "127.0.0.1"),  # the API's own origin
        ("localhost:8080", "https://localhost:8080", "127.0.0.1"),  # behind TLS
        ("[::1]:8080", "http://[::1]:8080", "::1"),
        ("gpu-box:8080", None, "0.0.0.0"),  # other machines reach it by names unknown here
        ("gpu-box:8080", "http://gpu-box:8080", "10.0.0.5"),
        (None, None, "127.0.0.1"),  # HTTP/1.0 without Host: no browser
        ("evil.example", None, None),  # a listener of no address (a socket file)
    ],
)
def test_what_is_served(host: str | None, origin: str | None, listener_host: str | None) -> None:
    assert browser_refusal(host=host, origin=origin, listener_host=listener_host) is None


@pytest.mark.parametrize(
    ("host", "origin", "listener_host", "code"),
    [
        # Rule 1: another origin, a sandboxed page's "null", another port of this host.
        ("127.0.0.1:8080", "http://evil.example", "127.0.0.1", "cross_origin"),
        ("127.0.0.1:8080", "null", "127.0.0.1", "cross_origin"),
        ("127.0.0.1:8080", "http://127.0.0.1:3000", "127.0.0.1", "cross_origin"),
        ("gpu-box:8080", "http://evil.example", "0.0.0.0", "cross_origin"),
        # Rule 2: a name rebound to a loopback listener, its own origin or none.
        ("evil.example:8080", "http://evil.example:8080", "127.0.0.1", "untrusted_host"),
        ("localhost.evil.example:8080", None, "::1", "untrusted_host"),
    ],
)
def test_what_is_refused(host: str, origin: str | None, listener_host: str, code: str) -> None:
    refused = browser_refusal(host=host, origin=origin, listener_host=listener_host)
    assert refused is not None
    assert (refused.status, refused.type, refused.code) == (403, "permission_error", code)
