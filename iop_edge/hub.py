"""The node hub: the Edge's side of the runtime wire.

Each connected Node has one `NodeSession`: a websocket, one writer task fed by a bounded
outbox (so frames never interleave), a reader that routes run events to the run that
owns them, and a heartbeat that drops a silent peer. The hub keeps at most one session
per node id; a second connection for the same id replaces the first (the old one's runs
fail as `node_lost`, which is retryable before the caller saw a byte).

Rules:
1. A connection must send a valid `hello` within `handshake_timeout_s`; the token is
   checked against the node's `token_hash_sha256` in constant time. Anything else gets a
   `reject{code, reason}` and a close, never an exception that escapes the handler.
   At most `MAX_PENDING_HANDSHAKES` unauthenticated connections wait at once; more are
   refused with HTTP 503 before the websocket opens.
2. A malformed frame from a connected Node gets a `reject{bad_frame}` and a close.
3. When a session ends for any reason, every run it carried sees its event channel
   closed (`EndOfChannel` = node lost) and the scheduler learns the node is gone.
4. The reader never waits on one run: each run has a bounded buffer of chunks, and a
   caller that falls a whole buffer behind loses its run (`caller_too_slow`, cancelled
   on the Node) instead of stalling every other run and the heartbeat of its Node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest

from iop_edge.tokens import tokens_match
from schemas import wire
from schemas.config import NodeConfig

log = logging.getLogger(__name__)

RunEvent = wire.RunChunk | wire.RunDone | wire.RunFailed

OUTBOX_SIZE = 256
RUN_EVENT_BUFFER = 1024
MAX_FRAME_BYTES = 64 * 1024 * 1024
#: The message limit before a peer's `hello` checked out (a `hello` is a few hundred bytes):
#: an anonymous peer cannot make the Edge assemble 64 MiB messages. Lifted to
#: MAX_FRAME_BYTES once the node is authenticated (see `MESSAGE_LIMIT_LIFTABLE`).
PRE_AUTH_MAX_FRAME_BYTES = 64 * 1024
#: Whether this trio-websocket keeps its message limit where `_lift_message_limit` can
#: raise it per connection (it has no public call for that). Without it the listener
#: must allow MAX_FRAME_BYTES from the first message on.
MESSAGE_LIMIT_LIFTABLE: Final = (
    "_max_message_size" in WebSocketConnection.__init__.__code__.co_names
)
MAX_PENDING_HANDSHAKES = 16


class SessionClosed(Exception):
    """The node's connection is gone; nothing more can be sent on it."""


