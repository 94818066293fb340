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
3. Serve until the session ends. The session is the Node's end of the channel both
   processes share (`schemas.channel`), run as a nursery of named tasks:
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
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, Literal, cast

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    ConnectionTimeout,
    HandshakeError,
    WebSocketConnection,
)

from iop_node.backoff import Backoff, BackoffPolicy
from iop_node.batch import RunEventBatch
from iop_node.dial import describe_refused_upgrade, open_edge_websocket
from iop_node.host import LinkPort, ProviderHost
from iop_node.runner import Outbound
from schemas import limits
from schemas.channel import (
    CLOSE_TIMEOUT_S,
    GOING_AWAY,
    RECEIVE_BUFFER_BYTES,
    Channel,
    ChannelClosed,
    MalformedFrame,
    describe_close,
    drop,
    reject_and_close,
)
from schemas.heartbeat import seconds_to_next_ping
from schemas.wire import (
    FEATURE_PINS,
    FEATURE_PROBE,
    NODE_REPLACED,
    PERMANENT_REJECTIONS,
    PROTOCOL_VERSION,
    Cancel,
    EdgeToNode,
    FrameTooLarge,
    GoAway,
    Hello,
    Message,
    ModelCommand,
    Probe,
    Refresh,
    RefreshAck,
    Reject,
    Run,
    Status,
    Welcome,
    WireError,
    decode_from_edge,
    encode,
    encode_bounded,
)

log = logging.getLogger(__name__)

#: Runs carry whole request bodies; the library default (1 MiB) is too small for them.
MAX_FRAME_BYTES = limits.MAX_FRAME_BYTES
#: Messages the connection's reader may parse ahead of ours. The library default (1) makes
#: its reader wait for ours after every message; with room, the messages of one socket
#: read are parsed in one go. (The Edge keeps the default: before a peer has
#: authenticated, every queued message may be up to MAX_FRAME_BYTES.)
MESSAGE_QUEUE_SIZE = 64
#: Heartbeat timeout when not given: about three missed pings, as the Edge does.
HEARTBEAT_MISSES = 3
#: Fewest seconds between two `load` reports on one link: a burst of run starts and ends
#: on other links costs this link one message, not one per run. (Capacity never depends
#: on it: a run that finds no slot is answered `busy`.)
LOAD_REPORT_INTERVAL_S = 0.01
#: Fewest seconds between two `load` reports while no provider is under pressure (less
#: than half its slots held): the others' runs then only shape ranking.
LOAD_REPORT_RELAXED_S = 0.25
#: After `goaway`, how long the Node waits for the Edge to close the old link before it
#: closes it itself (once that link's runs are done).
GOAWAY_LINGER_S = 30.0


@dataclass(frozen=True, slots=True)
class LinkSettings:
    """Everything one link needs; the token is kept out of `repr` (and so out of logs)."""

    edge_url: str
    node_id: str
    token: str = field(repr=False)
    agent_version: str = ""
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    handshake_timeout_s: float = 10.0
    ping_interval_s: float | None = None
    """None: use the `heartbeat_s` the Edge announces in `welcome`."""
    ping_timeout_s: float | None = None
    """None: `HEARTBEAT_MISSES` ping intervals."""
    address: str | None = None
    """Dial this IP address instead of the URL's host (one address of a named Edge)."""
    load_report_interval_s: float = LOAD_REPORT_INTERVAL_S
    load_report_relaxed_s: float = LOAD_REPORT_RELAXED_S
    goaway_linger_s: float = GOAWAY_LINGER_S

    def __post_init__(self) -> None:
        if not self.edge_url.startswith(("ws://", "wss://")):
            raise ValueError(f"edge url must start with ws:// or wss://, got {self.edge_url!r}")

    @property
    def label(self) -> str:
        """How logs name this link: the URL, and the address when dialled by address."""
        return self.edge_url if self.address is None else f"{self.edge_url} ({self.address})"


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


