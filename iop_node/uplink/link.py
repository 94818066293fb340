"""The Node's link to one Edge: dial out, handshake, serve sessions, reconnect forever.

Lifecycle of one connection (design §3):

1. Dial the Edge (`ws://` or `wss://`; or one address of a named Edge, see `dial`) and
   send `hello{protocol, node_id, token, agent_version}`; expect `welcome` within the
   handshake timeout. A permanent `reject` (bad token, unknown node id, protocol; see
   `wire.PERMANENT_REJECTIONS`) is logged with its reason and retried a few times,
   slowly; then `run` raises `EdgeRejected` and the process exits non-zero (see `backoff`
   rule 5). So does a session the Edge ends with `reject{node_replaced}`: another Node
   connected with our id.
2. Attach to the Node's `ProviderHost` (the providers every link shares), apply the
   welcome's config there (the newest config any Edge sent wins, see `host`), start the
   reader; the link is ready once its Edge was sent the providers' status.
3. Serve until the session ends (`link_session`). The session is the Node's end of the
   channel both processes share (`schemas.channel`), run as a nursery of named tasks:
   - the *writer*, the channel's one writer, draining the bounded outbox that every
     producer (runs, health, acks, load) feeds, run events packed into one message;
   - the *reader*, dispatching `run`, `cancel`, `refresh` and `goaway`;
   - the *keepalive*, the channel's heartbeat at this Node's instant of the shared grid,
     dropping the connection when no pong comes back within a bounded time (the Edge
     pings a silent Node too, and drops it);
   - the *load reporter*, telling this Edge how many runs the Node's *other* Edge links
     hold per provider whenever that changes (promptly while a provider is at half its
     capacity or more, lazily below; and right after a `busy` answer);
   - the *closer*, which turns a graceful stop (or a finished goaway) into a clean close.
4. A malformed frame from the Edge is answered with `reject{code: bad_frame}` and the
   connection is closed (the channel's Rule 3); anything unexpected the Edge sends is
   logged, never fatal. Closing on purpose means: close the outbox, let the writer flush
   what is queued, close the websocket with a code, end the session.
5. Whatever ended the session (Edge gone, ping timeout, reject, a bug), the host cancels
   the runs of that session (the Edge fails runs of a lost Node itself) and the link
   reconnects after the backoff delay (fast after a healthy session: the Edge is likely
   restarting).
6. `goaway` from the Edge (it is restarting or stopping): the link dials the Edge's
   address again at once, for new runs, while the old session keeps serving what its
   Edge still sends; that Edge closes it once its runs are done (or, if it never does,
   the Node closes it once idle after `goaway_linger_s`).

A graceful stop of the Node (SIGTERM) is the host's: it tells every Edge that every
provider is now `draining`, refuses runs that still arrive (`run_failed{code:
node_stopping, retryable}`) and lets active runs finish within the drain timeout; then
each session closes with "going away" (1001). `retire()` stops one link alone (an
address that left its DNS name): no more dials, sessions close once their runs are done.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Final

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    ConnectionTimeout,
    HandshakeError,
    WebSocketConnection,
)

from iop_node.host import ProviderHost
from iop_node.uplink.backoff import Backoff
from iop_node.uplink.dial import describe_refused_upgrade, open_edge_websocket
from iop_node.uplink.link_session import LinkSession, Outcome
from iop_node.uplink.link_settings import MAX_FRAME_BYTES, MESSAGE_QUEUE_SIZE, LinkSettings
from schemas.channel import (
    CLOSE_TIMEOUT_S,
    RECEIVE_BUFFER_BYTES,
    describe_close,
    drop,
    reject_and_close,
)
from schemas.wire import (
    FEATURE_PINS,
    FEATURE_PROBE,
    NODE_REPLACED,
    PROTOCOL_VERSION,
    Hello,
    Reject,
    Welcome,
    WireError,
    decode_from_edge,
    encode,
)

log = logging.getLogger(__name__)


#: What to do about each permanent rejection, for the message a Node exits with.
REJECTION_ADVICE: Final[dict[str, str]] = {
    "bad_token": (
        "the token does not match the node's token_hash_sha256 in the Edge config: check "
        "--token-file / IOP_NODE_TOKEN, or put the hash of this token "
        "(iop-edge hash-token < FILE) into nodes[].token_hash_sha256 and restart the Edge"
    ),
    "unknown_node": (
        "add a nodes[] entry with this id to the Edge config and restart the Edge, or fix --node-id"
    ),
    "unsupported_protocol": "run the same IOP version on the Edge and the Node",
    "protocol_version": "run the same IOP version on the Edge and the Node",
    NODE_REPLACED: (
        "another Node connected with the same node id; give every Node its own id "
        "(nodes[].id in the Edge config) and start this one again"
    ),
}


class EdgeRejected(Exception):
    """The Edge refused this Node permanently, several times in a row (backoff rule 5)."""

    def __init__(self, edge_url: str, node_id: str, code: str, reason: str, times: int) -> None:
        advice = REJECTION_ADVICE.get(code, "fix the Edge or Node configuration")
        super().__init__(
            f"the Edge at {edge_url} refused node '{node_id}' {times} time(s): "
            f"{reason} ({code}). To fix: {advice}."
        )
        self.code = code
        self.reason = reason


class _Connection:
    """One connection attempt, as the link's dial loop follows it."""

    def __init__(self) -> None:
        self.decided = trio.Event()
        """Set when the loop may move on: a `goaway` came, or the connection ended."""
        self.goaway = False
        self.outcome: Outcome | None = None
        self.session: LinkSession | None = None
        self.scope = trio.CancelScope()

    def going_away(self) -> None:
        self.goaway = True
        self.decided.set()

    def ended(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.decided.set()


class NodeLink:
    """The Node's connection to one Edge, reconnecting forever until stopped."""

    def __init__(
        self,
        settings: LinkSettings,
        host: ProviderHost,
        *,
        rng: random.Random | None = None,
        on_ready: Callable[[], object] | None = None,
    ) -> None:
        self.settings = settings
        self._host = host
        self._backoff = Backoff(settings.backoff, rng)
        self._on_ready = _Once(on_ready or (lambda: None))
        self._stop_requested = trio.Event()
        self._retiring = False
        self._sessions: set[LinkSession] = set()
        self._connections: set[_Connection] = set()
        self.sessions = 0
        """How many sessions were welcomed so far (reconnects and redials included)."""

    @property
    def connected(self) -> bool:
        """Whether a session that takes new runs is up (one not told to go away)."""
        return any(not session.goaway_received for session in self._sessions)

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    @property
    def retiring(self) -> bool:
        return self._retiring

    def stop(self) -> None:
        """The Node is stopping: dial no more; sessions close once the host drained."""
        self._stop_requested.set()

    def retire(self) -> None:
        """This Edge address is no longer wanted: dial no more; sessions close once the
        runs on them are done (the rest of the Node goes on)."""
        self._retiring = True
        self._stop_requested.set()

    async def run(
        self, *, task_status: trio.TaskStatus[NodeLink] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Connect and serve, reconnecting until stopped; returns only after `stop()` or
        `retire()`, once every session of this link closed.

        Raises `EdgeRejected` when the Edge refused this Node permanently a few times in
        a row (bad token, unknown id, protocol, or another Node took the id).

        Startable: reports started (with this link) once the first session is live: the
        Edge welcomed us and the providers' status is on its way."""
        ready = _Once(lambda: task_status.started(self))
        async with trio.open_nursery() as connections:
            while not self._stop_requested.is_set():
                connection = _Connection()
                connections.start_soon(self._connect, connection, ready)
                await wait_first(connection.decided.wait, self._stop_requested.wait)
                if self._stop_requested.is_set():
                    break
                if connection.goaway:
                    log.info("edge %s is going away: dialling it again", self.settings.label)
                    self._backoff.after_goaway()  # backoff Rule 6: back within a second
                    continue
                outcome = connection.outcome
                assert outcome is not None
                if outcome.permanent:
                    rejected_delay = self._backoff.after_reject(outcome.uptime_s)
                    if rejected_delay is None:
                        raise EdgeRejected(
                            self.settings.label,
                            self.settings.node_id,
                            outcome.code,
                            outcome.reason,
                            self._backoff.rejections,
                        )
                    delay_s = rejected_delay
                elif outcome.kind == "ended":
                    delay_s = self._backoff.after_session(outcome.uptime_s)
                else:
                    delay_s = self._backoff.after_failure()
                log.warning("%s; reconnecting in %.2fs", outcome.reason, delay_s)
                with trio.move_on_after(delay_s):
                    await self._stop_requested.wait()
            for pending in list(self._connections):
                if pending.session is None:
                    pending.scope.cancel()  # a dial in progress has nothing to finish
            for session in list(self._sessions):
                session.wind_down()
        log.info("link to edge %s stopped", self.settings.label)

    async def _connect(self, connection: _Connection, ready: _Once) -> None:
        self._connections.add(connection)
        try:
            with connection.scope:
                outcome = await self._connect_once(connection, ready)
                if connection.goaway:
                    log.info("old link to edge %s closed: %s", self.settings.label, outcome.reason)
                connection.ended(outcome)
        finally:
            self._connections.discard(connection)

    async def _connect_once(self, connection: _Connection, ready: _Once) -> Outcome:
        settings = self.settings
        outcome: Outcome | None = None
        try:
            async with open_edge_websocket(
                settings.edge_url,
                settings.address,
                max_message_size=MAX_FRAME_BYTES,
                message_queue_size=MESSAGE_QUEUE_SIZE,
                receive_buffer_size=RECEIVE_BUFFER_BYTES,
                connect_timeout=settings.handshake_timeout_s,
                disconnect_timeout=CLOSE_TIMEOUT_S,
            ) as ws:
                outcome = await self._handshake_and_serve(ws, connection, ready)
        except (HandshakeError, ConnectionClosed, OSError, trio.TooSlowError) as exc:
            if outcome is None:
                outcome = Outcome(
                    "unreachable", f"edge {settings.label} unreachable: {_describe(exc)}"
                )
        except trio.BrokenResourceError as exc:
            if outcome is None:
                outcome = Outcome("unreachable", f"connection to the edge broke: {exc!r}")
        except Exception as exc:  # a bug must not stop a Node that runs unattended
            log.exception("node link failed unexpectedly")
            if outcome is None:
                outcome = Outcome("unreachable", f"link error: {type(exc).__name__}")
        assert outcome is not None
        return outcome

    async def _handshake_and_serve(
        self, ws: WebSocketConnection, connection: _Connection, ready: _Once
    ) -> Outcome:
        settings = self.settings
        hello = Hello(
            protocol=PROTOCOL_VERSION,
            node_id=settings.node_id,
            token=settings.token,
            agent_version=settings.agent_version,
            features=[FEATURE_PROBE, FEATURE_PINS],
        )
        frame: str | bytes | None = None
        with trio.move_on_after(settings.handshake_timeout_s):
            await ws.send_message(encode(hello))
            frame = await ws.get_message()
        if frame is None:  # reachable, yet silent: it would not answer a Close either
            await drop(ws)
            return Outcome(
                "unreachable",
                f"edge {settings.label} took the connection but sent no welcome within "
                f"{settings.handshake_timeout_s:g}s",
            )
        try:
            message = decode_from_edge(frame)
        except WireError as exc:
            await reject_and_close(ws, "bad_frame", str(exc))
            return Outcome("unreachable", f"edge sent a malformed handshake frame: {exc}")
        match message:
            case Welcome(protocol=protocol) if protocol != PROTOCOL_VERSION:
                reason = f"edge speaks protocol {protocol}, this node speaks {PROTOCOL_VERSION}"
                await reject_and_close(ws, "protocol_version", reason)
                return Outcome("rejected", reason, code="protocol_version")
            case Welcome():
                log.info(
                    "connected to edge %s (%s) as node %s, config revision %s",
                    message.edge_id,
                    settings.label,
                    settings.node_id,
                    message.revision,
                )
                self.sessions += 1
                session = LinkSession(self, self._host, ws, message, connection.going_away)
                connection.session = session
                self._sessions.add(session)
                try:
                    return await session.serve(_Both(ready, self._on_ready))
                finally:
                    self._sessions.discard(session)
            case Reject(code=code, reason=reason):
                log.error(
                    "edge %s rejected node %s: %s (%s)",
                    settings.label,
                    settings.node_id,
                    reason,
                    code,
                )
                return Outcome("rejected", reason, code=code)
            case _:
                reason = f"expected welcome, got {type(message).__name__}"
                await reject_and_close(ws, "protocol_error", reason)
                return Outcome("unreachable", f"edge broke the handshake: {reason}")


async def wait_first(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return as soon as any of `waits` returns (the others are cancelled)."""
    async with trio.open_nursery() as nursery:

        async def wait(function: Callable[[], Awaitable[object]]) -> None:
            await function()
            nursery.cancel_scope.cancel()

        for function in waits:
            nursery.start_soon(wait, function)


class _Both:
    """Call two callbacks as one (the session's `ready`: the run's and the link's)."""

    def __init__(self, first: Callable[[], object], second: Callable[[], object]) -> None:
        self._first = first
        self._second = second

    def __call__(self) -> None:
        self._first()
        self._second()


class _Once:
    """Call a function the first time only (signalling `started` once across sessions)."""

    def __init__(self, function: Callable[[], object]) -> None:
        self._function: Callable[[], object] | None = function

    def __call__(self) -> None:
        function, self._function = self._function, None
        if function is not None:
            function()


def _describe(exc: BaseException) -> str:
    """One readable line for why a connection failed or ended."""
    if isinstance(exc, ConnectionClosed):
        return describe_close(exc)
    if isinstance(exc, ConnectionRejected):
        return describe_refused_upgrade(exc)
    if isinstance(exc, ConnectionTimeout | trio.TooSlowError):
        return "timed out"
    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, HandshakeError) and cause is not None:
        return str(cause) or type(cause).__name__
    return str(exc) or type(exc).__name__
