"""`schemas.channel`, the websocket channel both processes run their sessions on, rule by
rule, on a real loopback websocket (the Edge's and the Node's sessions on it are pinned
in tests/unit/test_session_heartbeat.py, tests/node/test_link.py and the e2e tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from functools import partial
from typing import cast

import pytest
import trio
from trio.testing import MockClock, wait_all_tasks_blocked
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    open_websocket_url,
    serve_websocket,
)

from schemas import wire
from schemas.channel import (
    NORMAL_CLOSURE,
    OUTBOX_SIZE,
    POLICY_VIOLATION,
    PROTOCOL_ERROR,
    Channel,
    ChannelClosed,
    MalformedFrame,
    close_code_for,
    close_reason,
)
from tests.timing import GUARD_S


def _one_frame_each(first: bytes, take: Callable[[], bytes | None]) -> Iterable[bytes]:
    return (first,)


def _edge_channel(websocket: WebSocketConnection) -> Channel[bytes, wire.NodeToEdge]:
    """A channel as the Edge's side runs it: it reads Node messages, sends a frame each."""
    return Channel[bytes, wire.NodeToEdge](
        websocket, decode=wire.decode_from_node, pack=_one_frame_each
    )


@asynccontextmanager
async def _pair(
    nursery: trio.Nursery,
) -> AsyncIterator[tuple[WebSocketConnection, WebSocketConnection]]:
    """A server-side and a client-side websocket, connected over loopback."""
    accepted: trio.MemorySendChannel[WebSocketConnection]
    accepted, taken = trio.open_memory_channel[WebSocketConnection](1)

    async def handler(request: WebSocketRequest) -> None:
        await accepted.send(await request.accept())
        await trio.sleep_forever()  # the connection lives as long as the test needs it

    server = await nursery.start(partial(serve_websocket, handler, "127.0.0.1", 0, None))
    async with open_websocket_url(f"ws://127.0.0.1:{server.port}/") as client:
        yield await taken.receive(), client


async def _closed(client: WebSocketConnection) -> ConnectionClosed:
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            await client.get_message()
    return closed.value


async def test_a_reject_leaves_after_what_was_queued_then_the_close(nursery: trio.Nursery) -> None:
    async with _pair(nursery) as (server, client):
        channel = _edge_channel(server)
        channel.send_nowait(b"first")
        await channel.send(b"second")
        channel.reject("protocol_error", "no hello twice")
        with pytest.raises(ChannelClosed):
            channel.send_nowait(b"too late")
        with trio.fail_after(GUARD_S):
            nursery.start_soon(channel.write)
            assert await client.get_message() == b"first"
            assert await client.get_message() == b"second"
            reject = wire.decode_from_edge(await client.get_message())
            assert reject == wire.Reject(code="protocol_error", reason="no hello twice")
            closed = await _closed(client)
    assert closed.reason is not None and closed.reason.code == PROTOCOL_ERROR


async def test_a_frame_that_does_not_decode_is_rejected_and_the_reader_told(
    nursery: trio.Nursery,
) -> None:
    async with _pair(nursery) as (server, client):
        channel = _edge_channel(server)
        nursery.start_soon(channel.write)
        await client.send_message(b"\xc1 not msgpack")
        with trio.fail_after(GUARD_S):
            with pytest.raises(MalformedFrame):
                await channel.receive()
            reject = wire.decode_from_edge(await client.get_message())
            closed = await _closed(client)
    assert isinstance(reject, wire.Reject) and reject.code == "bad_frame"
    assert closed.reason is not None and closed.reason.code == PROTOCOL_ERROR
    assert channel.closing


def _status(detail: str) -> bytes:
    provider = wire.ProviderStatus(id="p", health="available", models=["m"], detail=detail)
    return wire.encode(wire.Status(providers=[provider]))


