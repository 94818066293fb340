"""A runtime served over HTTPS (`iop_node.tls`): every adapter's client verifies it
through one context, made once per trust store, as httpx2 makes its default: a
runtime whose certificate a CA in `SSL_CERT_FILE` signed is served, one signed by another
CA is refused; building adapters loads the trust store once, however many there are."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx2
import pytest
import trio
import trustme

from tests.timing import GUARD_S
from tests.tls_contexts import record_contexts

from .conftest import MakeAdapter
from .fake_upstream import FakeUpstream
from .test_openai_compat import Collector, expect_failure, make_run


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[ssl.SSLContext]:
    """The client contexts httpx2 makes from now on."""
    return record_contexts(monkeypatch, httpx2, "create_ssl_context")


@pytest.fixture
def trusted_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> trustme.CA:
    """A CA this process trusts through `SSL_CERT_FILE`, as an operator's private CA (a
    trust store of its own: the shared context is made afresh for it)."""
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    return ca


async def _https_upstream(nursery: trio.Nursery, ca: trustme.CA) -> FakeUpstream:
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    upstream = FakeUpstream(tls=server)
    await nursery.start(upstream.serve)
    assert upstream.base_url.startswith("https://127.0.0.1:")
    return upstream


async def test_every_adapter_serves_an_https_runtime_through_one_context(
    nursery: trio.Nursery,
    make_adapter: MakeAdapter,
    made: list[ssl.SSLContext],
    trusted_ca: trustme.CA,
) -> None:
    upstream = await _https_upstream(nursery, trusted_ca)
    adapters = [make_adapter(upstream.base_url) for _ in range(3)]
    assert len(made) == 1  # one trust store load for all
    for adapter in adapters:
        with trio.fail_after(GUARD_S):
            result = await adapter.execute(make_run()[0], Collector())
        assert result.usage is not None


async def test_a_runtime_whose_certificate_no_trusted_ca_signed_is_refused(
    nursery: trio.Nursery, make_adapter: MakeAdapter, trusted_ca: trustme.CA
) -> None:
    upstream = await _https_upstream(nursery, trustme.CA())  # a CA nobody trusts
    error = await expect_failure(make_adapter(upstream.base_url), make_run()[0])
    assert (error.code, error.retryable) == ("upstream_unreachable", True)
    assert error.message.endswith(
        "unreachable: cannot connect: TLS certificate not trusted: unable to get local issuer "
        "certificate"
    ), error.message