@dataclass(frozen=True, slots=True)
class _Outcome:
    """How one connection attempt ended; decides the backoff rule to apply."""

    kind: Literal["unreachable", "rejected", "ended"]
    reason: str
    uptime_s: float = 0.0
    code: str = ""
    """The `reject` code, for kind `rejected`."""

    @property
    def permanent(self) -> bool:
        return self.kind == "rejected" and self.code in PERMANENT_REJECTIONS


class _Connection:
    """One connection attempt, as the link's dial loop follows it."""

    def __init__(self) -> None:
        self.decided = trio.Event()
        """Set when the loop may move on: a `goaway` came, or the connection ended."""
        self.goaway = False
        self.outcome: _Outcome | None = None
        self.session: _Session | None = None
        self.scope = trio.CancelScope()

    def going_away(self) -> None:
        self.goaway = True
        self.decided.set()

    def ended(self, outcome: _Outcome) -> None:
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
        self._sessions: set[_Session] = set()
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

    async def _connect_once(self, connection: _Connection, ready: _Once) -> _Outcome:
        settings = self.settings
        outcome: _Outcome | None = None
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
                outcome = _Outcome(
                    "unreachable", f"edge {settings.label} unreachable: {_describe(exc)}"
                )
        except trio.BrokenResourceError as exc:
            if outcome is None:
                outcome = _Outcome("unreachable", f"connection to the edge broke: {exc!r}")
        except Exception as exc:  # a bug must not stop a Node that runs unattended
            log.exception("node link failed unexpectedly")
            if outcome is None:
                outcome = _Outcome("unreachable", f"link error: {type(exc).__name__}")
        assert outcome is not None
        return outcome

    async def _handshake_and_serve(
        self, ws: WebSocketConnection, connection: _Connection, ready: _Once
    ) -> _Outcome:
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
            return _Outcome(
                "unreachable",
                f"edge {settings.label} took the connection but sent no welcome within "
                f"{settings.handshake_timeout_s:g}s",
            )
        try:
            message = decode_from_edge(frame)
        except WireError as exc:
            await reject_and_close(ws, "bad_frame", str(exc))
            return _Outcome("unreachable", f"edge sent a malformed handshake frame: {exc}")
        match message:
            case Welcome(protocol=protocol) if protocol != PROTOCOL_VERSION:
                reason = f"edge speaks protocol {protocol}, this node speaks {PROTOCOL_VERSION}"
                await reject_and_close(ws, "protocol_version", reason)
                return _Outcome("rejected", reason, code="protocol_version")
            case Welcome():
                log.info(
                    "connected to edge %s (%s) as node %s, config revision %s",
                    message.edge_id,
                    settings.label,
                    settings.node_id,
                    message.revision,
                )
                self.sessions += 1
                session = _Session(self, ws, message, connection)
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
                return _Outcome("rejected", reason, code=code)
            case _:
                reason = f"expected welcome, got {type(message).__name__}"
                await reject_and_close(ws, "protocol_error", reason)
                return _Outcome("unreachable", f"edge broke the handshake: {reason}")


