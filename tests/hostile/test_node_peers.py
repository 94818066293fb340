"""Hostile peers on the node listener: idle upgrades, slow hellos, frames built to crash.

None of them may lock a Node out, hold anything for long, or end the listener."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from iop_edge.runtime.nodes.handshakes import (
    MAX_PENDING_HANDSHAKES,
    MAX_PENDING_HANDSHAKES_PER_SOURCE,
)
from schemas import wire
from tests.e2e.stack import NODE_TOKEN, Stack, one_sim_config, start_stack
from tests.hostile.peers import RawPeer, open_raw_peer
from tests.timing import GUARD_S


async def _stack(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    text = one_sim_config(tmp_path)
    return await start_stack(nursery, text, tmp_path / "edge.yaml", nodes=())


async def test_idle_upgrades_from_many_sources_never_lock_a_node_out(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path)
    url = stack.addresses.node_url
    sources = MAX_PENDING_HANDSHAKES // MAX_PENDING_HANDSHAKES_PER_SOURCE + 4
    holders: list[RawPeer] = []
    with trio.fail_after(GUARD_S):
        for index in range(sources):  # more idle upgrades than the whole table holds
            for _ in range(MAX_PENDING_HANDSHAKES_PER_SOURCE):
                holders.append(await open_raw_peer(url, source=f"127.0.1.{index + 1}"))
    stats = stack.edge.hub.handshakes.statistics()
    assert stats.pending == MAX_PENDING_HANDSHAKES
    assert stats.evicted == len(holders) - MAX_PENDING_HANDSHAKES
    # A real Node, arriving while every slot is held, gets in (an idle holder makes room).
    await stack.start_node()
    await stack.wait_servable("m")
    for holder in holders:
        await holder.aclose()


async def test_one_source_holds_at_most_its_share(nursery: trio.Nursery, tmp_path: Path) -> None:
    stack = await _stack(nursery, tmp_path)
    url = stack.addresses.node_url
    with trio.fail_after(GUARD_S):
        holders = [await open_raw_peer(url, source="127.0.2.1") for _ in range(10)]
        stats = stack.edge.hub.handshakes.statistics()
        assert stats.pending == MAX_PENDING_HANDSHAKES_PER_SOURCE and stats.sources == 1
        # The evicted ones were closed by the Edge, oldest first.
        for holder in holders[: 10 - MAX_PENDING_HANDSHAKES_PER_SOURCE]:
            await holder.wait_closed()
    for holder in holders:
        await holder.aclose()


async def test_a_silent_peer_is_dropped_at_the_handshake_deadline(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path)
    stack.edge.hub.handshake_timeout_s = 0.05
    peer = await open_raw_peer(stack.addresses.node_url)
    with trio.fail_after(GUARD_S):
        reply = await peer.next_message()
        await peer.wait_closed()
    assert isinstance(reply, wire.Reject) and reply.code == "handshake_timeout"
    await trio.testing.wait_all_tasks_blocked()
    assert stack.edge.hub.handshakes.statistics().pending == 0
    await peer.aclose()


async def test_frames_built_to_crash_the_decoder_are_rejected(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A `hello` whose unknown field nests deeper than the decoder's stack (it fits in
    the anonymous message limit) is a bad frame, not a crash of the listener."""
    stack = await _stack(nursery, tmp_path)
    nested = b"\x91" * 50_000 + b"\xc0"  # 50,000 msgpack arrays of one element
    hello = wire.encode(
        wire.Hello(protocol=wire.PROTOCOL_VERSION, node_id="node-1", token=NODE_TOKEN)
    )
    # Append one more key to the hello map (fixmap header 0x8N -> 0x8N+1).
    frame = bytes([hello[0] + 1]) + hello[1:] + b"\xa5extra" + nested
    for attack in (frame, nested, b"\xdd\xff\xff\xff\xff", b"\xc1" * 100):
        peer = await open_raw_peer(stack.addresses.node_url)
        await peer.send(attack)
        with trio.fail_after(GUARD_S):
            reply = await peer.next_message()
            await peer.wait_closed()
        assert isinstance(reply, wire.Reject) and reply.code == "bad_frame", attack[:8]
        await peer.aclose()
    await stack.start_node()  # the listener still serves
    await stack.wait_servable("m")


async def test_a_ping_answering_the_edges_close_ends_only_that_connection(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The Edge closes a peer (here: a bad `hello`) and the peer pings instead of closing
    too. trio-websocket 0.12 answers that ping with a pong wsproto refuses to send on a
    closing connection, and raises out of the connection's reader (trio-websocket issue
    #184): that must end this one connection, never the listener, an open session or the
    Edge."""
    stack = await _stack(nursery, tmp_path)
    await stack.start_node()
    await stack.wait_servable("m")
    peer = await open_raw_peer(stack.addresses.node_url)
    await peer.send(b"\xc1 not a hello")
    with trio.fail_after(GUARD_S):
        reply = await peer.next_message(answer_close=False)
        assert isinstance(reply, wire.Reject) and reply.code == "bad_frame"
        assert await peer.next_message(answer_close=False) is None  # the Edge's Close
        # A ping frame by hand (wsproto would not send one now): FIN + opcode 9,
        # masked (as from a client) with a zero key, so the payload reads as is.
        payload = b"still there?"
        await peer.stream.send_all(bytes([0x89, 0x80 | len(payload)]) + bytes(4) + payload)
        await peer.wait_eof()
    await peer.aclose()
    # The listener still accepts, and the Node connected before is still connected.
    assert "node-1" in stack.edge.connected_nodes()
    await stack.start_node("node-1")  # a new connection for the same id replaces the old
    await stack.wait_servable("m")
