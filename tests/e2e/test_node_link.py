"""The runtime wire from the Edge's side: handshake, rejection, replacement, restart."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from trio_websocket import (
    ConnectionClosed,
    open_websocket_url,
)

from iop_edge.core.configuration.config import parse_config
from iop_edge.edge import Edge
from iop_edge.runtime.nodes.hub import PRE_AUTH_MAX_FRAME_BYTES
from iop_node.uplink.backoff import BackoffPolicy
from schemas import wire
from tests.e2e.stack import NODE_TOKEN, Stack, one_sim_config, open_silent_node, start_stack
from tests.timing import GUARD_S


def _text(tmp_path: Path) -> str:
    return one_sim_config(tmp_path)


async def _handshake(url: str, hello: wire.Hello | bytes) -> wire.EdgeToNode:
    async with open_websocket_url(url) as ws:
        await ws.send_message(hello if isinstance(hello, bytes) else wire.encode(hello))
        with trio.fail_after(GUARD_S):
            return wire.decode_from_edge(await ws.get_message())


async def test_bad_token_is_rejected(nursery: trio.Nursery, tmp_path: Path) -> None:
    stack = await start_stack(nursery, _text(tmp_path), tmp_path / "edge.yaml", nodes=())
    reply = await _handshake(
        stack.addresses.node_url,
        wire.Hello(protocol=wire.PROTOCOL_VERSION, node_id="node-1", token="not-the-token"),
    )
    assert isinstance(reply, wire.Reject) and reply.code == "bad_token"
    assert "node-1" not in stack.edge.connected_nodes()


async def test_unknown_node_protocol_and_garbage_are_rejected(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await start_stack(nursery, _text(tmp_path), tmp_path / "edge.yaml", nodes=())
    url = stack.addresses.node_url
    unknown = await _handshake(
        url, wire.Hello(protocol=wire.PROTOCOL_VERSION, node_id="ghost", token=NODE_TOKEN)
    )
    assert isinstance(unknown, wire.Reject) and unknown.code == "unknown_node"
    old = await _handshake(url, wire.Hello(protocol=99, node_id="node-1", token=NODE_TOKEN))
    assert isinstance(old, wire.Reject) and old.code == "unsupported_protocol"
    garbage = await _handshake(url, b"\xc1\xff not msgpack")
    assert isinstance(garbage, wire.Reject) and garbage.code == "bad_frame"


async def test_an_unknown_peers_node_id_cannot_forge_log_lines(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await start_stack(nursery, _text(tmp_path), tmp_path / "edge.yaml", nodes=())
    forged = "ghost\n2026-01-01 00:00:00,000 INFO    iop_edge.main: all is well" + "x" * 500
    reply = await _handshake(
        stack.addresses.node_url,
        wire.Hello(protocol=wire.PROTOCOL_VERSION, node_id=forged, token=NODE_TOKEN),
    )
    assert isinstance(reply, wire.Reject) and reply.code == "unknown_node"
    [line] = [r.getMessage() for r in caplog.records if "not in the Edge config" in r.getMessage()]
    assert "\n" not in line and "\\n" in line and len(line) < 300


async def test_an_anonymous_peer_cannot_send_a_large_message(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Before `hello` checks out, a message over the small pre-auth limit closes the
    connection (1009) instead of being assembled."""
    stack = await start_stack(nursery, _text(tmp_path), tmp_path / "edge.yaml", nodes=())
    async with open_websocket_url(stack.addresses.node_url) as ws:
        await ws.send_message(b"\x00" * (PRE_AUTH_MAX_FRAME_BYTES + 1))
        with trio.fail_after(GUARD_S), pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
    assert closed.value.reason is not None and closed.value.reason.code == 1009


async def test_an_authenticated_node_sends_large_messages(stack_one: Stack) -> None:
    """After the handshake the limit is the wire's: a response far over the pre-auth limit
    (8 embeddings of 4096 dimensions, ~0.6 MB) travels Node -> Edge."""
    async with stack_one.client() as client:
        with trio.fail_after(10):
            response = await client.embeddings.create(
                model="m", input=[f"text {i}" for i in range(8)], dimensions=4096
            )
    assert [len(item.embedding) for item in response.data] == [4096] * 8


