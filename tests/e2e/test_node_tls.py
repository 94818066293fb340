"""Nodes linked to an Edge over TLS (`wss://`, `edge.tls`): by the Edge's URL, and by a DNS
name whose addresses the Node dials one by one (the name still goes in SNI, in `Host` and
into the certificate check). The certificates come from a throwaway CA (trustme) that the
Nodes trust through `SSL_CERT_FILE`, as an operator's private CA would be."""

from __future__ import annotations

import ssl
from functools import partial
from pathlib import Path

import pytest
import trio
import trustme
from trio_websocket import ConnectionClosed, HandshakeError

from iop_node.main import run_node
from iop_node.tls import edge_tls_context
from iop_node.uplink.dial import open_edge_websocket
from tests.e2e.stack import NODE_TOKEN, Stack, one_sim_config, start_stack
from tests.node.test_dial import LIMITS  # the same small bounds as the dial tests
from tests.timing import GUARD_S
from tests.tls_contexts import record_contexts

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def edge_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The Edge's `tls` section: a certificate for `localhost` and 127.0.0.1, from a CA
    this process trusts."""
    ca = trustme.CA()
    certificate = ca.issue_cert("localhost", "127.0.0.1")
    cert_file, key_file, ca_file = (tmp_path / name for name in ("edge.pem", "edge.key", "ca.pem"))
    for pem in certificate.cert_chain_pems:
        pem.write_to_path(str(cert_file), append=True)
    certificate.private_key_pem.write_to_path(str(key_file))
    ca.cert_pem.write_to_path(str(ca_file))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    return {"cert_file": str(cert_file), "key_file": str(key_file)}


async def _start(nursery: trio.Nursery, tmp_path: Path, tls: dict[str, str]) -> Stack:
    text = one_sim_config(tmp_path / "state", edge_section={"tls": tls})
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", nodes=())
    assert stack.addresses.node_url.startswith("wss://127.0.0.1:")
    return stack


async def _answered(stack: Stack) -> str | None:
    async with stack.client() as client:
        completion = await client.chat.completions.create(model="m", messages=MESSAGES)
    return completion.choices[0].message.content


async def test_a_node_links_by_the_edges_wss_url(
    nursery: trio.Nursery, tmp_path: Path, edge_tls: dict[str, str]
) -> None:
    stack = await _start(nursery, tmp_path, edge_tls)
    await stack.start_node()
    await stack.wait_servable("m")
    assert await _answered(stack)


async def test_a_node_links_to_each_address_of_a_wss_name(
    nursery: trio.Nursery, tmp_path: Path, edge_tls: dict[str, str]
) -> None:
    stack = await _start(nursery, tmp_path, edge_tls)
    port = stack.addresses.node_url.rsplit(":", 1)[1]

    async def only_ipv4(host: str, port: int) -> list[str]:
        assert host == "localhost"
        return ["127.0.0.1"]

    node = partial(
        run_node, (), "node-1", NODE_TOKEN, edge_dns=[f"wss://localhost:{port}"], resolver=only_ipv4
    )
    nursery.start_soon(node)
    await stack.wait_servable("m")
    assert await _answered(stack)


@pytest.mark.parametrize("by_address", [False, True], ids=["by-url", "by-address"])
async def test_a_certificate_the_node_does_not_trust_fails_the_dial_saying_so(
    nursery: trio.Nursery,
    tmp_path: Path,
    edge_tls: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    by_address: bool,
) -> None:
    """At once (not at the handshake timeout), as a `HandshakeError` caused by the TLS
    error: the link's log line quotes the cause."""
    stack = await _start(nursery, tmp_path, edge_tls)
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "no-such-ca.pem"))
    address = "127.0.0.1" if by_address else None
    # At once: well within the guard, itself far below the dial's limit (100 s).
    with trio.fail_after(GUARD_S), pytest.raises(HandshakeError) as raised:
        async with open_edge_websocket(stack.addresses.node_url, address, **LIMITS):
            pass
    cause = raised.value.__cause__
    assert isinstance(cause, ssl.SSLCertVerificationError)
    assert "certificate verify failed" in str(cause)


async def test_an_edge_that_goes_away_ends_the_session_with_connection_closed(
    nursery: trio.Nursery, tmp_path: Path, edge_tls: dict[str, str]
) -> None:
    """Not an exception group: the link reads why a session ended from this."""
    stack = await _start(nursery, tmp_path, edge_tls)
    with pytest.raises(ConnectionClosed):
        async with open_edge_websocket(stack.addresses.node_url, "127.0.0.1", **LIMITS) as ws:
            await ws.send_message(b"not a hello")
            while True:
                await ws.get_message()  # the Edge's reject, then its close


async def test_dials_share_one_tls_context_per_trust_store(
    nursery: trio.Nursery,
    tmp_path: Path,
    edge_tls: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Building a context loads the trust store on the Node's event loop: every dial
    under one `SSL_CERT_FILE` / `SSL_CERT_DIR` uses the same context, and another setting
    gets its own (which trusts what it names)."""
    stack = await _start(nursery, tmp_path, edge_tls)
    made = record_contexts(monkeypatch, ssl, "create_default_context")
    for address in (None, "127.0.0.1", None):
        with trio.fail_after(GUARD_S):
            async with open_edge_websocket(stack.addresses.node_url, address, **LIMITS):
                pass
    assert len(made) == 1 and edge_tls_context() is made[0]
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "no-such-ca.pem"))
    with trio.fail_after(GUARD_S), pytest.raises(HandshakeError):
        async with open_edge_websocket(stack.addresses.node_url, None, **LIMITS):
            pass
    assert len(made) == 2
