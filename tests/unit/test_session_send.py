"""How the Edge's node session sends (`runtime.nodes.session.NodeSession.send`): a run's
frame goes to the Node from the caller's own task when nothing waits to be sent (the
channel's `send_now`), every other frame through the session's writer, in order. On a
real loopback websocket, with no writer running until the test starts the session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import trio
from trio_websocket import (
    WebSocketConnection,
    WebSocketRequest,
    open_websocket_url,
    serve_websocket,
)

from iop_edge.runtime.nodes.heartbeat import HeartbeatGrid
from iop_edge.runtime.nodes.session import NodeSession
from schemas import wire
from tests.timing import GUARD_S


@asynccontextmanager
async def _pair(
    nursery: trio.Nursery,
) -> AsyncIterator[tuple[WebSocketConnection, WebSocketConnection]]:
    """The Edge's side and the Node's side of one websocket, over loopback."""
    accepted: trio.MemorySendChannel[WebSocketConnection]
    accepted, taken = trio.open_memory_channel[WebSocketConnection](1)

    async def handler(request: WebSocketRequest) -> None:
        await accepted.send(await request.accept())
        await trio.sleep_forever()

    server = await nursery.start(partial(serve_websocket, handler, "127.0.0.1", 0, None))
    async with open_websocket_url(f"ws://127.0.0.1:{server.port}/") as node:
        yield await taken.receive(), node


def _run(run_id: str) -> wire.Run:
    return wire.Run(run_id=run_id, provider_id="p1", target="m", operation="chat", body=b"{}")


async def test_a_run_goes_at_once_and_every_other_frame_through_the_writer(
    nursery: trio.Nursery,
) -> None:
    async with _pair(nursery) as (edge, node):
        session = NodeSession("n1", edge, applied_revision=1, on_status=lambda _n, _s: None)
        with trio.fail_after(GUARD_S):
            await session.send(_run("r1"))  # no writer runs yet
            assert wire.decode_from_edge(await node.get_message()) == _run("r1")
            await session.send(wire.GoAway(reason="draining"))  # queued for the writer
            await session.send(_run("r2"))  # behind it: queued too, order kept
            nursery.start_soon(session.serve, HeartbeatGrid(5.0, 15.0))
            assert wire.decode_from_edge(await node.get_message()) == wire.GoAway(reason="draining")
            assert wire.decode_from_edge(await node.get_message()) == _run("r2")
            session.abort()