async def test_good_handshake_gets_welcome_with_own_providers(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await start_stack(nursery, _text(tmp_path), tmp_path / "edge.yaml", nodes=())
    reply = await _handshake(
        stack.addresses.node_url,
        wire.Hello(protocol=wire.PROTOCOL_VERSION, node_id="node-1", token=NODE_TOKEN),
    )
    assert isinstance(reply, wire.Welcome)
    assert reply.revision == 1
    assert [p.id for p in reply.node_config.providers] == ["sim-1"]


async def test_a_duplicate_node_id_is_named_on_both_sides(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second connection with a connected node's id replaces the session; the Edge logs
    both peers, the replaced Node hears `node_replaced` (and, being a real Node, says so
    and takes the id back after its reject delay), then the intruder is replaced in turn."""
    fast = BackoffPolicy(base_s=0.01, cap_s=0.05, reject_delay_s=0.05)
    stack = await start_stack(
        nursery,
        _text(tmp_path),
        tmp_path / "edge.yaml",
        wait_models=("m",),
        node_kwargs={"backoff": fast},
    )
    hello = wire.Hello(protocol=wire.PROTOCOL_VERSION, node_id="node-1", token=NODE_TOKEN)
    async with open_websocket_url(stack.addresses.node_url) as intruder:
        await intruder.send_message(wire.encode(hello))
        with trio.fail_after(GUARD_S):
            assert isinstance(wire.decode_from_edge(await intruder.get_message()), wire.Welcome)
            while True:  # the real Node comes back and replaces the intruder
                message = wire.decode_from_edge(await intruder.get_message())
                if isinstance(message, wire.Reject):
                    break
    assert message.code == wire.NODE_REPLACED
    assert "a new connection for node id 'node-1' from 127.0.0.1:" in message.reason
    assert "second Node running with the same id" in message.reason
    await stack.wait_servable("m")
    edge_lines = [r.getMessage() for r in caplog.records if r.name == "iop_edge.runtime.nodes.hub"]
    assert any(
        "node node-1 connected again from 127.0.0.1:" in line
        and "two Nodes share the node id node-1" in line
        for line in edge_lines
    ), edge_lines
    node_lines = [r.getMessage() for r in caplog.records if r.name == "iop_node.uplink.link"]
    assert any("edge ended the session: a new connection" in line for line in node_lines)
    assert all("Endpoint(" not in line for line in edge_lines)


async def test_second_connection_replaces_the_first(nursery: trio.Nursery, tmp_path: Path) -> None:
    stack_one = await start_stack(
        nursery,
        _text(tmp_path),
        tmp_path / "edge.yaml",
        wait_models=("m",),
        node_kwargs={"backoff": BackoffPolicy(base_s=0.01, cap_s=0.05, reject_delay_s=0.05)},
    )
    async with open_websocket_url(stack_one.addresses.node_url) as ws:
        await ws.send_message(
            wire.encode(
                wire.Hello(protocol=wire.PROTOCOL_VERSION, node_id="node-1", token=NODE_TOKEN)
            )
        )
        with trio.fail_after(GUARD_S):
            assert isinstance(wire.decode_from_edge(await ws.get_message()), wire.Welcome)
        session = stack_one.edge.hub.session("node-1")
        assert session is not None and session.websocket.remote is not None
    # The in-process node reconnects and takes the id back; requests still work.
    await stack_one.wait_servable("m")
    async with stack_one.client() as client:
        reply = await client.chat.completions.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    assert reply.model == "m"


async def test_node_reconnects_after_edge_restart(nursery: trio.Nursery, tmp_path: Path) -> None:
    text = _text(tmp_path)
    first = Edge(parse_config(text))
    async with trio.open_nursery() as edge_nursery:
        addresses = await edge_nursery.start(first.serve)
        port = int(addresses.node_url.rsplit(":", 1)[1])
        stack = Stack(
            edge=first, addresses=addresses, nursery=nursery, config_path=tmp_path / "e.yaml"
        )
        await stack.start_node("node-1", backoff=BackoffPolicy(base_s=0.01, cap_s=0.05))
        await stack.wait_servable("m")
        edge_nursery.cancel_scope.cancel()  # the Edge goes away abruptly

    restarted_text = text.replace(
        "listen: 127.0.0.1:0\n  state_dir", f"listen: 127.0.0.1:{port}\n  state_dir", 1
    )
    assert f"127.0.0.1:{port}" in restarted_text
    second = Edge(parse_config(restarted_text))
    addresses2 = await nursery.start(second.serve)
    stack2 = Stack(
        edge=second, addresses=addresses2, nursery=nursery, config_path=tmp_path / "e.yaml"
    )
    await stack2.wait_servable("m")
    async with stack2.client() as client:
        reply = await client.chat.completions.create(
            model="m", max_tokens=3, messages=[{"role": "user", "content": "again"}]
        )
    assert reply.model == "m" and reply.usage is not None and reply.usage.completion_tokens == 3


async def test_silent_node_is_dropped_by_heartbeat(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A peer that completes the handshake and then never answers a ping is dropped."""
    stack = await start_stack(
        nursery,
        _text(tmp_path),
        tmp_path / "edge.yaml",
        nodes=(),
        edge_kwargs={"heartbeat_s": 0.05, "heartbeat_timeout_s": 0.2},
    )
    stream = await open_silent_node(stack)
    with trio.fail_after(GUARD_S):
        while "node-1" not in stack.edge.connected_nodes():
            await stack.edge.wait_pool_change()
        # From here on we never read, so the Edge's pings go unanswered.
        while "node-1" in stack.edge.connected_nodes():
            await stack.edge.wait_pool_change()
    catalog = await stack.catalog()
    assert catalog["providers"][0]["connected"] is False
    await stream.aclose()
