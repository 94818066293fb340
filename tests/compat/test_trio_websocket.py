"""schemas.compat.trio_websocket on the installed trio-websocket, on a real
connection: a listener's message limit holds until `lift_message_limit`, and the lifted
limit holds after it; `watch_arrivals` hears every frame that arrives, pings included;
`write_now` writes a message only when no write holds the connection; `divert_messages`
hands every message to a function from trio-websocket's own reader task, in order; a ping
is answered with a pong written directly, or after the write that holds the connection.

The server below behaves like the Edge's node listener: a small limit for whatever a peer
sends first, then, once the peer said `lift`, a larger one for that connection only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import cast

import pytest
import trio
from trio.testing import wait_all_tasks_blocked
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    open_websocket_url,
    serve_websocket,
)

from schemas.compat.trio_websocket import (
    ARRIVALS_WATCHABLE,
    DIVERTS_MESSAGES,
    MESSAGE_LIMIT_LIFTABLE,
    PONGS_DIRECTLY,
    WRITES_DIRECTLY,
    divert_messages,
    lift_message_limit,
    restore_messages,
    unwatch_arrivals,
    watch_arrivals,
    write_now,
)
from tests.timing import GUARD_S

PRE_LIFT_LIMIT = 1024
LIFTED_LIMIT = 16 * 1024
#: The close code for a message over the limit (RFC 6455 "message too big").
MESSAGE_TOO_BIG = 1009


async def _echo_sizes(request: WebSocketRequest) -> None:
    """Answer each message with its size; after `lift`, allow `LIFTED_LIMIT` bytes."""
    websocket = await request.accept()
    try:
        while True:
            message = await websocket.get_message()
            if message == b"lift":
                lift_message_limit(websocket, LIFTED_LIMIT)
                await websocket.send_message(b"lifted")
            else:
                await websocket.send_message(b"%d" % len(message))
    except ConnectionClosed:
        pass


async def _echo(websocket: WebSocketConnection) -> None:
    """Answer each message with itself until the client closes."""
    try:
        while True:
            await websocket.send_message(await websocket.get_message())
    except ConnectionClosed:
        pass


@pytest.fixture
async def url(nursery: trio.Nursery) -> str:
    serve = partial(serve_websocket, max_message_size=PRE_LIFT_LIMIT)
    server = await nursery.start(serve, _echo_sizes, "127.0.0.1", 0, None)
    return f"ws://127.0.0.1:{server.port}/"


async def _refused(websocket: WebSocketConnection, size: int) -> bool:
    """Send `size` bytes: True if the server closed the connection as too big."""
    await websocket.send_message(b"\x00" * size)
    try:
        await websocket.get_message()
    except ConnectionClosed as closed:
        assert closed.reason is not None
        assert closed.reason.code == MESSAGE_TOO_BIG
        return True
    return False


def test_the_installed_version_is_one_known_to_keep_the_limit_there() -> None:
    assert MESSAGE_LIMIT_LIFTABLE


async def test_a_message_over_the_limit_is_refused_before_the_lift(url: str) -> None:
    async with open_websocket_url(url) as websocket:
        with trio.fail_after(GUARD_S):
            assert await _refused(websocket, PRE_LIFT_LIMIT + 1)


async def test_the_same_message_is_accepted_after_the_lift(url: str) -> None:
    async with open_websocket_url(url) as websocket:
        with trio.fail_after(GUARD_S):
            await websocket.send_message(b"\x00" * PRE_LIFT_LIMIT)  # the old limit, still fine
            assert await websocket.get_message() == b"%d" % PRE_LIFT_LIMIT
            await websocket.send_message(b"lift")
            assert await websocket.get_message() == b"lifted"
            await websocket.send_message(b"\x00" * LIFTED_LIMIT)
            assert await websocket.get_message() == b"%d" % LIFTED_LIMIT
            # The lifted limit is a limit, not none at all.
            assert await _refused(websocket, LIFTED_LIMIT + 1)


async def test_the_lift_is_per_connection(url: str) -> None:
    async with open_websocket_url(url) as lifted, open_websocket_url(url) as other:
        with trio.fail_after(GUARD_S):
            await lifted.send_message(b"lift")
            assert await lifted.get_message() == b"lifted"
            assert await _refused(other, PRE_LIFT_LIMIT + 1)
            await lifted.send_message(b"\x00" * LIFTED_LIMIT)
            assert await lifted.get_message() == b"%d" % LIFTED_LIMIT


# --- hearing arrivals ------------------------------------------------------------------------


def test_the_installed_version_is_one_whose_arrivals_can_be_watched() -> None:
    assert ARRIVALS_WATCHABLE


async def test_every_arrival_is_heard_a_ping_included(nursery: trio.Nursery) -> None:
    """The server hears each of the client's pings and messages as it arrives; trio-websocket
    still answers the pings and delivers the messages."""
    arrivals: list[float] = []
    watching: list[bool] = []
    heard = trio.Event()

    def arrived() -> None:
        arrivals.append(trio.current_time())
        heard.set()

    async def watched(request: WebSocketRequest) -> None:
        websocket = await request.accept()
        watching.append(watch_arrivals(websocket, arrived))
        await _echo(websocket)

    server = await nursery.start(serve_websocket, watched, "127.0.0.1", 0, None)
    async with open_websocket_url(f"ws://127.0.0.1:{server.port}/") as client:
        with trio.fail_after(GUARD_S):
            await client.send_message(b"first")
            assert await client.get_message() == b"first"
            assert watching == [True]
            before = len(arrivals)
            assert before >= 1
            heard = trio.Event()
            await client.ping(b"are you there")  # answered by trio-websocket itself
            await heard.wait()
            assert len(arrivals) > before
            await client.send_message(b"second")
            assert await client.get_message() == b"second"


async def test_unwatched_arrivals_are_not_heard_and_the_connection_lets_go_of_the_listener(
    nursery: trio.Nursery,
) -> None:
    """After `unwatch_arrivals` the connection no longer refers to the listener (no
    cycle through it) and still reads as before."""
    arrivals: list[str] = []
    unwatched = trio.Event()

    async def watched(request: WebSocketRequest) -> None:
        websocket = await request.accept()
        watch_arrivals(websocket, lambda: arrivals.append("heard"))
        await websocket.send_message(await websocket.get_message())
        unwatch_arrivals(websocket)
        unwatched.set()
        await _echo(websocket)

    server = await nursery.start(serve_websocket, watched, "127.0.0.1", 0, None)
    async with open_websocket_url(f"ws://127.0.0.1:{server.port}/") as client:
        with trio.fail_after(GUARD_S):
            await client.send_message(b"first")
            assert await client.get_message() == b"first"
            await unwatched.wait()
            heard = len(arrivals)
            await client.send_message(b"second")
            assert await client.get_message() == b"second"
    assert heard >= 1 and len(arrivals) == heard


async def test_nothing_is_watched_on_something_that_is_not_a_known_connection() -> None:
    assert not watch_arrivals(cast(WebSocketConnection, object()), lambda: None)
    unwatch_arrivals(cast(WebSocketConnection, object()))  # nothing to undo


# --- messages handed over by the reader ------------------------------------------------------


def test_the_installed_version_is_one_whose_messages_can_be_diverted() -> None:
    assert DIVERTS_MESSAGES


async def test_diverted_messages_arrive_in_order_from_the_reader_task_queued_ones_first(
    nursery: trio.Nursery,
) -> None:
    """What was queued before the diversion is handed over first, then each message as the
    reader parses it, in the reader's task (no task of the side wakes); `get_message`
    only says when the connection ended; after `restore_messages` it reads again."""
    delivered: list[tuple[bytes | str, bool]] = []
    diverted, all_three, restored, ended = trio.Event(), trio.Event(), trio.Event(), trio.Event()

    async def server(request: WebSocketRequest) -> None:
        websocket = await request.accept()
        await websocket.send_message(b"ready")
        await wait_all_tasks_blocked()  # the client's first message waits in the queue
        me = trio.lowlevel.current_task()

        def deliver(message: bytes | str) -> None:
            delivered.append((message, trio.lowlevel.current_task() is me))
            if len(delivered) == 3:
                all_three.set()

        assert divert_messages(websocket, deliver)
        diverted.set()
        await all_three.wait()
        restore_messages(websocket)
        restored.set()
        assert await websocket.get_message() == b"fourth"  # read as before
        with pytest.raises(ConnectionClosed):
            await websocket.get_message()
        ended.set()

    listener = await nursery.start(serve_websocket, server, "127.0.0.1", 0, None)
    with trio.fail_after(GUARD_S):
        async with open_websocket_url(f"ws://127.0.0.1:{listener.port}/") as client:
            assert await client.get_message() == b"ready"
            await client.send_message(b"first")
            await diverted.wait()
            await client.send_message(b"second")
            await client.send_message("third")
            await restored.wait()
            await client.send_message(b"fourth")
        await ended.wait()
    # the first was queued: handed over by the diverting task; the rest by the reader's
    assert delivered == [(b"first", True), (b"second", False), ("third", False)]


async def test_nothing_is_diverted_on_something_that_is_not_a_known_connection() -> None:
    assert not divert_messages(cast(WebSocketConnection, object()), lambda m: None)
    restore_messages(cast(WebSocketConnection, object()))  # nothing to undo


# --- writing directly --------------------------------------------------------------------------


@asynccontextmanager
async def _connected(
    nursery: trio.Nursery,
) -> AsyncIterator[tuple[WebSocketConnection, WebSocketConnection]]:
    """A client connection and the server's side of it (which only holds it open)."""
    accepted: list[WebSocketConnection] = []
    ready = trio.Event()

    async def keep(request: WebSocketRequest) -> None:
        accepted.append(await request.accept())
        ready.set()
        await trio.sleep_forever()

    server = await nursery.start(serve_websocket, keep, "127.0.0.1", 0, None)
    async with open_websocket_url(f"ws://127.0.0.1:{server.port}/") as client:
        with trio.fail_after(GUARD_S):
            await ready.wait()
        yield client, accepted[0]


