"""The Node's link to its Edge: dial out, handshake, serve the session, reconnect forever.

Lifecycle of one connection (SPEC §3):

1. Dial the Edge (`ws://` or `wss://`) and send `hello{protocol, node_id, token,
   agent_version}`; expect `welcome` within the handshake timeout. A `reject` is logged
   with its reason and backed off near the cap (see `backoff`): a bad token or unknown
   node id does not fix itself in half a second.
2. Build the adapter registry from `welcome.node_config`, start the reader, then the
   health monitor, whose first `status` goes out once the initial probes finished.
3. Serve until the session ends. The session is a nursery of named tasks:
   - the *writer*, the only task that sends on the websocket, draining a bounded outbox
     channel that every producer (runs, health, acks) feeds;
   - the *reader*, dispatching `run`, `cancel` and `refresh`;
   - the *keepalive*, pinging the Edge and dropping the connection when no pong comes
     back within a bounded time (the Edge pings us too and drops a silent Node);
   - the *stopper*, which turns a graceful stop into a drain (below);
   - the registries' run nurseries and the health monitor.
4. A malformed frame from the Edge is answered with `reject{code: bad_frame}` and the
   connection is closed; anything unexpected the Edge sends is logged, never fatal.
   Closing on purpose means: close the outbox, let the writer flush what is queued,
   close the websocket with a code, end the session.
5. Whatever ended the session (Edge gone, ping timeout, reject, a bug), the runs of that
   session are cancelled with it (the Edge fails runs of a lost Node itself) and the link
   reconnects after the backoff delay, forever.

A graceful stop (`NodeLink.stop()`, SIGTERM) tells the Edge every provider is now
`unavailable` so nothing new is routed here, refuses runs that still arrive
(`run_failed{code: node_stopping, retryable}`), lets active runs finish within the drain
timeout, then closes the connection with "going away" (1001).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import trio
import wsproto.events
import wsproto.utilities
from trio_websocket import (
    CloseReason,
    ConnectionClosed,
    ConnectionRejected,
    ConnectionTimeout,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
)

from iop_node.backoff import Backoff, BackoffPolicy
from iop_node.health import DEFAULT_PROBE_TIMEOUT_S, HealthMonitor
from iop_node.registry import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_RETIRING,
    AdapterFactory,
    AdapterRegistry,
    RegistryBuildError,
    RegistryManager,
    create_adapter,
)
from schemas import limits
from schemas.config import NodeConfig
from schemas.wire import (
    PROTOCOL_VERSION,
    Cancel,
    EdgeToNode,
    FailureCode,
    FrameTooLarge,
    Hello,
    Message,
    ProviderStatus,
    Refresh,
    RefreshAck,
    Reject,
    Run,
    RunFailed,
    Status,
    Welcome,
    WireError,
    decode_from_edge,
    encode,
    encode_bounded,
)

log = logging.getLogger(__name__)

#: Messages queued for the writer; producers wait (back-pressure) when it is full.
OUTBOX_SIZE = 256
#: Bounds on what the writer sends with one write to the socket (see `_FrameSender`).
BATCH_MAX_MESSAGES = 64
BATCH_MAX_BYTES = 256 * 1024
#: Runs carry whole request bodies; the library default (1 MiB) is too small for them.
#: The same bound as the Edge's.
MAX_FRAME_BYTES = limits.MAX_FRAME_BYTES
#: Bytes asked of the socket per read. The library default (4 KiB) splits every request
#: body of a few KiB into several reads, each a trip through the event loop; the Edge
#: reads with the same size.
RECEIVE_BUFFER_BYTES = 256 * 1024
#: Messages the connection's reader may parse ahead of ours. The library default (1) makes
#: its reader wait for ours after every message; with room, the messages of one socket
#: read are parsed in one go. (The Edge keeps the default: before a peer has
#: authenticated, every queued message may be up to MAX_FRAME_BYTES.)
MESSAGE_QUEUE_SIZE = 64
#: Bound on a closing handshake, ours or the Edge's.
CLOSE_TIMEOUT_S = 5.0
#: Heartbeat timeout when not given: about three missed pings, as the Edge does.
HEARTBEAT_MISSES = 3

_GOING_AWAY = 1001
_PROTOCOL_ERROR = 1002
_ABNORMAL_CLOSURE = 1006
#: Why a write failed when the library has not recorded a reason (yet).
_BROKEN = CloseReason(_ABNORMAL_CLOSURE, "connection broke while sending")


@dataclass(frozen=True, slots=True)
class LinkSettings:
    """Everything the link needs; the token is kept out of `repr` (and so out of logs)."""

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
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    max_retiring: int = DEFAULT_MAX_RETIRING
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    adapter_factory: AdapterFactory = create_adapter

    def __post_init__(self) -> None:
        if not self.edge_url.startswith(("ws://", "wss://")):
            raise ValueError(f"edge url must start with ws:// or wss://, got {self.edge_url!r}")


@dataclass(frozen=True, slots=True)
class _Outcome:
    """How one connection attempt ended; decides the backoff rule to apply."""

    kind: Literal["unreachable", "rejected", "ended"]
    reason: str
    uptime_s: float = 0.0


class NodeLink:
    """The Node's connection to its Edge, reconnecting forever until stopped."""

    def __init__(self, settings: LinkSettings, *, rng: random.Random | None = None) -> None:
        self.settings = settings
        self._backoff = Backoff(settings.backoff, rng)
        self._stop_requested = trio.Event()
        self._session: _Session | None = None
        self.sessions = 0
        """How many sessions were welcomed so far (reconnects included)."""

    @property
    def connected(self) -> bool:
        return self._session is not None

    def stop(self) -> None:
        """Ask for a graceful stop: drain the active runs, close, and make `run` return."""
        self._stop_requested.set()

    async def run(
        self, *, task_status: trio.TaskStatus[NodeLink] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Connect and serve, reconnecting forever; returns only after `stop()`.

        Startable: reports started (with this link) once the first session is live: the
        Edge welcomed us, the registry is built and the first `status` is queued."""
        ready = _Once(lambda: task_status.started(self))
        while not self._stop_requested.is_set():
            outcome = await self._connect_once(ready)
            if self._stop_requested.is_set():
                break
            match outcome.kind:
                case "rejected":
                    delay_s = self._backoff.after_reject()
                case "ended":
                    delay_s = self._backoff.after_session(outcome.uptime_s)
                case _:
                    delay_s = self._backoff.after_failure()
            log.warning("%s; reconnecting in %.2fs", outcome.reason, delay_s)
            with trio.move_on_after(delay_s):
                await self._stop_requested.wait()
        log.info("node link stopped")

    async def _connect_once(self, ready: _Once) -> _Outcome:
        settings = self.settings
        outcome: _Outcome | None = None
        try:
            async with open_websocket_url(
                settings.edge_url,
                max_message_size=MAX_FRAME_BYTES,
                message_queue_size=MESSAGE_QUEUE_SIZE,
                receive_buffer_size=RECEIVE_BUFFER_BYTES,
                connect_timeout=settings.handshake_timeout_s,
                disconnect_timeout=CLOSE_TIMEOUT_S,
            ) as ws:
                outcome = await self._handshake_and_serve(ws, ready)
        except (HandshakeError, ConnectionClosed, OSError, trio.TooSlowError) as exc:
            if outcome is None:
                outcome = _Outcome(
                    "unreachable", f"edge {settings.edge_url} unreachable: {_describe(exc)}"
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

    async def _handshake_and_serve(self, ws: WebSocketConnection, ready: _Once) -> _Outcome:
        settings = self.settings
        hello = Hello(
            protocol=PROTOCOL_VERSION,
            node_id=settings.node_id,
            token=settings.token,
            agent_version=settings.agent_version,
        )
        with trio.fail_after(settings.handshake_timeout_s):
            await ws.send_message(encode(hello))
            frame = await ws.get_message()
        try:
            message = decode_from_edge(frame)
        except WireError as exc:
            await _reject_and_close(ws, "bad_frame", str(exc))
            return _Outcome("unreachable", f"edge sent a malformed handshake frame: {exc}")
        match message:
            case Welcome(protocol=protocol) if protocol != PROTOCOL_VERSION:
                reason = f"edge speaks protocol {protocol}, this node speaks {PROTOCOL_VERSION}"
                await _reject_and_close(ws, "protocol_version", reason)
                return _Outcome("rejected", reason)
            case Welcome():
                log.info(
                    "connected to edge %s (%s) as node %s, config revision %s",
                    message.edge_id,
                    settings.edge_url,
                    settings.node_id,
                    message.revision,
                )
                self.sessions += 1
                session = _Session(settings, ws, message, self._stop_requested)
                self._session = session
                try:
                    return await session.serve(ready)
                finally:
                    self._session = None
            case Reject(code=code, reason=reason):
                log.error("edge rejected node %s: %s (%s)", settings.node_id, reason, code)
                return _Outcome("rejected", f"edge rejected the handshake: {code}")
            case _:
                reason = f"expected welcome, got {type(message).__name__}"
                await _reject_and_close(ws, "protocol_error", reason)
                return _Outcome("unreachable", f"edge broke the handshake: {reason}")


class _Session:
    """One welcomed connection: its tasks, outbox, registries and health monitor."""

    def __init__(
        self,
        settings: LinkSettings,
        ws: WebSocketConnection,
        welcome: Welcome,
        stop_requested: trio.Event,
    ) -> None:
        self._settings = settings
        self._stop_requested = stop_requested
        self._ws = ws
        self._welcome = welcome
        self._outbox, self._outbox_out = trio.open_memory_channel[Message](OUTBOX_SIZE)
        self._sender = _FrameSender(ws)
        self._nursery: trio.Nursery | None = None
        self._registries: RegistryManager | None = None
        self._health_scope: trio.CancelScope | None = None
        self._end_reason: str | None = None
        self._close_code = 1000
        self._stopping = False
        self._first_status_sent = trio.Event()

    async def serve(self, ready: _Once) -> _Outcome:
        """Run the session until it ends; never raises for anything the Edge does."""
        started_at = trio.current_time()
        interval_s = self._settings.ping_interval_s or self._welcome.heartbeat_s
        timeout_s = self._settings.ping_timeout_s or HEARTBEAT_MISSES * interval_s
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._registries = RegistryManager(
                nursery,
                self.send,
                drain_timeout_s=self._settings.drain_timeout_s,
                max_retiring=self._settings.max_retiring,
                factory=self._settings.adapter_factory,
            )
            nursery.start_soon(self._write, name="node link writer")
            nursery.start_soon(self._keepalive, interval_s, timeout_s, name="node link keepalive")
            registry = await self._apply_welcome()
            nursery.start_soon(self._read, name="node link reader")
            nursery.start_soon(self._stop_when_asked, name="node link stopper")
            if registry is not None:
                self._watch_health(registry)
            await self._first_status_sent.wait()
            ready()
        uptime_s = trio.current_time() - started_at
        return _Outcome("ended", self._end_reason or "session ended", uptime_s)

    # --- outbound ----------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        """Queue `message` for the writer; dropped quietly once the session is closing.

        Does not yield while the outbox has room: a stream's chunks that arrived in one
        upstream read are all queued before the writer runs, so they leave in one write
        (see `_write`). The producer still yields at its next read of the upstream, and
        waits here (back-pressure) only when the outbox is full."""
        try:
            try:
                self._outbox.send_nowait(message)
            except trio.WouldBlock:
                await self._outbox.send(message)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            log.debug("session closing: dropped %s", type(message).__name__)

    async def _write(self) -> None:
        """The only task that sends messages: each wake-up sends what the outbox holds.

        A stream puts one `run_chunk` per token in the outbox; while one batch is being
        written, the next ones queue up, and they go out together with one write (see
        `_FrameSender`). Nothing waits for a batch to fill: the first message of a batch
        is sent as soon as it arrives, so batching never adds latency, and it grows only
        when producers are ahead of the socket."""
        outbox = self._outbox_out
        async with outbox:
            try:
                async for message in outbox:
                    frames = [_bounded_frame(message)]
                    size = len(frames[0])
                    while len(frames) < BATCH_MAX_MESSAGES and size < BATCH_MAX_BYTES:
                        try:
                            frame = _bounded_frame(outbox.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        frames.append(frame)
                        size += len(frame)
                    await self._sender.send(frames)
            except ConnectionClosed as exc:
                self._end(f"connection to the edge closed: {_describe(exc)}")
                return
        # The outbox was closed on purpose: everything queued is sent, now close.
        with trio.move_on_after(CLOSE_TIMEOUT_S):
            await self._ws.aclose(self._close_code, _close_reason(self._end_reason or ""))
        self._end("session closed")

    def _close(self, reason: str, code: int) -> None:
        """End the session on purpose after flushing the outbox (see `_write`)."""
        if self._end_reason is None:
            self._end_reason = reason
        self._close_code = code
        self._outbox.close()

    async def _abort(self) -> None:
        """Drop the connection without a closing handshake: a silent peer would only make
        us wait for its answer. (Cancelled at once, `aclose` still closes the socket.)"""
        with trio.move_on_after(0):
            await self._ws.aclose(_GOING_AWAY)

    def _end(self, reason: str) -> None:
        if self._end_reason is None:
            self._end_reason = reason
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # --- liveness ----------------------------------------------------------------------

    async def _keepalive(self, interval_s: float, timeout_s: float) -> None:
        while True:
            await trio.sleep(interval_s)
            try:
                with trio.fail_after(timeout_s):
                    await self._ws.ping()
            except trio.TooSlowError:
                self._end(f"no pong from the edge within {timeout_s:g}s")
                await self._abort()
                return
            except ConnectionClosed as exc:
                self._end(f"connection to the edge closed: {_describe(exc)}")
                return

    # --- inbound -----------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            try:
                frame = await self._ws.get_message()
            except ConnectionClosed as exc:
                self._end(f"connection to the edge closed: {_describe(exc)}")
                return
            try:
                message = decode_from_edge(frame)
            except WireError as exc:
                log.error("malformed frame from the edge, closing: %s", exc)
                await self.send(Reject(code="bad_frame", reason=str(exc)))
                self._close(f"sent bad_frame reject: {exc}", _PROTOCOL_ERROR)
                return
            try:
                await self._dispatch(message)
            except Exception:  # never let one message take the session down
                log.exception("failed to handle %s from the edge", type(message).__name__)

    async def _dispatch(self, message: EdgeToNode) -> None:
        registries = self._registries
        assert registries is not None
        match message:
            case Run():
                await registries.start_run(message)
            case Cancel(run_id=run_id):
                if not registries.cancel_run(run_id):
                    log.debug("cancel for run %s, which is not active here", run_id)
            case Refresh():
                await self._refresh(message)
            case Reject(code=code, reason=reason):
                log.error("edge rejected the session: %s (%s)", reason, code)
                self._end(f"edge rejected the session: {code}")
            case Welcome():
                log.warning("ignoring a second welcome on an established session")

    async def _refresh(self, refresh: Refresh) -> None:
        error: str | None = None
        if self._stopping:
            error = "the node is stopping"
        else:
            assert self._registries is not None
            previous = self._registries.current
            try:
                registry = await self._apply(refresh.revision, refresh.node_config)
            except RegistryBuildError as exc:
                error = str(exc)
                log.error(
                    "refresh to revision %s failed, keeping the old registry: %s",
                    refresh.revision,
                    error,
                )
            else:
                log.info("config revision %s is live", refresh.revision)
                if registry is not previous:
                    self._watch_health(registry)
        await self.send(RefreshAck(revision=refresh.revision, ok=error is None, error=error))

    # --- registries and health ---------------------------------------------------------

    async def _apply(self, revision: int, config: NodeConfig) -> AdapterRegistry:
        """Make `config` the live registry; raises `RegistryBuildError` (nothing changed)."""
        assert self._registries is not None
        if config.node_id != self._settings.node_id:
            raise RegistryBuildError(
                f"config is for node {config.node_id!r}, this node is {self._settings.node_id!r}"
            )
        return await self._registries.apply(revision, config)

    async def _apply_welcome(self) -> AdapterRegistry | None:
        """Build the welcome's registry. On failure the session stays up with no providers
        (runs fail with `unknown_provider`), tells the Edge why in `status`, and waits for
        a refresh to fix it."""
        assert self._registries is not None
        welcome = self._welcome
        try:
            return await self._apply(welcome.revision, welcome.node_config)
        except RegistryBuildError as exc:
            log.error("cannot build providers from config revision %s: %s", welcome.revision, exc)
            await self._registries.apply(
                welcome.revision, NodeConfig(node_id=self._settings.node_id)
            )
            detail = f"node could not build its providers: {exc}"
            await self._report_status(
                [
                    ProviderStatus(id=provider.id, health="unavailable", detail=detail)
                    for provider in welcome.node_config.providers
                ]
            )
            return None

    def _watch_health(self, registry: AdapterRegistry) -> None:
        """Monitor `registry`'s adapters, and stop monitoring the previous registry's."""
        assert self._nursery is not None
        if self._health_scope is not None:
            self._health_scope.cancel()
        scope = self._health_scope = trio.CancelScope()
        monitor = HealthMonitor(
            registry.adapters, self._report_status, probe_timeout_s=self._settings.probe_timeout_s
        )

        async def monitor_health() -> None:
            with scope:
                await monitor.run()

        self._nursery.start_soon(monitor_health, name=f"health of revision {registry.revision}")

    async def _report_status(self, statuses: list[ProviderStatus]) -> None:
        await self.send(Status(providers=statuses))
        self._first_status_sent.set()

    # --- graceful stop -----------------------------------------------------------------

    async def _stop_when_asked(self) -> None:
        await self._stop_requested.wait()
        assert self._registries is not None
        self._stopping = True
        if self._health_scope is not None:
            self._health_scope.cancel()
        current = self._registries.current
        if current is not None:
            log.info("stopping: draining %d active run(s)", current.active_runs)
            detail = "node is shutting down"
            await self._report_status(
                [
                    ProviderStatus(id=provider_id, health="unavailable", detail=detail)
                    for provider_id in current.adapters
                ]
            )
        await self._registries.aclose()
        self._close("node stopped", _GOING_AWAY)


class _FrameSender:
    """Send several binary websocket messages with one write to the socket.

    trio-websocket sends every message with its own `send_all`: one system call, one TCP
    segment and one wake-up of the Edge's reader per message, and for a stream that is
    one per token. Profiles of a streaming Node showed that path as its largest cost. The
    library has no call to send several messages at once, so this one frames each message
    with the connection's own wsproto state and writes the frames with a single
    `send_all` under the connection's send lock: exactly what the library's `_send` does
    for one message. The bytes on the wire are the frames `send_message` would write, in
    the same order, so the Edge sees the very same websocket messages.

    That reaches into the connection's private attributes (trio-websocket 0.12). They are
    looked up once, here; with a library version that lacks any of them, `send` falls
    back to one `send_message` per frame, which is slower and equally correct.
    """

    def __init__(self, ws: WebSocketConnection) -> None:
        self._ws = ws
        self._batching = all(hasattr(ws, name) for name in ("_wsproto", "_stream", "_stream_lock"))

    @property
    def batching(self) -> bool:
        """Whether messages are written together (False: the library's own path)."""
        return self._batching

    async def send(self, frames: list[bytes]) -> None:
        """Send each of `frames` as one binary message, in order.

        Raises `ConnectionClosed` when the connection is closed or breaks, as
        `send_message` does."""
        ws = self._ws
        if not self._batching or len(frames) == 1:
            for frame in frames:
                await ws.send_message(frame)
            return
        if ws.closed is not None:
            raise ConnectionClosed(ws.closed)
        protocol = ws._wsproto
        try:
            data = b"".join(
                protocol.send(wsproto.events.BytesMessage(data=frame)) for frame in frames
            )
        except wsproto.utilities.LocalProtocolError:
            # A closing handshake was started (by an abort) but not yet recorded.
            raise ConnectionClosed(ws.closed or _BROKEN) from None
        async with ws._stream_lock:
            try:
                await ws._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # The reader notices the broken socket too and records why; the session
                # ends either way.
                raise ConnectionClosed(ws.closed or _BROKEN) from None


class _Once:
    """Call a function the first time only (signalling `started` once across sessions)."""

    def __init__(self, function: Callable[[], object]) -> None:
        self._function: Callable[[], object] | None = function

    def __call__(self) -> None:
        function, self._function = self._function, None
        if function is not None:
            function()


async def _reject_and_close(ws: WebSocketConnection, code: str, reason: str) -> None:
    """Tell the Edge why we hang up, then close; bounded, and indifferent to a dead peer."""
    with trio.move_on_after(CLOSE_TIMEOUT_S):
        try:
            await ws.send_message(encode(Reject(code=code, reason=reason)))
            await ws.aclose(_PROTOCOL_ERROR, _close_reason(reason))
        except ConnectionClosed:
            pass


def _bounded_frame(message: Message) -> bytes:
    """`message` encoded, or, when it would exceed the wire's frame limit (the Edge would
    drop the link and every run on it), a smaller message saying so: the run's failure
    for a run event, an empty status for anything else (logged either way)."""
    try:
        return encode_bounded(message)
    except FrameTooLarge as exc:
        log.error("not sent to the Edge: %s", exc)
        run_id = getattr(message, "run_id", None)
        if isinstance(run_id, str):
            failed = RunFailed(run_id=run_id, code=FailureCode.RESPONSE_TOO_LARGE, message=str(exc))
            return encode(failed)
        return encode(Status(providers=[]))


def _close_reason(text: str) -> str:
    """A websocket close reason is at most 123 bytes of UTF-8."""
    return text.encode()[:120].decode(errors="ignore")


def _describe(exc: BaseException) -> str:
    """One readable line for why a connection failed or ended."""
    if isinstance(exc, ConnectionClosed):
        if exc.reason is None:
            return "closed"
        detail = f": {exc.reason.reason}" if exc.reason.reason else ""
        return f"{exc.reason.name} ({exc.reason.code}){detail}"
    if isinstance(exc, ConnectionRejected):
        return f"websocket upgrade refused with HTTP {exc.status_code}"
    if isinstance(exc, ConnectionTimeout | trio.TooSlowError):
        return "timed out"
    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, HandshakeError) and cause is not None:
        return str(cause) or type(cause).__name__
    return str(exc) or type(exc).__name__
