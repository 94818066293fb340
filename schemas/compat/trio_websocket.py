"""trio-websocket: raising one connection's message size limit after the handshake, and
hearing when anything arrives on a connection.

The node listener must accept a first message (`hello`, a few hundred bytes) from anyone,
so it listens with a small message limit; an authenticated node may then send messages
up to the wire's limit (large non-stream responses). trio-websocket fixes the limit per
listener (`serve_websocket(max_message_size=...)`) and offers no public call to change it
per connection, so `lift_message_limit` sets the connection's private `_max_message_size`,
which trio-websocket 0.12 reads for every incoming message.

`MESSAGE_LIMIT_LIFTABLE` says whether the installed version is one known to work that
way (`tests/compat` proves it on a real connection). When it is not, the listener allows
the full limit from the first message on: slower to refuse abuse, equally correct.

A peer pings on its own schedule, and trio-websocket answers pings (and takes pongs)
inside its reader, so nothing public says a peer was just heard from. Whatever
arrives goes through the connection's wsproto `receive_data`, which trio-websocket 0.12
looks up on every read: `watch_arrivals` wraps it on one connection. When the installed
version is not one known to read there (`ARRIVALS_WATCHABLE`), nothing is watched and the
Edge pings every Node every beat, as it would without the hook.

The hook is the connection's own attribute and refers to whoever listens, who refers to
the connection: a cycle that only the cyclic collector would free. `unwatch_arrivals`
removes it when the listener is done with the connection, so the connection, and the
session around it, are freed by reference counting alone.

A message is sent by trio-websocket under a lock per connection, with
`SocketStream.send_all`: the lock and the send each yield to the scheduler, so a producer
that hands its frame to a writer task pays for that task's wake-up as well. `write_now`
frames a message and writes it with one non-blocking `os.write` when no write is in
progress (the connection's send lock free), holding that lock across the write so that
nothing trio-websocket sends (a pong, a close) can land inside the frame; a frame the
socket took only in part keeps the lock until `write_rest` has written the rest. When
the connection is not a known version's plain socket connection (`WRITES_DIRECTLY`; a
stream that wraps a plain one says so with a `socket_stream` attribute), or is closing,
nothing is written and the caller sends the usual way.

A whole message is handed by trio-websocket's reader task to the connection's queue
(`_send_channel`, looked up for every message), from which `get_message` takes it in the
reader of the side: two task steps a message (the queue's `send` yields too). A side that
handles each message at once, without waiting, can have the reader task hand it over
itself: `divert_messages` puts, in place of the queue's sending end, one that calls the
side's function (no yield), first handing it what was queued already; the queue stays to
say when the connection ended (`get_message` raises `ConnectionClosed` as before).
`restore_messages` puts the queue back (the function refers to the side: the same cycle
as above). Where the installed version is not one known to hand messages over that way
(`DIVERTS_MESSAGES`), nothing is diverted and the side reads with `get_message`.

trio-websocket answers every ping from its reader task through the same `_send`: two
yields to the scheduler a pong, which is most of what an idle fleet costs its Edge (ten
thousand Nodes pinging it). Where the installed version answers there
(`PONGS_DIRECTLY`), this module puts `_answer_ping` in the place of its ping handler, for
every connection, when it is imported: the same pong frame, written with one non-blocking
write when the send lock is free, as `write_now` writes a message; the rest of a frame the
socket took only in part is sent under the lock before it is let go; a held lock, or a
connection that is not a plain socket's, is answered the usual way.

All are used through `schemas.channel` (arrivals, direct writes, diverted messages, pongs)
and the Edge's node hub (the limit); this module is the only place that names
trio-websocket's private attributes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.metadata import version
from typing import Final

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection
from wsproto.connection import ConnectionState
from wsproto.events import BytesMessage, Ping

__all__ = [
    "ARRIVALS_WATCHABLE",
    "DIVERTS_MESSAGES",
    "MESSAGE_LIMIT_LIFTABLE",
    "PONGS_DIRECTLY",
    "WRITES_DIRECTLY",
    "divert_messages",
    "lift_message_limit",
    "restore_messages",
    "unwatch_arrivals",
    "watch_arrivals",
    "write_now",
    "write_rest",
]

_KNOWN_MINOR_VERSIONS: Final = ("0.12.",)

MESSAGE_LIMIT_LIFTABLE: Final = version("trio-websocket").startswith(_KNOWN_MINOR_VERSIONS)
"""Whether this trio-websocket keeps the limit where `lift_message_limit` changes it."""

ARRIVALS_WATCHABLE: Final = MESSAGE_LIMIT_LIFTABLE
"""Whether this trio-websocket hands every read to `_wsproto.receive_data` (the same
versions)."""

WRITES_DIRECTLY: Final = MESSAGE_LIMIT_LIFTABLE
"""Whether this trio-websocket sends through `_wsproto`, under `_stream_lock`, on
`_stream` (the same versions): `write_now` may write beside it."""


DIVERTS_MESSAGES: Final = MESSAGE_LIMIT_LIFTABLE
"""Whether this trio-websocket hands each whole message to `_send_channel.send`, looked
up per message, and reads its queue's other end in `get_message` (the same versions)."""