async def _hold_the_send_lock(nursery: trio.Nursery, websocket: WebSocketConnection) -> trio.Event:
    """A write in progress, as trio-websocket's `_send` holds the lock: set the event
    returned to end it."""
    writing, release = trio.Event(), trio.Event()

    async def hold() -> None:
        async with websocket._stream_lock:
            writing.set()
            await release.wait()

    nursery.start_soon(hold)
    await writing.wait()
    return release


def test_the_installed_version_is_one_written_to_directly() -> None:
    assert WRITES_DIRECTLY


async def test_a_message_written_directly_arrives_whole_and_never_inside_another_write(
    nursery: trio.Nursery,
) -> None:
    """`write_now` writes a whole message when the connection is free, steps aside while
    trio-websocket holds its send lock (a write in progress) and on a closed connection."""
    async with _connected(nursery) as (client, websocket):
        with trio.fail_after(GUARD_S):
            assert write_now(websocket, b"direct") == b""
            assert await client.get_message() == b"direct"
            release = await _hold_the_send_lock(nursery, websocket)
            assert write_now(websocket, b"not now") is None
            release.set()
            await wait_all_tasks_blocked()
            assert write_now(websocket, b"now") == b""
            assert await client.get_message() == b"now"
            await websocket.aclose()
            assert write_now(websocket, b"closed") is None