@dataclass(eq=False)
class NodeSession:
    node_id: str
    websocket: WebSocketConnection
    connected_at: float
    applied_revision: int
    _outbox_send: trio.MemorySendChannel[bytes] = field(init=False)
    _outbox_recv: trio.MemoryReceiveChannel[bytes] = field(init=False)
    _runs: dict[str, trio.MemorySendChannel[RunEvent]] = field(default_factory=dict)
    _acks: dict[int, trio.MemorySendChannel[wire.RefreshAck]] = field(default_factory=dict)
    _on_abandon: dict[str, Callable[[wire.RunFailed], None]] = field(default_factory=dict)
    _pending_cancels: set[str] = field(default_factory=set)
    _scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    closed: trio.Event = field(default_factory=trio.Event)

    def __post_init__(self) -> None:
        self._outbox_send, self._outbox_recv = trio.open_memory_channel[bytes](OUTBOX_SIZE)

    # --- sending ---------------------------------------------------------------------

    async def send(self, message: wire.Message) -> None:
        """Queue a frame for the writer; waits only while the outbox is full.

        Not a checkpoint when there is room: a caller that goes on to wait for the
        answer yields there, and the writer runs then."""
        if self.closed.is_set():
            raise SessionClosed(self.node_id)
        frame = wire.encode(message)
        try:
            try:
                self._outbox_send.send_nowait(frame)
            except trio.WouldBlock:
                await self._outbox_send.send(frame)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise SessionClosed(self.node_id) from None

    def post(self, message: wire.Message) -> bool:
        """Queue a frame without waiting; False when the session is closed or saturated.

        Used from cleanup paths (e.g. `cancel` from a `finally`) that must not block.
        """
        if self.closed.is_set():
            return False
        try:
            self._outbox_send.send_nowait(wire.encode(message))
        except trio.WouldBlock:
            if isinstance(message, wire.Cancel):
                # A cancel must never be lost, or the provider keeps running a run whose
                # slot the Edge already gave back: the writer sends it after this frame.
                self._pending_cancels.add(message.run_id)
                return True
            return False
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        return True

    # --- runs ------------------------------------------------------------------------

    def open_run(self, run_id: str) -> trio.MemoryReceiveChannel[RunEvent]:
        """Register a run; its events arrive on the returned channel until it closes."""
        if self.closed.is_set():
            raise SessionClosed(self.node_id)
        # One spare slot so the terminal event always fits behind a full buffer of chunks.
        send, receive = trio.open_memory_channel[RunEvent](RUN_EVENT_BUFFER + 1)
        self._runs[run_id] = send
        return receive

    def on_abandon(self, run_id: str, callback: Callable[[wire.RunFailed], None]) -> None:
        """Call `callback(reason)` (synchronously) if the hub gives up on the run's consumer."""
        if run_id in self._runs:
            self._on_abandon[run_id] = callback

    def close_run(self, run_id: str) -> None:
        self._on_abandon.pop(run_id, None)
        channel = self._runs.pop(run_id, None)
        if channel is not None:
            channel.close()

    async def request_refresh(self, revision: int, node_config: NodeConfig) -> wire.RefreshAck:
        """Push a node-specific config and wait for its ack (the caller bounds the wait)."""
        send, receive = trio.open_memory_channel[wire.RefreshAck](1)
        self._acks[revision] = send
        try:
            await self.send(wire.Refresh(revision=revision, node_config=node_config))
            with receive:
                try:
                    return await receive.receive()
                except trio.EndOfChannel:
                    raise SessionClosed(self.node_id) from None
        finally:
            self._acks.pop(revision, None)

    # --- lifecycle -------------------------------------------------------------------

    def abort(self) -> None:
        """End the session now (replacement by a newer connection, or Edge shutdown)."""
        self._scope.cancel()

    def _finish(self) -> None:
        self.closed.set()
        self._outbox_send.close()
        for channel in self._runs.values():
            channel.close()
        self._runs.clear()
        self._on_abandon.clear()
        for ack in self._acks.values():
            ack.close()
        self._acks.clear()

    async def _writer(self) -> None:
        async with self._outbox_recv:
            async for frame in self._outbox_recv:
                await self.websocket.send_message(frame)
                while self._pending_cancels:
                    run_id = self._pending_cancels.pop()
                    await self.websocket.send_message(wire.encode(wire.Cancel(run_id=run_id)))

    def _deliver(self, event: RunEvent) -> None:
        """Hand a run event to its run without ever blocking the reader (Rule 4)."""
        channel = self._runs.get(event.run_id)
        if channel is None:
            return  # a late event of a run the Edge already gave up on
        if isinstance(event, wire.RunChunk):
            if channel.statistics().current_buffer_used < RUN_EVENT_BUFFER:
                try:
                    channel.send_nowait(event)
                    return
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the consumer is gone; it already cancelled the run
                del self._runs[event.run_id]
                self._on_abandon.pop(event.run_id, None)
                return
            log.warning("run %s: caller is not reading; cancelling the run", event.run_id)
            self.post(wire.Cancel(run_id=event.run_id))
            on_abandon = self._on_abandon.pop(event.run_id, None)
            del self._runs[event.run_id]
            channel.close()
            if on_abandon is not None:
                # e.g. give the slot back now: the consumer may be stuck on its socket
                on_abandon(
                    wire.RunFailed(
                        run_id=event.run_id,
                        code="caller_too_slow",
                        message=f"the caller fell {RUN_EVENT_BUFFER} chunks behind the provider",
                    )
                )
            return
        # Terminal: the spare buffer slot guarantees it fits; then the run's stream ends.
        del self._runs[event.run_id]
        self._on_abandon.pop(event.run_id, None)
        try:
            channel.send_nowait(event)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        channel.close()

    def _route(self, message: wire.NodeToEdge, hub: NodeHub) -> None:
        match message:
            case wire.RunChunk() | wire.RunDone() | wire.RunFailed():
                self._deliver(message)
            case wire.Status():
                hub.on_status(self.node_id, message)
            case wire.RefreshAck():
                ack = self._acks.pop(message.revision, None)
                if message.ok:
                    self.applied_revision = max(self.applied_revision, message.revision)
                if ack is not None:
                    ack.send_nowait(message)
                    ack.close()
            case wire.Reject():
                log.warning("node %s rejected the session: %s", self.node_id, message.reason)
                self.abort()
            case wire.Hello():
                raise wire.WireError("hello on an established session")

    async def _reader(self, hub: NodeHub) -> None:
        while True:
            frame = await self.websocket.get_message()
            try:
                message = wire.decode_from_node(frame)
            except wire.WireError as exc:
                await _reject(self.websocket, "bad_frame", str(exc))
                return
            try:
                self._route(message, hub)
            except wire.WireError as exc:
                await _reject(self.websocket, "protocol_error", str(exc))
                return

    async def _heartbeat(self, interval_s: float, timeout_s: float) -> None:
        while True:
            await trio.sleep(interval_s)
            with trio.move_on_after(timeout_s) as scope:
                await self.websocket.ping()
            if scope.cancelled_caught:
                log.warning(
                    "node %s missed its heartbeat for %.1fs; dropping", self.node_id, timeout_s
                )
                return

    async def serve(self, hub: NodeHub, heartbeat_s: float, heartbeat_timeout_s: float) -> None:
        """Run the session until the peer goes away, misses heartbeats or is replaced."""
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer)

                    async def reader_then_stop() -> None:
                        await self._reader(hub)
                        nursery.cancel_scope.cancel()

                    async def heartbeat_then_stop() -> None:
                        await self._heartbeat(heartbeat_s, heartbeat_timeout_s)
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(reader_then_stop)
                    nursery.start_soon(heartbeat_then_stop)
        except* ConnectionClosed:
            pass
        finally:
            self._finish()