PONGS_DIRECTLY: Final = MESSAGE_LIMIT_LIFTABLE
"""Whether this trio-websocket answers a ping in `_handle_ping_event`, looked up when a
connection's reader starts, by sending the pong wsproto makes through `_send` (the same
versions): `_answer_ping` takes its place."""


class _Handover:
    """The sending end trio-websocket's reader finds in place of its queue's: each message
    goes to the side's function at once. Closing it closes the queue (the connection
    ended: `get_message` says so)."""

    __slots__ = ("_deliver", "queue")

    def __init__(
        self, queue: trio.MemorySendChannel[bytes | str], deliver: Callable[[bytes | str], None]
    ) -> None:
        self.queue = queue
        self._deliver = deliver

    async def send(self, message: bytes | str) -> None:
        self._deliver(message)

    async def aclose(self) -> None:
        await self.queue.aclose()


def divert_messages(websocket: WebSocketConnection, deliver: Callable[[bytes | str], None]) -> bool:
    """From now on trio-websocket's reader task calls `deliver(message)` with each whole
    message, in order, before it reads on; what was already queued is delivered first,
    now. `deliver` must not block and must not raise. False when not divertable (the
    caller reads with `get_message`); `get_message` then only says when the connection
    ended."""
    queue = getattr(websocket, "_send_channel", None) if DIVERTS_MESSAGES else None
    queued = getattr(websocket, "_recv_channel", None)
    if not isinstance(queue, trio.MemorySendChannel) or queued is None:
        return False
    while True:  # a reader waiting to queue one more has it taken too
        try:
            deliver(queued.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            break
    websocket._send_channel = _Handover(queue, deliver)  # type: ignore[assignment]
    return True


def restore_messages(websocket: WebSocketConnection) -> None:
    """Undo `divert_messages` (nothing when nothing was diverted): messages are queued for
    `get_message` again."""
    handover = getattr(websocket, "_send_channel", None)
    if isinstance(handover, _Handover):
        websocket._send_channel = handover.queue


def lift_message_limit(websocket: WebSocketConnection, limit: int) -> None:
    """Let `websocket` receive messages of up to `limit` bytes from now on (if liftable)."""
    if MESSAGE_LIMIT_LIFTABLE and hasattr(websocket, "_max_message_size"):
        websocket._max_message_size = limit


def watch_arrivals(websocket: WebSocketConnection, heard: Callable[[], None]) -> bool:
    """Call `heard()` whenever bytes arrive on `websocket` (a message, a ping, a pong, a
    close), before trio-websocket parses them. False when not watchable: nothing is
    called then."""
    wsproto = getattr(websocket, "_wsproto", None) if ARRIVALS_WATCHABLE else None
    receive_data = getattr(wsproto, "receive_data", None)
    if receive_data is None:
        return False

    def receive_and_tell(data: bytes | None) -> None:
        heard()
        receive_data(data)

    wsproto.receive_data = receive_and_tell  # type: ignore[union-attr]
    return True


def unwatch_arrivals(websocket: WebSocketConnection) -> None:
    """Stop calling what `watch_arrivals` installed on `websocket` (nothing when nothing
    was): wsproto's own `receive_data` is what a read calls again."""
    wsproto = getattr(websocket, "_wsproto", None)
    if wsproto is not None and "receive_data" in getattr(wsproto, "__dict__", {}):
        del wsproto.receive_data


def write_now(websocket: WebSocketConnection, message: bytes) -> bytes | None:
    """Write `message` as one websocket message without waiting, when no write is in
    progress: None when nothing was written (a write in progress, a closing, TLS or
    unknown connection, a socket that takes nothing now: send it the usual way), else
    the bytes of the frame the socket did not take (b"" when it took all). Unless that
    is b"", the connection's send lock stays held by the calling task, and `write_rest`
    must follow at once."""
    if not WRITES_DIRECTLY or getattr(websocket, "_close_reason", "unknown") is not None:
        return None
    lock = getattr(websocket, "_stream_lock", None)
    if not isinstance(lock, trio.StrictFIFOLock) or lock.locked():
        return None
    stream = _socket_stream(websocket)
    if stream is None:  # TLS, say: the usual way
        return None
    connection = websocket._wsproto
    if connection.state != ConnectionState.OPEN:
        return None
    data = connection.send(BytesMessage(data=message))  # no state kept for a whole message
    sent = _begin_frame(lock, stream, data)
    if not sent:  # the socket took nothing now, or is broken: the usual way
        lock.release()
        return None
    if sent == len(data):
        lock.release()
        return b""
    return data[sent:]  # the frame is begun: the lock stays held until `write_rest`


async def write_rest(websocket: WebSocketConnection, rest: bytes, *, stalled_s: float) -> None:
    """Write what `write_now` left, still under the send lock it holds, as the socket
    takes it, then release the lock. Shielded (a frame is written whole or the connection
    ends); a peer that takes nothing for `stalled_s` has its connection closed. Raises
    `ConnectionClosed` when the connection broke or was closed meanwhile."""
    lock = websocket._stream_lock
    stream = _socket_stream(websocket)
    assert stream is not None  # `write_now` began only on one
    try:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(stalled_s):
                try:
                    await stream.send_all(rest)
                    return
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            stream.socket.close()  # stalled or broken: the session's reader sees it end
    finally:
        lock.release()
    raise ConnectionClosed(websocket._close_reason)


def _begin_frame(lock: trio.StrictFIFOLock, stream: trio.SocketStream, frame: bytes) -> int:
    """Take the free send `lock` and write what the socket takes of `frame` now, in one
    non-blocking write: the bytes written (0 when it takes nothing, or is broken or
    closed). The lock stays held: the caller writes the rest, or lets it go."""
    lock.acquire_nowait()
    try:
        return os.write(stream.socket.fileno(), frame)
    except OSError:  # BlockingIOError, or a broken or closed connection
        return 0


def _socket_stream(websocket: WebSocketConnection) -> trio.SocketStream | None:
    """The plain TCP stream `websocket` sends on: its own stream, or the one a wrapper
    names as `socket_stream` (the Node's dial wraps its stream); None for any other (TLS)."""
    stream = getattr(websocket, "_stream", None)
    if isinstance(stream, trio.SocketStream):
        return stream
    inner = getattr(stream, "socket_stream", None)
    return inner if isinstance(inner, trio.SocketStream) else None


_USUAL_PING_ANSWER: Final = WebSocketConnection._handle_ping_event


async def _answer_ping(self: WebSocketConnection, event: Ping) -> None:
    """trio-websocket's ping handler, writing its pong directly (module docstring)."""
    lock = self._stream_lock
    stream = _socket_stream(self)
    if stream is None or lock.locked():
        await _USUAL_PING_ANSWER(self, event)
        return
    frame = self._wsproto.send(event.response())
    sent = _begin_frame(lock, stream, frame)
    try:
        if sent < len(frame):  # the rest, or a broken connection `send_all` names
            await stream.send_all(frame[sent:])
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        await self._abort_web_socket()  # as trio-websocket's `_send` does
        raise ConnectionClosed(self._close_reason) from None
    finally:
        lock.release()


if PONGS_DIRECTLY:
    WebSocketConnection._handle_ping_event = _answer_ping  # type: ignore[method-assign]