class _Wrapped(trio.abc.Stream):
    """A stream around a plain one, as the Node's dial wraps its connection."""

    def __init__(self, inner: trio.SocketStream, *, named: bool) -> None:
        self.inner = inner
        self.socket_stream = inner if named else None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("named", [True, False])
async def test_a_client_writes_directly_through_a_wrapper_that_names_its_socket(
    nursery: trio.Nursery, named: bool
) -> None:
    """A client's frame is masked as wsproto masks it; a wrapped stream is written
    directly when the wrapper names the plain stream beneath it (`socket_stream`), and
    the usual way when it does not."""
    server = await nursery.start(serve_websocket, _echo_websocket, "127.0.0.1", 0, None)
    async with open_websocket_url(f"ws://127.0.0.1:{server.port}/") as client:
        plain = client._stream
        assert isinstance(plain, trio.SocketStream)
        client._stream = _Wrapped(plain, named=named)
        with trio.fail_after(GUARD_S):
            if named:
                assert write_now(client, b"direct") == b""
            else:
                assert write_now(client, b"direct") is None
                await client.send_message(b"direct")
            assert await client.get_message() == b"direct"


async def _echo_websocket(request: WebSocketRequest) -> None:
    await _echo(await request.accept())


def test_the_installed_version_is_one_whose_pongs_are_written_directly() -> None:
    assert PONGS_DIRECTLY


async def test_a_ping_is_answered_directly_or_after_the_write_in_progress(
    nursery: trio.Nursery,
) -> None:
    """A pong goes out without trio-websocket's `_send` while nothing is being written;
    while a write holds the send lock, the pong waits for it, never inside its frame."""
    async with _connected(nursery) as (client, websocket):
        with trio.fail_after(GUARD_S):

            async def no_send(event: object) -> None:
                raise AssertionError(f"sent the usual way: {event}")

            websocket._send = no_send  # type: ignore[method-assign]
            await client.ping(b"direct")  # returns once its pong came back
            del websocket._send
            ponged = trio.Event()

            async def ping() -> None:
                await client.ping(b"held")
                ponged.set()

            release = await _hold_the_send_lock(nursery, websocket)
            nursery.start_soon(ping)
            await wait_all_tasks_blocked()
            assert not ponged.is_set()  # the pong waits for the write in progress
            release.set()
            await ponged.wait()
