"""How the Edge's node session sends (`runtime.nodes.session.NodeSession.send`): a run's
or a refresh push's frame goes to the Node from the caller's own task when nothing waits
to be sent (the channel's `send_now`), every other frame through the session's writer,
in order. On a real loopback websocket, with no writer running until the test starts the
session."""

from __future__ import annotations

import trio

from iop_edge.runtime.nodes.heartbeat import HeartbeatGrid
from iop_edge.runtime.nodes.session import NodeSession
from schemas import wire
from schemas.config import NodeConfig
from tests.timing import GUARD_S
from tests.unit.test_channel import _pair  # the Edge's side and the Node's side


def _run(run_id: str) -> wire.Run:
    return wire.Run(run_id=run_id, provider_id="p1", target="m", operation="chat", body=b"{}")


async def test_a_run_and_a_push_go_at_once_and_every_other_frame_through_the_writer(
    nursery: trio.Nursery,
) -> None:
    async with _pair(nursery) as (edge, node):
        session = NodeSession("n1", edge, applied_revision=1, on_status=lambda _n, _s: None)
        push = wire.Refresh(revision=2, node_config=NodeConfig(node_id="n1"))
        with trio.fail_after(GUARD_S):
            await session.send(_run("r1"))  # no writer runs yet
            assert wire.decode_from_edge(await node.get_message()) == _run("r1")
            await session.send(push)
            assert wire.decode_from_edge(await node.get_message()) == push
            await session.send(wire.GoAway(reason="draining"))  # queued for the writer
            await session.send(_run("r2"))  # behind it: queued too, order kept
            nursery.start_soon(session.serve, HeartbeatGrid(5.0, 15.0))
            assert wire.decode_from_edge(await node.get_message()) == wire.GoAway(reason="draining")
            assert wire.decode_from_edge(await node.get_message()) == _run("r2")
            session.abort()