async def test_each_message_is_handled_as_it_arrives_in_order_until_the_connection_ends(
    nursery: trio.Nursery,
) -> None:
    """`receive_each` hands every message over from trio-websocket's reader task (Rule 3):
    the receiving task does not wake per message; it returns when the connection ends."""
    async with _pair(nursery) as (server, client):
        channel = _edge_channel(server)
        handled: list[tuple[str | None, bool]] = []
        receiving: list[trio.lowlevel.Task] = []
        two = trio.Event()

        def handle(message: wire.NodeToEdge) -> None:
            assert isinstance(message, wire.Status)
            here = trio.lowlevel.current_task() in receiving
            handled.append((message.providers[0].detail, here))
            if len(handled) == 2:
                two.set()

        async def receive() -> None:
            receiving.append(trio.lowlevel.current_task())
            with pytest.raises(ConnectionClosed):
                await channel.receive_each(handle)
            ended.set()

        ended = trio.Event()
        nursery.start_soon(receive)
        with trio.fail_after(GUARD_S):
            await wait_all_tasks_blocked()
            await client.send_message(_status("one"))
            await client.send_message(_status("two"))
            await two.wait()
            await client.aclose()
            await ended.wait()
    assert handled == [("one", False), ("two", False)]


async def test_a_frame_that_does_not_decode_ends_the_delivery_with_a_reject(
    nursery: trio.Nursery,
) -> None:
    async with _pair(nursery) as (server, client):
        channel = _edge_channel(server)
        handled: list[wire.NodeToEdge] = []
        nursery.start_soon(channel.write)
        await client.send_message(b"\xc1 not msgpack")
        await client.send_message(_status("after"))
        with trio.fail_after(GUARD_S):
            with pytest.raises(MalformedFrame):
                await channel.receive_each(handled.append)
            reject = wire.decode_from_edge(await client.get_message())
            await _closed(client)
    assert isinstance(reject, wire.Reject) and reject.code == "bad_frame"
    assert handled == []


async def test_what_the_handler_raises_ends_the_delivery_and_is_raised(
    nursery: trio.Nursery,
) -> None:
    async with _pair(nursery) as (server, client):
        channel = _edge_channel(server)
        handled: list[str | None] = []

        def handle(message: wire.NodeToEdge) -> None:
            assert isinstance(message, wire.Status)
            handled.append(message.providers[0].detail)
            raise wire.WireError("not on this session")

        await client.send_message(_status("first"))
        await client.send_message(_status("second"))
        with trio.fail_after(GUARD_S):
            with pytest.raises(wire.WireError, match="not on this session"):
                await channel.receive_each(handle)
    assert handled == ["first"]


async def test_a_producer_waits_while_the_outbox_is_full(nursery: trio.Nursery) -> None:
    async with _pair(nursery) as (server, client):
        channel = _edge_channel(server)
        for _ in range(OUTBOX_SIZE):
            channel.send_nowait(b"x")
        with pytest.raises(trio.WouldBlock):
            channel.send_nowait(b"x")
        sent = trio.Event()

        async def produce() -> None:
            await channel.send(b"x")
            sent.set()

        nursery.start_soon(produce)
        await wait_all_tasks_blocked()
        assert not sent.is_set() and channel.outbox_used == OUTBOX_SIZE
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as writing:
                writing.start_soon(channel.write)  # the writer makes room
                await sent.wait()
                channel.close()  # the writer flushes, sends the Close, returns
                closed = await _closed(client)  # the peer reads it all, then the Close
    assert closed.reason is not None and closed.reason.code == NORMAL_CLOSURE


async def test_a_frame_goes_out_at_once_when_nothing_waits_to_be_sent(
    nursery: trio.Nursery,
) -> None:
    """Rule 1's exception: no writer runs here, yet `send_now` frames reach the peer;
    once a frame is queued, the next waits behind it, and the writer sends both in order."""
    async with _pair(nursery) as (server, client):
        channel = _edge_channel(server)
        with trio.fail_after(GUARD_S):
            assert await channel.send_now(b"direct")
            assert await client.get_message() == b"direct"
            channel.send_nowait(b"queued")
            assert not await channel.send_now(b"after it")  # would overtake "queued"
            await channel.send(b"after it")
            nursery.start_soon(channel.write)
            assert await client.get_message() == b"queued"
            assert await client.get_message() == b"after it"
            await wait_all_tasks_blocked()  # the writer sent both: nothing waits now
            assert await channel.send_now(b"direct again")
            assert await client.get_message() == b"direct again"
            channel.close()
            assert not await channel.send_now(b"closing")