class _Session:
    """One welcomed connection: its tasks, its outbox, its port on the host."""

    def __init__(
        self,
        link: NodeLink,
        ws: WebSocketConnection,
        welcome: Welcome,
        connection: _Connection,
    ) -> None:
        self._link = link
        self._settings = link.settings
        self._host = link._host
        self._welcome = welcome
        self._connection = connection
        self._channel = Channel[Outbound, EdgeToNode](
            ws, decode=decode_from_edge, pack=_pack_outbound
        )
        self._nursery: trio.Nursery | None = None
        self._port: LinkPort | None = None
        self._end_reason: str | None = None
        self._rejected: Reject | None = None
        self._wind_down = trio.Event()
        self.goaway_received = False

    async def serve(self, ready: Callable[[], None]) -> _Outcome:
        """Run the session until it ends; never raises for anything the Edge does."""
        started_at = trio.current_time()
        interval_s = self._settings.ping_interval_s or self._welcome.heartbeat_s
        timeout_s = self._settings.ping_timeout_s or HEARTBEAT_MISSES * interval_s
        host = self._host
        port = self._port = host.attach(self.send, self._settings.label)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._write, name="node link writer")
                nursery.start_soon(
                    self._keepalive, interval_s, timeout_s, name="node link keepalive"
                )
                welcome = self._welcome
                await host.apply_welcome(
                    port, welcome.revision, welcome.node_config, welcome.config_time
                )
                nursery.start_soon(self._read, name="node link reader")
                nursery.start_soon(self._close_when_done, name="node link closer")
                nursery.start_soon(self._report_load, port, name="node link load reporter")
                if self._link.stop_requested:
                    self.wind_down()
                await port.first_status.wait()
                ready()
        finally:
            host.detach(port)
        uptime_s = trio.current_time() - started_at
        if self._rejected is not None:
            return _Outcome("rejected", self._rejected.reason, uptime_s, code=self._rejected.code)
        return _Outcome("ended", self._end_reason or "session ended", uptime_s)

    def wind_down(self) -> None:
        """The link stopped or retired: close once the host drained (a Node stopping) or
        once this session's runs are done (a retired link)."""
        self._wind_down.set()

    # --- outbound ----------------------------------------------------------------------

    async def send(self, item: Outbound) -> None:
        """Queue a message or chunk for the writer; dropped quietly once closing.

        Does not yield while the outbox has room: a stream's chunks that arrived in one
        upstream read are all queued before the writer runs, so they leave in one
        message (`_pack_outbound`). The producer still yields at its next read of the
        upstream, and waits here (back-pressure) only when the outbox is full."""
        try:
            await self._channel.send(item)
        except ChannelClosed:
            log.debug("session closing: dropped %s", type(item).__name__)

    async def _write(self) -> None:
        """The channel's one writer; the session ends when it does (the Edge closed the
        connection, or it sent our Close after what was queued)."""
        try:
            await self._channel.write()
        except ConnectionClosed as exc:
            self._end(f"connection to the edge closed: {describe_close(exc)}")
            return
        self._end("session closed")

    def _close(self, reason: str, code: int) -> None:
        """End the session on purpose after flushing the outbox (the channel's Rule 2)."""
        if self._end_reason is None:
            self._end_reason = reason
        self._channel.close(code, self._end_reason)

    def _end(self, reason: str) -> None:
        if self._end_reason is None:
            self._end_reason = reason
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # --- liveness ----------------------------------------------------------------------

    async def _keepalive(self, interval_s: float, timeout_s: float) -> None:
        """Ping the Edge once per interval, at this node's instant of the shared grid
        (`schemas.heartbeat`: the fleet's pings reach the Edge in batches)."""
        node_id = self._settings.node_id

        async def next_instant() -> None:
            await trio.sleep(seconds_to_next_ping(node_id, interval_s, time.time()))

        try:
            await self._channel.heartbeat(next_instant, timeout_s)
        except ConnectionClosed:
            # Closed or closing: by the Edge (the reader ends the session) or by us (the
            # writer is sending our Close; ending here would cancel it unsent).
            return
        self._end(f"no pong from the edge within {timeout_s:g}s")
        await self._channel.drop()

    # --- inbound -----------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            try:
                message = await self._channel.receive()
            except ConnectionClosed as exc:
                self._end(f"connection to the edge closed: {describe_close(exc)}")
                return
            except MalformedFrame as exc:  # the channel rejects it and closes
                log.error("malformed frame from the edge, closing: %s", exc)
                if self._end_reason is None:
                    self._end_reason = f"sent bad_frame reject: {exc}"
                return
            try:
                await self._dispatch(message)
            except Exception:  # never let one message take the session down
                log.exception("failed to handle %s from the edge", type(message).__name__)

    async def _dispatch(self, message: EdgeToNode) -> None:
        port = self._port
        assert port is not None
        match message:
            case Run():
                await self._host.start_run(port, message)
            case Cancel(run_id=run_id):
                if not self._host.cancel_run(port, run_id):
                    log.debug("cancel for run %s, which is not active here", run_id)
            case Refresh():
                await self._refresh(port, message)
            case ModelCommand():
                self._host.model_command(port, message)
            case Probe(providers=providers):
                self._host.probe(providers)
            case GoAway(reason=reason):
                self._goaway(reason)
            case Reject(code=code, reason=reason):
                log.error("edge ended the session: %s (%s)", reason, code)
                self._rejected = message
                self._end(f"edge ended the session: {reason} ({code})")
            case Welcome():
                log.warning("ignoring a second welcome on an established session")

    async def _refresh(self, port: LinkPort, refresh: Refresh) -> None:
        error = await self._host.apply(
            port, refresh.revision, refresh.node_config, refresh.config_time
        )
        if error is None:
            log.info("config revision %s is live", refresh.revision)
        else:
            log.error("refresh to revision %s not applied: %s", refresh.revision, error)
        await self.send(RefreshAck(revision=refresh.revision, ok=error is None, error=error))

    def _goaway(self, reason: str) -> None:
        if self.goaway_received:
            return
        self.goaway_received = True
        log.info(
            "edge %s is going away%s; %d run(s) finish on this link",
            self._settings.label,
            f" ({reason})" if reason else "",
            self._port.active_runs if self._port else 0,
        )
        self._connection.going_away()
        assert self._nursery is not None
        self._nursery.start_soon(self._close_after_goaway, name="node link goaway")

    # --- load --------------------------------------------------------------------------

    async def _report_load(self, port: LinkPort) -> None:
        """Tell this Edge what the other links hold, when it changes (module docstring).

        While a provider is under pressure (half its slots or more held: the others'
        runs decide admission) the first change after a quiet spell is reported at once,
        and what changes within the next `load_report_interval_s` goes in one report
        after it. Below that the others' runs only shape ranking, so changes are reported
        at most every `load_report_relaxed_s` (sooner if pressure comes). A link that
        never shares its Node hears no `load` (the Edge starts from zero); after a `busy`
        answer the host reports at once."""
        host = self._host
        settings = self._settings
        while True:
            version = host.load_version(port)
            await host.report_load(port)
            await trio.sleep(settings.load_report_interval_s)
            if not host.load_pressing(port):
                with trio.move_on_after(settings.load_report_relaxed_s):
                    await host.wait_load_pressing()
            await host.wait_load_changed(port, version)

    # --- closing -----------------------------------------------------------------------

    async def _close_after_goaway(self) -> None:
        """The Edge normally closes the old link itself once its runs are done; if it
        never does, close it once idle after `goaway_linger_s`."""
        await trio.sleep(self._settings.goaway_linger_s)
        assert self._port is not None
        await self._port.wait_idle()
        self._close("edge went away", GOING_AWAY)

    async def _close_when_done(self) -> None:
        await self._wind_down.wait()
        if self._link.retiring:
            assert self._port is not None
            await self._port.wait_idle()
            self._close("edge address retired", GOING_AWAY)
        else:
            await self._host.wait_drained()
            self._close("node stopped", GOING_AWAY)


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


def _pack_outbound(first: Outbound, take: Callable[[], Outbound | None]) -> list[bytes]:
    """The frames for one wake-up of the channel's writer: the run events among the
    queued items (chunks of any run, run ends) as one `run_events` message
    (`batch.RunEventBatch`), then the other messages one by one. Nothing waits for a
    batch to fill: the first item is sent as soon as it arrives, so batching never adds
    latency, and a batch grows only when producers are ahead of the socket."""
    batch = RunEventBatch()
    others: list[Message] = []
    item: Outbound | None = first
    while item is not None:
        if not batch.add(item):
            others.append(cast(Message, item))
        if batch.full:
            break
        item = take()
    frames = [encode(batch.message())] if batch else []
    frames.extend(_bounded_frame(message) for message in others)
    return frames


def _bounded_frame(message: Message) -> bytes:
    """`message` (not a run event: those travel in batches whose items the runner bounds)
    encoded, or, when it would exceed the wire's frame limit (the Edge would drop the link
    and every run on it), an empty status instead (logged)."""
    try:
        return encode_bounded(message)
    except FrameTooLarge as exc:
        log.error("not sent to the Edge: %s", exc)
        return encode(Status(providers=[]))


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