def _lift_message_limit(websocket: WebSocketConnection) -> None:
    """An authenticated node may send messages up to MAX_FRAME_BYTES (large responses)."""
    if MESSAGE_LIMIT_LIFTABLE:
        websocket._max_message_size = MAX_FRAME_BYTES


async def _reject(websocket: WebSocketConnection, code: str, reason: str) -> None:
    """Tell the peer why, then close; bounded so a stuck peer cannot hold us."""
    with trio.move_on_after(2, shield=True):
        try:
            await websocket.send_message(wire.encode(wire.Reject(code=code, reason=reason)))
            await websocket.aclose(code=1008, reason=reason[:120])
        except ConnectionClosed:
            pass


@dataclass(frozen=True, slots=True)
class NodeDirectory:
    """What the hub needs from the current snapshot to admit a node."""

    edge_id: str
    revision: int
    token_hash: Callable[[str], str | None]
    node_config: Callable[[str], NodeConfig]


class NodeHub:
    """Owns the node sessions. Callbacks tell the scheduler about connects and health."""

    def __init__(
        self,
        directory: Callable[[], NodeDirectory],
        *,
        on_connect: Callable[[str], None],
        on_disconnect: Callable[[str], None],
        on_status: Callable[[str, wire.Status], None],
        heartbeat_s: float = 5.0,
        heartbeat_timeout_s: float = 15.0,
        handshake_timeout_s: float = 10.0,
    ) -> None:
        self._directory = directory
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self.on_status = on_status
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self._sessions: dict[str, NodeSession] = {}
        self._pending_handshakes = trio.CapacityLimiter(MAX_PENDING_HANDSHAKES)

    def session(self, node_id: str) -> NodeSession | None:
        return self._sessions.get(node_id)

    def connected_nodes(self) -> frozenset[str]:
        return frozenset(self._sessions)

    def sessions(self) -> list[NodeSession]:
        return list(self._sessions.values())

    async def handle(self, request: WebSocketRequest) -> None:
        """trio-websocket handler for one incoming node connection."""
        try:
            self._pending_handshakes.acquire_nowait()
        except trio.WouldBlock:
            # Before a `hello` is checked a peer is anonymous, yet it holds a connection
            # and buffers (up to PRE_AUTH_MAX_FRAME_BYTES): bound how many can at once.
            with trio.move_on_after(2, shield=True):
                try:
                    await request.reject(503, body=b"too many pending node handshakes")
                except ConnectionClosed:
                    pass
            return
        try:
            websocket = await request.accept()
            hello = await self._handshake(websocket)
        except ConnectionClosed:
            return
        finally:
            self._pending_handshakes.release()
        if hello is None:
            return
        _lift_message_limit(websocket)
        directory = self._directory()
        session = NodeSession(
            node_id=hello.node_id,
            websocket=websocket,
            connected_at=trio.current_time(),
            applied_revision=directory.revision,
        )
        previous = self._sessions.get(hello.node_id)
        if previous is not None:
            log.info("node %s reconnected; replacing its previous session", hello.node_id)
            previous.abort()
        self._sessions[hello.node_id] = session
        welcome = wire.Welcome(
            protocol=wire.PROTOCOL_VERSION,
            edge_id=directory.edge_id,
            revision=directory.revision,
            node_config=directory.node_config(hello.node_id),
            heartbeat_s=self.heartbeat_s,
        )
        session.post(welcome)
        log.info("node %s connected from %s", hello.node_id, websocket.remote)
        self._on_connect(hello.node_id)
        try:
            await session.serve(self, self.heartbeat_s, self.heartbeat_timeout_s)
        finally:
            if self._sessions.get(hello.node_id) is session:
                del self._sessions[hello.node_id]
                self._on_disconnect(hello.node_id)
                log.info("node %s disconnected", hello.node_id)
            # Courtesy close; the peer may already be gone (or be cancelled with us).
            with trio.move_on_after(0.2, shield=True):
                await websocket.aclose()

    async def _handshake(self, websocket: WebSocketConnection) -> wire.Hello | None:
        with trio.move_on_after(self.handshake_timeout_s):
            frame = await websocket.get_message()
            try:
                message = wire.decode_from_node(frame)
            except wire.WireError as exc:
                await _reject(websocket, "bad_frame", str(exc))
                return None
            if not isinstance(message, wire.Hello):
                await _reject(
                    websocket, "protocol_error", f"expected hello, got {message.__class__.__name__}"
                )
                return None
            if message.protocol != wire.PROTOCOL_VERSION:
                await _reject(
                    websocket,
                    "unsupported_protocol",
                    f"protocol {message.protocol} is not supported; "
                    f"this Edge speaks {wire.PROTOCOL_VERSION}",
                )
                return None
            expected = self._directory().token_hash(message.node_id)
            if expected is None:
                await _reject(
                    websocket,
                    "unknown_node",
                    f"node id '{message.node_id}' is not in the Edge config",
                )
                return None
            if not tokens_match(message.token, expected):
                log.warning("node %s presented a bad token", message.node_id)
                await _reject(websocket, "bad_token", "the node token does not match")
                return None
            return message
        await _reject(websocket, "handshake_timeout", "no hello within the handshake timeout")
        return None

    def abort_all(self) -> None:
        for session in list(self._sessions.values()):
            session.abort()