async def test_a_frame_the_socket_took_in_part_is_finished_before_any_other(
    nursery: trio.Nursery,
) -> None:
    """A peer that stops reading: the frame the socket took in part is written whole
    when it reads again, and no other frame (nor `send_now`) gets in meanwhile."""
    size = 512 * 1024
    async with _pair(nursery) as (server, client):
        channel = _edge_channel(server)
        nursery.start_soon(channel.write)
        sent: list[bytes] = []

        async def produce() -> None:
            for n in range(64):  # far more than the sockets' buffers hold
                frame = bytes([n]) * size
                if not await channel.send_now(frame):
                    await channel.send(frame)
                sent.append(frame)

        nursery.start_soon(produce)
        await wait_all_tasks_blocked()  # the peer reads no more: the producer waits
        assert len(sent) < 64
        with trio.fail_after(GUARD_S):
            for n in range(64):
                assert await client.get_message() == bytes([n]) * size
        assert len(sent) == 64


def _all_in_one(first: bytes, take: Callable[[], bytes | None]) -> Iterable[bytes]:
    items = [first]
    while (item := take()) is not None:
        items.append(item)
    return [b"+".join(items)]


class _Steps(trio.abc.Instrument):
    def __init__(self, name: str) -> None:
        self.name = name
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name == self.name:
            self.steps += 1


async def test_the_writer_writes_a_lone_frame_at_once_and_several_the_usual_way(
    nursery: trio.Nursery,
) -> None:
    """Rule 1: a lone item's frame goes out in the writer's one step (no yield for the
    lock or the send); items that queued up together go out the usual way, whose yields
    let producers add to the next message."""
    async with _pair(nursery) as (server, client):
        channel = Channel[bytes, wire.NodeToEdge](
            server, decode=wire.decode_from_node, pack=_all_in_one
        )
        counter = _Steps("writer")
        trio.lowlevel.add_instrument(counter)
        try:
            nursery.start_soon(channel.write, name="writer")
            await wait_all_tasks_blocked()
            before = counter.steps
            channel.send_nowait(b"lone")
            await wait_all_tasks_blocked()
            assert counter.steps == before + 1
            with trio.fail_after(GUARD_S):
                assert await client.get_message() == b"lone"
            before = counter.steps
            channel.send_nowait(b"a")
            channel.send_nowait(b"b")
            await wait_all_tasks_blocked()
            assert counter.steps > before + 1
            with trio.fail_after(GUARD_S):
                assert await client.get_message() == b"a+b"
            assert channel.outbox_used == 0
        finally:
            trio.lowlevel.remove_instrument(counter)
        channel.close()


class _SilentPeer:
    """A websocket whose peer answers the first `answers` pings and then none."""

    def __init__(self, answers: int) -> None:
        self.answers = answers
        self.pings = 0

    async def ping(self) -> None:
        self.pings += 1
        if self.pings > self.answers:
            await trio.sleep_forever()


async def test_the_heartbeat_returns_when_a_ping_goes_unanswered(autojump_clock: MockClock) -> None:
    peer = _SilentPeer(answers=2)
    channel = _edge_channel(cast(WebSocketConnection, peer))
    answered: list[float] = []
    await channel.heartbeat(
        partial(trio.sleep, 5.0), 15.0, lambda: answered.append(trio.current_time())
    )
    assert answered == [5.0, 10.0]
    assert trio.current_time() == 15.0 + 15.0  # the third ping, then its whole timeout


@pytest.mark.parametrize(
    ("reject_code", "close_code"),
    [
        ("bad_frame", PROTOCOL_ERROR),
        ("protocol_error", PROTOCOL_ERROR),
        ("protocol_version", PROTOCOL_ERROR),
        ("bad_token", POLICY_VIOLATION),
        ("unknown_node", POLICY_VIOLATION),
        ("handshake_timeout", POLICY_VIOLATION),
        (wire.NODE_REPLACED, POLICY_VIOLATION),
    ],
)
def test_the_close_code_follows_the_reject(reject_code: str, close_code: int) -> None:
    assert close_code_for(reject_code) == close_code


def test_a_close_reason_fits_its_frame_and_never_splits_a_character() -> None:
    reason = close_reason("é" * 100)  # 200 bytes of UTF-8
    assert len(reason.encode()) <= 123
    assert reason == "é" * 60
