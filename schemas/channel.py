"""The framed websocket channel between an Edge and a Node: one implementation, both ends.

Why this lives in `schemas`: `schemas` is the one package both processes import (a Node
never imports the Edge), and a channel is part of the wire's contract as much as the
messages are: how many frames may wait, what a peer hears before a close, which close code
follows which refusal, what a heartbeat means. So the Edge's node session
(`iop_edge.runtime.nodes.session`) and the Node's link (`iop_node.uplink.link`) are both built on
`Channel`, and a rule of the channel cannot drift apart between them. It needs Trio and
trio-websocket, which both processes run on, and knows neither process.

Rules:

1. One writer. Only `write` sends messages on the websocket. Every producer queues into a
   bounded outbox (`OUTBOX_SIZE` items) and waits only while it is full: frames never
   interleave, and a peer that reads slowly slows its producers, not the memory. Each
   time the writer wakes it hands the first queued item, and a way to take the others
   already queued, to the side's `Pack`, which turns them into frames (the Node packs run
   events into one message; the Edge sends a `cancel` kept aside behind the frame). When
   it found one item queued, it writes its frame with one non-blocking write if the
   socket takes it (`schemas.compat.trio_websocket.write_now`: no yield for the
   connection's lock and none for the send). A writer that found several is behind its
   producers and sends the usual way: its yields let them queue more for its next
   message, so a busy stream's chunks keep travelling in few messages.
   One exception, for a side that sends a frame per message (`send_now`): when nothing
   is queued or being sent, the producer writes its frame itself, at once, if the socket
   takes it (`schemas.compat.trio_websocket.write_now`), and the writer task does not
   wake for it. Order is kept: a frame goes this way only when every frame queued before
   it is already on the socket.
2. Closing on purpose (`close`): the outbox takes nothing more; the writer sends what is
   queued, then the last frame if there is one (a `reject`), then a Close with the code,
   the last frame and the Close within `CLOSE_TIMEOUT_S`. A peer that reads nothing at
   all stalls that flush: its heartbeat fails then (a ping waits behind the stalled
   write), and the side drops the connection.
3. Reading (`receive`): every frame is decoded by the side's decoder (`wire.decode_from_*`);
   a frame that does not decode is answered `reject{bad_frame}` and a close (Rule 2), and
   `receive` raises `MalformedFrame`. A frame that decodes is still only input: the side
   checks what it says. A side that handles each message at once, without waiting (the
   Edge's node session), has them handed over as trio-websocket's reader parses them
   (`receive_each`; `schemas.compat.trio_websocket.divert_messages`): no task of the side
   wakes per message. What the handler raises ends the delivery, and `receive_each`
   raises it, as `receive` would have.
4. Close codes follow the reason: `PROTOCOL_ERROR` after a `reject` for a frame or a
   protocol fault, `POLICY_VIOLATION` after a refusal (a token, an id, a replaced
   connection, a `hello` that never came; `close_code_for`), `GOING_AWAY` for a process
   that stops or an Edge that went away, `TRY_AGAIN_LATER` for a handshake evicted by
   newer ones. A Close's reason text is cut to fit its frame (`close_reason`).
5. Heartbeat (`heartbeat`): whenever the side says a ping is due, ping; a ping unanswered
   within `timeout_s` means the peer is silent, and `heartbeat` returns so the side can
   end the session. When pings are due is each side's choice: the Node at its instant of
   the shared grid (`schemas.heartbeat`), the Edge when a look of its grid finds the peer
   silent (anything arriving counts: `Channel(heard=...)`).
6. Every ending reads as one line in a log: `describe_close` for a connection that
   closed, the side's own words for the rest.
7. A side that is done with its channel `release`s it: the channel lets go of the side's
   callbacks (its `Pack`, `heard`), which refer to the side, which refers to the channel.
   Nothing of a session that ended is then left in a reference cycle, and reference
   counting frees it all (an Edge keeps its heap out of the cyclic collector's sight:
   `iop_edge.runtime.lifecycle.heap`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Final, Generic, TypeVar

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from schemas import wire
from schemas.compat.trio_websocket import (
    divert_messages,
    restore_messages,
    unwatch_arrivals,
    watch_arrivals,
    write_now,
    write_rest,
)

__all__ = [
    "CLOSE_TIMEOUT_S",
    "GOING_AWAY",
    "NORMAL_CLOSURE",
    "OUTBOX_SIZE",
    "POLICY_VIOLATION",
    "PROTOCOL_ERROR",
    "RECEIVE_BUFFER_BYTES",
    "REJECT_TIMEOUT_S",
    "STALLED_WRITE_S",
    "TRY_AGAIN_LATER",
    "Channel",
    "ChannelClosed",
    "MalformedFrame",
    "Pack",
    "close_code_for",
    "close_reason",
    "describe_close",
    "drop",
    "reject_and_close",
]

#: Items queued for the writer; producers wait (back-pressure) when it is full (Rule 1).
OUTBOX_SIZE: Final = 256
#: Bytes asked of the socket per read. trio-websocket's default (4 KiB) splits every
#: request body of a few KiB into several reads, each a trip through the event loop.
RECEIVE_BUFFER_BYTES: Final = 256 * 1024
#: A peer that takes nothing of a frame begun by `Channel.send_now` for this long loses
#: its connection (as long as the Edge waits for a ping's answer: its heartbeat, which
#: waits behind that frame, fails about then too).
STALLED_WRITE_S: Final = 15.0
#: Bound on a closing handshake (the last frame and the Close, Rule 2).
CLOSE_TIMEOUT_S: Final = 5.0
#: Bound on telling a peer why before any session (`reject_and_close`): a courtesy, and a
#: peer refused during its handshake deserves no more patience.
REJECT_TIMEOUT_S: Final = 2.0

# Close codes (RFC 6455 §7.4.1) the channel uses (Rule 4).
NORMAL_CLOSURE: Final = 1000
GOING_AWAY: Final = 1001
PROTOCOL_ERROR: Final = 1002
POLICY_VIOLATION: Final = 1008
TRY_AGAIN_LATER: Final = 1013

#: `reject` codes that refuse a peer rather than blame its frames (Rule 4).
_REFUSALS: Final = frozenset(("bad_token", "unknown_node", "handshake_timeout", wire.NODE_REPLACED))
#: A Close frame's reason is at most 123 bytes of UTF-8.
_CLOSE_REASON_BYTES: Final = 120

Out = TypeVar("Out")
In = TypeVar("In")

Pack = Callable[[Out, Callable[[], Out | None]], Iterable[bytes]]
"""The frames for one wake-up of the writer: `pack(first, take)` gets the first queued item
and may call `take()` for each further one already queued (None when there is none)."""


class ChannelClosed(Exception):
    """The channel is closing or closed: its outbox takes nothing more."""


class MalformedFrame(wire.WireError):
    """The peer sent a frame that does not decode; it was told so and the channel closes
    (Rule 3)."""


class Channel(Generic[Out, In]):
    """One side of a session's websocket: outbox, writer, reader, heartbeat (module
    docstring). The side runs `write` (and `heartbeat`, if it pings) as tasks and calls
    `receive` from its reader task."""

    def __init__(
        self,
        websocket: WebSocketConnection,
        *,
        decode: Callable[[bytes | str], In],
        pack: Pack[Out],
        heard: Callable[[], None] | None = None,
    ) -> None:
        """`heard`, when given, is called whenever anything arrives from the peer (a
        message, a ping, a pong), where the installed trio-websocket lets that be watched
        (`schemas.compat.trio_websocket`)."""
        self.websocket = websocket
        self._decode = decode
        self._pack = pack
        self._outbox, self._queued = trio.open_memory_channel[Out](OUTBOX_SIZE)
        self._closing = False
        self._close_code = NORMAL_CLOSURE
        self._close_reason = ""
        self._last_frame: bytes | None = None
        self._unsent = 0
        """Items queued and not yet sent by the writer (Rule 1's exception waits for 0)."""
        if heard is not None:
            watch_arrivals(websocket, heard)

    @property
    def closing(self) -> bool:
        """Whether `close` (or `reject`) was called: the outbox takes nothing more."""
        return self._closing

    @property
    def outbox_used(self) -> int:
        """Items queued for the writer right now."""
        return self._outbox.statistics().current_buffer_used

    # --- sending (Rule 1) ----------------------------------------------------------------

    async def send(self, item: Out) -> None:
        """Queue `item` for the writer; waits only while the outbox is full.

        Not a checkpoint when there is room: a producer that goes on to wait for an answer
        yields there, and the items queued without a yield in between leave together.
        Raises `ChannelClosed` once the channel is closing."""
        self._unsent += 1  # before any wait: the writer may send it before this resumes
        try:
            try:
                self._outbox.send_nowait(item)
            except trio.WouldBlock:
                await self._outbox.send(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self._unsent -= 1
            raise ChannelClosed from None
        except BaseException:  # cancelled while waiting for room: not queued
            self._unsent -= 1
            raise

    def send_nowait(self, item: Out) -> None:
        """Queue `item` without waiting: raises `trio.WouldBlock` when the outbox is full
        and `ChannelClosed` once the channel is closing."""
        try:
            self._outbox.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ChannelClosed from None
        self._unsent += 1

    async def send_now(self, frame: bytes) -> bool:
        """Write `frame` as one message right away, when nothing queued waits to be sent
        and the socket takes it (Rule 1's exception): True when it went out, False when
        the caller should queue it (`send`). A checkpoint only when the socket took part
        of the frame: the rest is written before this returns (shielded: a frame is whole
        or the connection ends, which a peer taking nothing for `STALLED_WRITE_S` does).
        Raises `ChannelClosed` when the connection ended under it."""
        if self._closing or self._unsent:
            return False
        rest = write_now(self.websocket, frame)
        if rest is None:
            return False
        if rest:
            try:
                await write_rest(self.websocket, rest, stalled_s=STALLED_WRITE_S)
            except ConnectionClosed:
                raise ChannelClosed from None
        return True

    def close(self, code: int = NORMAL_CLOSURE, reason: str = "") -> None:
        """Close on purpose (Rule 2): the writer sends what is queued, then a Close with
        `code` and `reason`, and returns. The first call decides; with no writer running
        (the session is over) this only stops the outbox."""
        if self._closing:
            return
        self._closing = True
        self._close_code = code
        self._close_reason = reason
        self._outbox.close()

    def reject(self, code: str, reason: str) -> None:
        """Close after telling the peer why: `reject{code, reason}` goes out after what is
        queued, then the Close (Rules 2 and 4)."""
        if self._closing:
            return
        self._last_frame = wire.encode(wire.Reject(code=code, reason=reason))
        self.close(close_code_for(code), reason)

    async def write(self) -> None:
        """The one writer (Rules 1 and 2). Returns once the channel closed on purpose and
        the Close went out (or `CLOSE_TIMEOUT_S` passed); raises `ConnectionClosed` when
        the connection closed under it."""
        queued = self._queued
        pack = self._pack
        send_message = self.websocket.send_message

        taken = 0

        def take() -> Out | None:
            nonlocal taken
            try:
                item = queued.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return None
            taken += 1
            return item

        websocket = self.websocket
        async with queued:
            async for first in queued:
                taken = 1
                frames = list(pack(first, take))
                if taken > 1:  # behind its producers: the usual way lets them queue more
                    for frame in frames:
                        await send_message(frame)
                else:
                    for frame in frames:
                        rest = write_now(websocket, frame)
                        if rest is None:
                            await send_message(frame)
                        elif rest:
                            await write_rest(websocket, rest, stalled_s=STALLED_WRITE_S)
                self._unsent -= taken
        with trio.move_on_after(CLOSE_TIMEOUT_S):
            if self._last_frame is not None:
                await send_message(self._last_frame)
            await self.websocket.aclose(self._close_code, close_reason(self._close_reason))

    def release(self) -> None:
        """The side is done with the channel (Rule 7): no writer or reader runs any more.
        Drops the side's callbacks; the outbox takes nothing more."""
        self.close()
        self._pack = _packed_nothing
        unwatch_arrivals(self.websocket)
        restore_messages(self.websocket)

    # --- receiving (Rule 3) --------------------------------------------------------------

    async def receive(self) -> In:
        """The peer's next message. Raises `ConnectionClosed` once the connection closed,
        and `MalformedFrame` for a frame that does not decode (the peer is rejected)."""
        frame = await self.websocket.get_message()
        try:
            return self._decode(frame)
        except wire.WireError as exc:
            self.reject("bad_frame", str(exc))
            raise MalformedFrame(str(exc)) from None

    async def receive_each(self, handle: Callable[[In], object]) -> None:
        """Hand every message to `handle` as it arrives, in order, until the connection
        ends (Rule 3): raises `ConnectionClosed` then, `MalformedFrame` for a frame that
        does not decode (the peer is rejected), and whatever `handle` raised (nothing is
        delivered after it). `handle` must not wait: where the installed trio-websocket
        lets it, it runs in that library's reader task, which reads on only after it."""
        websocket = self.websocket
        faults: list[Exception] = []
        waiting = trio.CancelScope()

        def arrived(frame: bytes | str) -> None:
            if faults or websocket.closed is not None:
                return  # a fault ended the delivery, or this side closed: as `receive`
            try:
                message = self._decode(frame)
            except wire.WireError as exc:
                self.reject("bad_frame", str(exc))
                faults.append(MalformedFrame(str(exc)))
            else:
                try:
                    handle(message)
                except Exception as exc:
                    faults.append(exc)
            if faults:
                waiting.cancel()

        if not divert_messages(websocket, arrived):
            while True:
                handle(await self.receive())
        try:
            with waiting:
                while not faults:  # diverted: the queue only says when the connection ended
                    arrived(await websocket.get_message())
        except ConnectionClosed:
            if not faults:
                raise
        finally:
            restore_messages(websocket)
        raise faults[0]

    # --- liveness (Rule 5) ---------------------------------------------------------------

    async def heartbeat(
        self,
        due: Callable[[], Awaitable[object]],
        timeout_s: float,
        answered: Callable[[], object] = lambda: None,
    ) -> None:
        """Ping each time `due()` returns, and call `answered()` when the answer comes.
        Returns when a ping went unanswered for `timeout_s` (the peer is silent); raises
        `ConnectionClosed` when the connection closed or began closing."""
        while True:
            await due()
            with trio.move_on_after(timeout_s) as waited:
                await self.websocket.ping()
            if waited.cancelled_caught:
                return
            answered()

    async def drop(self) -> None:
        """Close the connection without a closing handshake (`drop`)."""
        await drop(self.websocket)


def _packed_nothing(_first: object, _take: Callable[[], object]) -> Iterable[bytes]:
    """A released channel's `Pack` (Rule 7): its writer is over, nothing is sent."""
    return ()


async def drop(websocket: WebSocketConnection) -> None:
    """Close `websocket` without a closing handshake: a silent peer would only make us
    wait for its answer. (Cancelled at once, `aclose` still closes the socket.)"""
    with trio.move_on_after(0):
        await websocket.aclose(GOING_AWAY)


async def reject_and_close(websocket: WebSocketConnection, code: str, reason: str) -> None:
    """Tell a peer why, then close (Rule 4), where no channel writer runs yet (a
    handshake) or any more (a replaced session). Bounded by `REJECT_TIMEOUT_S` and
    shielded, so the courtesy is paid even by a task being cancelled; indifferent to a
    peer already gone."""
    with trio.move_on_after(REJECT_TIMEOUT_S, shield=True):
        try:
            await websocket.send_message(wire.encode(wire.Reject(code=code, reason=reason)))
            await websocket.aclose(close_code_for(code), close_reason(reason))
        except ConnectionClosed:
            pass


def close_code_for(reject_code: str) -> int:
    """The Close code that follows a `reject` with `reject_code` (Rule 4)."""
    return POLICY_VIOLATION if reject_code in _REFUSALS else PROTOCOL_ERROR


def close_reason(text: str) -> str:
    """`text` cut to fit a Close frame's reason (at most 123 bytes of UTF-8), never in the
    middle of a character."""
    return text.encode()[:_CLOSE_REASON_BYTES].decode(errors="ignore")


def describe_close(exc: ConnectionClosed) -> str:
    """One readable line for a connection that closed: `NAME (code): reason`."""
    reason = exc.reason
    if reason is None:
        return "closed"
    detail = f": {reason.reason}" if reason.reason else ""
    return f"{reason.name} ({reason.code}){detail}"
