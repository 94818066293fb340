"""The node hub: the Edge's node listener, handshakes, and the session of each node.

The hub accepts websocket connections from Nodes, checks each `hello` and keeps at most
one `NodeSession` (see `session.py`) per node id; a second connection for the same id
replaces the first (the old one's runs fail as `node_lost`, which is retryable before
the caller saw a byte). Replacement is how a restarted Node gets past its own half-dead
connection; it is also what two Nodes started with the same id do to each other, so
both sides hear about it: the Edge logs both peers, and the replaced connection gets a
`reject{node_replaced}` naming the newcomer before it is closed.

Rules:
1. A connection must send a valid `hello` within `handshake_timeout_s`; the token is
   checked against the node's `token_hash_sha256` in constant time. Anything else gets a
   `reject{code, reason}` and a close, never an exception that escapes the handler.
   Waiting handshakes are bounded per source and in total by a `HandshakeGate`, which
   evicts the oldest anonymous peer instead of refusing a newcomer (see `handshakes`),
   so idle upgrades can never lock a Node out.
2. Until its `hello` checked out a peer may send messages of at most
   `PRE_AUTH_MAX_FRAME_BYTES`; afterwards the wire's `MAX_FRAME_BYTES`.
3. When a session ends for any reason, its runs hear `lost()` (node lost) and the
   scheduler learns the node is gone. Connects and disconnects are logged with the
   peer's address and the reason the session ended. Once the connection is closed, the
   hub lets go of the session and says so (`on_ended`: the Edge's heap keeper watches
   that it is freed). What a peer sent (a node id before its hello checked out, an agent
   version) shows in a log line only through `core.peer_text.logged`.
4. Nothing a peer sends ends the listener: an unexpected error while serving one
   connection is logged and ends that connection only.
5. After `goaway` (the Edge is going away, `goaway_all`) a node links again; if that
   reaches this Edge (it still accepts nodes), the old session is not replaced but
   retired: new runs go to the new session, the old one ends once its runs are done.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest

from iop_edge.core.configuration.tokens import tokens_match
from iop_edge.core.peer_text import logged
from iop_edge.runtime.nodes.handshakes import MAX_PENDING_HANDSHAKES, HandshakeGate, source_key
from iop_edge.runtime.nodes.heartbeat import HeartbeatGrid
from iop_edge.runtime.nodes.session import (
    LoadListener,
    NodeSession,
    RefreshAckListener,
    StatusListener,
    peer_address,
)
from schemas import wire
from schemas.channel import TRY_AGAIN_LATER, reject_and_close
from schemas.compat.trio_websocket import MESSAGE_LIMIT_LIFTABLE, lift_message_limit
from schemas.config import NodeConfig
from schemas.limits import MAX_FRAME_BYTES

log = logging.getLogger(__name__)

#: The `hello.features` this Edge acts on (a Node's other words are ignored).
_KNOWN_FEATURES: Final = frozenset({wire.FEATURE_PROBE, wire.FEATURE_PINS})
#: How much of a node id an unauthenticated peer sent its log lines show.
_NODE_ID_LOGGED: Final = 128


#: Bound on closing a connection politely (a closing handshake with a peer we are done with).
COURTESY_CLOSE_S: Final = 0.2
#: The message limit before a peer's `hello` checked out (a `hello` is a few hundred bytes):
#: an anonymous peer cannot make the Edge assemble 64 MiB messages (Rule 2).
PRE_AUTH_MAX_FRAME_BYTES: Final = 64 * 1024
#: What the node listener allows from a connection's first message on.
LISTENER_MAX_FRAME_BYTES: Final = (
    PRE_AUTH_MAX_FRAME_BYTES if MESSAGE_LIMIT_LIFTABLE else MAX_FRAME_BYTES
)
#: How long a peer has from its upgrade to a `hello` that checks out (a Node sends it at
#: once: one round trip), and the listener's bound on the upgrade itself.
HANDSHAKE_TIMEOUT_S: Final = 5.0

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "LISTENER_MAX_FRAME_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_PENDING_HANDSHAKES",
    "PRE_AUTH_MAX_FRAME_BYTES",
    "NodeDirectory",
    "NodeHub",
]


@dataclass(frozen=True, slots=True)
class NodeDirectory:
    """What the hub needs from the current snapshot to admit a node."""

    edge_id: str
    revision: int
    token_hash: Callable[[str], str | None]
    node_config: Callable[[str], NodeConfig]
    config_time: float = 0.0
    """When this Edge took its config (unix seconds): a node serving several Edges runs
    the newest config."""


class NodeHub:
    """Owns the node sessions. Callbacks tell the scheduler about connects and health."""

    def __init__(
        self,
        directory: Callable[[], NodeDirectory],
        *,
        on_connect: Callable[[str], None],
        on_disconnect: Callable[[str], None],
        on_status: StatusListener,
        on_load: LoadListener | None = None,
        on_ack: RefreshAckListener | None = None,
        on_ended: Callable[[NodeSession], None] | None = None,
        heartbeat_s: float = 5.0,
        heartbeat_timeout_s: float = 15.0,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self._directory = directory
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._on_status = on_status
        self._on_load = on_load
        self._on_ack = on_ack
        self._on_ended = on_ended
        self.heartbeat_s = heartbeat_s
        self.heartbeats = HeartbeatGrid(heartbeat_s, heartbeat_timeout_s)
        """Looks at every session (`run_heartbeats`, owned by the Edge's nursery)."""
        self.handshake_timeout_s = handshake_timeout_s
        self._sessions: dict[str, NodeSession] = {}
        self.handshakes = HandshakeGate()

    async def run_heartbeats(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep the heartbeat grid's time (session Rule 5) until cancelled."""
        task_status.started()
        await self.heartbeats.run()

    def session(self, node_id: str) -> NodeSession | None:
        return self._sessions.get(node_id)

    def connected_nodes(self) -> frozenset[str]:
        return frozenset(self._sessions)

    def sessions(self) -> list[NodeSession]:
        return list(self._sessions.values())

    async def handle(self, request: WebSocketRequest) -> None:
        """trio-websocket handler for one incoming node connection (Rule 4: an error
        here ends this connection, never the listener)."""
        try:
            await self._handle(request)
        except Exception:
            log.exception("node connection from %s failed", peer_address(request))

    async def _handle(self, request: WebSocketRequest) -> None:
        ticket = self.handshakes.admit(source_key(_remote(request)))
        websocket: WebSocketConnection | None = None
        hello: wire.Hello | None = None
        try:
            with ticket.scope:  # cancelled if a newer peer evicts this one (Rule 1)
                websocket = await request.accept()
                hello = await self._handshake(websocket)
        except ConnectionClosed:
            return
        finally:
            self.handshakes.release(ticket)
        if ticket.evicted:
            log.info("anonymous node peer %s evicted by newer handshakes", peer_address(request))
            if websocket is not None:
                with trio.move_on_after(COURTESY_CLOSE_S, shield=True):
                    await websocket.aclose(
                        code=TRY_AGAIN_LATER, reason="too many pending handshakes"
                    )
            return
        if hello is None or websocket is None:
            return
        await self._serve_session(hello, websocket)

    async def _serve_session(self, hello: wire.Hello, websocket: WebSocketConnection) -> None:
        lift_message_limit(websocket, MAX_FRAME_BYTES)
        directory = self._directory()
        session = NodeSession(
            hello.node_id,
            websocket,
            applied_revision=directory.revision,
            on_status=self._on_status,
            on_load=self._on_load,
            on_ack=self._on_ack,
            features=frozenset(hello.features) & _KNOWN_FEATURES,
        )
        peer = peer_address(websocket)
        previous = self._sessions.get(hello.node_id)
        if previous is not None and previous.goaway_sent:
            # Rule 5: the node answered our `goaway` by linking again; new runs go to the
            # new session, the old one ends once the runs still on it are done.
            log.info("node %s linked again after goaway; its old session drains", hello.node_id)
            previous.retire()
        elif previous is not None:
            log.warning(
                "node %s connected again from %s while its session from %s was open; the "
                "new connection replaces it (if this repeats, two Nodes share the node id %s)",
                hello.node_id,
                peer,
                peer_address(previous.websocket),
                hello.node_id,
            )
            previous.replace(peer)
        self._sessions[hello.node_id] = session
        welcome = wire.Welcome(
            protocol=wire.PROTOCOL_VERSION,
            edge_id=directory.edge_id,
            revision=directory.revision,
            node_config=directory.node_config(hello.node_id),
            heartbeat_s=self.heartbeat_s,
            config_time=directory.config_time,
        )
        session.send_nowait(welcome)  # the first frame: the outbox has room
        # The session outlives the snapshot the directory reads: a refresh replaces it,
        # and this frame must not keep it alive (nor the welcome, a Node's whole config).
        del directory, welcome
        log.info(
            "node %s connected from %s (%s), config revision %d",
            hello.node_id,
            peer,
            logged(hello.agent_version) if hello.agent_version else "unknown agent",
            session.applied_revision,
        )
        self._on_connect(hello.node_id)
        try:
            await session.serve(self.heartbeats)
        finally:
            if self._sessions.get(hello.node_id) is session:
                del self._sessions[hello.node_id]
                self._on_disconnect(hello.node_id)
                log.info("node %s disconnected (%s): %s", hello.node_id, peer, session.end_reason)
            if session.replaced_by is not None:
                # Tell the replaced Node why (bounded): a duplicate id is then named in
                # its log too, and it stops fighting for the id (iop_node.uplink.backoff rule 5).
                await reject_and_close(
                    websocket,
                    wire.NODE_REPLACED,
                    f"a new connection for node id '{hello.node_id}' from "
                    f"{session.replaced_by} replaced this one: is a second Node running "
                    "with the same id?",
                )
            # Courtesy close, bounded: the peer may already be gone. When the Edge itself
            # is being cancelled, so is the connection's reader, which would hear the
            # peer's answer: the socket is closed without waiting for it.
            stopping = trio.current_effective_deadline() == -math.inf
            with trio.move_on_after(0 if stopping else COURTESY_CLOSE_S, shield=True):
                await websocket.aclose()
            if self._on_ended is not None:
                self._on_ended(session)

    async def _handshake(self, websocket: WebSocketConnection) -> wire.Hello | None:
        with trio.move_on_after(self.handshake_timeout_s):
            frame = await websocket.get_message()
            try:
                message = wire.decode_from_node(frame)
            except wire.WireError as exc:
                await reject_and_close(websocket, "bad_frame", str(exc))
                return None
            if not isinstance(message, wire.Hello):
                await reject_and_close(
                    websocket, "protocol_error", f"expected hello, got {message.__class__.__name__}"
                )
                return None
            if message.protocol != wire.PROTOCOL_VERSION:
                log.warning(
                    "node %s from %s speaks protocol %s, this Edge %s: rejected",
                    logged(message.node_id, _NODE_ID_LOGGED),
                    peer_address(websocket),
                    message.protocol,
                    wire.PROTOCOL_VERSION,
                )
                await reject_and_close(
                    websocket,
                    "unsupported_protocol",
                    f"protocol {message.protocol} is not supported; "
                    f"this Edge speaks {wire.PROTOCOL_VERSION}",
                )
                return None
            expected = self._directory().token_hash(message.node_id)
            if expected is None:
                log.warning(
                    "node %s from %s is not in the Edge config: rejected",
                    logged(message.node_id, _NODE_ID_LOGGED),
                    peer_address(websocket),
                )
                await reject_and_close(
                    websocket,
                    "unknown_node",
                    f"node id '{message.node_id}' is not in the Edge config",
                )
                return None
            if not tokens_match(message.token, expected):
                log.warning(
                    "node %s from %s presented a bad token: rejected",
                    logged(message.node_id, _NODE_ID_LOGGED),
                    peer_address(websocket),
                )
                await reject_and_close(websocket, "bad_token", "the node token does not match")
                return None
            return message
        await reject_and_close(
            websocket, "handshake_timeout", "no hello within the handshake timeout"
        )
        return None

    def abort_all(self) -> None:
        for session in list(self._sessions.values()):
            session.abort("the edge is shutting down")

    async def goaway_all(self, reason: str) -> None:
        """Send `goaway` to every connected node (design §3): each dials this Edge's address
        again for new runs and keeps its session here only for the runs on it. The
        caller bounds the wait (a node whose outbox is full makes us wait for room)."""
        async with trio.open_nursery() as nursery:
            for session in list(self._sessions.values()):
                nursery.start_soon(session.goaway, reason)


def _remote(request: WebSocketRequest) -> object:
    """The peer's address without its port, as handshakes are counted per source (an
    `Endpoint` has one; a Unix socket is a string)."""
    remote = request.remote
    return getattr(remote, "address", remote)
