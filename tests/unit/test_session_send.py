"""How the Edge's node session sends (`runtime.nodes.session.NodeSession.send`): a run's
or a refresh push's frame goes to the Node from the caller's own task when nothing waits
to be sent (the channel's `send_now`), every other frame through the session's writer,
in order. On a real loopback websocket, with no writer running until the test starts the
session."""

from __future__ import annotations

from collections.abc import Callable

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


async def test_a_push_is_answered_once_by_its_ack_or_by_the_sessions_end(
    nursery: trio.Nursery,
) -> None:
    """A push's answer comes from the reader when the Node acks (no task waits for it),
    or None when the session ends first, or at once when it has ended; a newer
    revision's push lets go of an older one's answer."""
    async with _pair(nursery) as (edge, node):
        session = NodeSession("n1", edge, applied_revision=1, on_status=lambda _n, _s: None)
        answers: list[tuple[int, wire.RefreshAck | None]] = []
        acked = trio.Event()

        def answer_for(revision: int) -> Callable[[wire.RefreshAck | None], None]:
            def answer(ack: wire.RefreshAck | None) -> None:
                answers.append((revision, ack))
                acked.set()

            return answer

        config = NodeConfig(node_id="n1")
        nursery.start_soon(session.serve, HeartbeatGrid(5.0, 15.0))
        with trio.fail_after(GUARD_S):
            await session.push_refresh(2, config, 0.0, answer_for(2))
            await session.push_refresh(3, config, 0.0, answer_for(3))  # 2's answer let go
            assert answers == []  # sent: nobody waits on the Node meanwhile
            for _ in range(2):
                assert isinstance(wire.decode_from_edge(await node.get_message()), wire.Refresh)
            await node.send_message(wire.encode(wire.RefreshAck(revision=2, ok=True)))
            await node.send_message(wire.encode(wire.RefreshAck(revision=3, ok=True)))
            await acked.wait()
            assert answers == [(3, wire.RefreshAck(revision=3, ok=True))]
            assert session.applied_revision == 3

            await session.push_refresh(4, config, 0.0, answer_for(4))
            session.abort()  # the session ends before the Node acks
            await session.closed.wait()
            await session.push_refresh(5, config, 0.0, answer_for(5))  # ended: at once
        assert answers[1:] == [(4, None), (5, None)]


async def test_an_ack_of_a_revision_never_sent_is_ignored(nursery: trio.Nursery) -> None:
    """A Node cannot claim a config it was never sent: its applied revision, and who
    hears acks, stay as they were; an ack of what was sent still counts after it."""
    async with _pair(nursery) as (edge, node):
        heard: list[wire.RefreshAck] = []
        session = NodeSession(
            "n1",
            edge,
            applied_revision=1,
            on_status=lambda _n, _s: None,
            on_ack=lambda _n, ack: heard.append(ack),
        )
        nursery.start_soon(session.serve, HeartbeatGrid(5.0, 15.0))
        acked = trio.Event()
        with trio.fail_after(GUARD_S):
            await session.push_refresh(2, NodeConfig(node_id="n1"), 0.0, lambda _ack: acked.set())
            assert isinstance(wire.decode_from_edge(await node.get_message()), wire.Refresh)
            await node.send_message(wire.encode(wire.RefreshAck(revision=10**12, ok=True)))
            await node.send_message(wire.encode(wire.RefreshAck(revision=2, ok=True)))
            await acked.wait()
        assert session.applied_revision == 2
        assert heard == [wire.RefreshAck(revision=2, ok=True)]
        session.abort()
