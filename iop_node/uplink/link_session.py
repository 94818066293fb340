"""One welcomed connection of the Node's link to an Edge: the session's tasks (writer,
reader, keepalive, load reporter, closer; `link` step 3), its outbox and its port on the
`ProviderHost`, until it ends with an `Outcome` the link's dial loop acts on."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, cast

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from iop_node.host import LinkPort, ProviderHost
from iop_node.runs.runner import Outbound
from iop_node.uplink.batch import RunEventBatch
from iop_node.uplink.link_settings import HEARTBEAT_MISSES, LinkSettings
from schemas.channel import (
    GOING_AWAY,
    Channel,
    ChannelClosed,
    MalformedFrame,
    describe_close,
)
from schemas.heartbeat import seconds_to_next_ping
from schemas.wire import (
    PERMANENT_REJECTIONS,
    Cancel,
    EdgeToNode,
    FrameTooLarge,
    GoAway,
    Message,
    ModelCommand,
    Probe,
    Refresh,
    RefreshAck,
    Reject,
    Run,
    Status,
    Welcome,
    decode_from_edge,
    encode,
    encode_bounded,
)

#: The link's log: a session's lines are its link's (one logger to follow a link by).
log = logging.getLogger("iop_node.uplink.link")


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one connection attempt ended; decides the backoff rule to apply."""

    kind: Literal["unreachable", "rejected", "ended"]
    reason: str
    uptime_s: float = 0.0
    code: str = ""
    """The `reject` code, for kind `rejected`."""

    @property
    def permanent(self) -> bool:
        return self.kind == "rejected" and self.code in PERMANENT_REJECTIONS


class LinkState(Protocol):
    """What a session reads of its link: its settings, and whether and how it stops."""

    @property
    def settings(self) -> LinkSettings: ...

    @property
    def stop_requested(self) -> bool: ...

    @property
    def retiring(self) -> bool: ...


class LinkSession:
    """One welcomed connection: its tasks, its outbox, its port on the host."""

    def __init__(
        self,
        link: LinkState,
        host: ProviderHost,
        ws: WebSocketConnection,
        welcome: Welcome,
        on_goaway: Callable[[], None],
    ) -> None:
        """`on_goaway`: the Edge said `goaway` (the link dials it again at once)."""
        self._link = link
        self._settings = link.settings
        self._host = host
        self._welcome = welcome
        self._on_goaway = on_goaway
        self._channel = Channel[Outbound, EdgeToNode](
            ws, decode=decode_from_edge, pack=_pack_outbound
        )
        self._nursery: trio.Nursery | None = None
        self._port: LinkPort | None = None
        self._end_reason: str | None = None
        self._rejected: Reject | None = None
        self._wind_down = trio.Event()
        self.goaway_received = False

    async def serve(self, ready: Callable[[], None]) -> Outcome:
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
            return Outcome("rejected", self._rejected.reason, uptime_s, code=self._rejected.code)
        return Outcome("ended", self._end_reason or "session ended", uptime_s)

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
        self._on_goaway()
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
