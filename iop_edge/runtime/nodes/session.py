"""One connected Node, as the Edge sees it: a websocket session and the runs it carries.

A `NodeSession` is the Edge's end of the channel both processes share
(`schemas.channel`: one writer fed by a bounded outbox, a reader that rejects a bad frame,
the heartbeat, close codes): its reader routes each run event to the `RunSink` that owns
the run, and its heartbeat pings a silent peer when the Edge's grid says so. The hub
(`hub.py`) creates sessions after a `hello` checked out and keeps at most one per node id.

Rules:
1. The reader never waits on one run, nor on anything else: every message is routed at
   once, as trio-websocket's reader parses it (`Channel.receive_each`: no task of the
   session wakes per message). A sink takes an event without blocking or says it cannot
   keep up (its caller fell a whole buffer behind); the session then cancels that run on
   the Node and forgets it, instead of stalling every other run and the heartbeat.
2. A terminal event (`run_done`, `run_failed`) is the last a sink hears from the session;
   when the session ends for any reason, every sink still registered hears `lost()`.
3. A malformed frame from a connected Node gets a `reject{bad_frame}` and a close (the
   channel's Rule 3), a message that breaks the protocol a `reject{protocol_error}`; a
   well-formed one is still only input: its numbers and texts are checked and corrected
   (`core.node_input`) before anything acts on them.
4. A `cancel` is never dropped, even on a full outbox: otherwise the provider keeps
   running a run whose slot the Edge already gave back.
5. The heartbeat grid (`heartbeat.HeartbeatGrid`, one timer for all sessions) looks at
   the peer every interval (the first ping, if any, a whole interval after the session
   began), and a look pings it unless something arrived from it since about the
   previous look (`heard`: any frame, its own pings included: a Node pings every
   `heartbeat_s` on its own). The ping is sent by the session's heartbeat task, which
   waits for such a look without a timer. A peer that leaves a ping unanswered for the
   grid's `timeout_s` is dropped. Looks while a ping is out do nothing; after a slow
   answer, the next ping is at the next look that finds the peer silent.
6. A session that ended leaves nothing for the cyclic collector: its channel lets go of
   the session's callbacks (`Channel.release`), so the session, its websocket and its
   socket are freed by reference counting as soon as the hub and the runs let go of it
   (the Edge keeps its heap out of the collector's sight: `runtime.lifecycle.heap`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, Protocol

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest

from iop_edge.core.configuration.listen import ListenAddress
from iop_edge.core.exception_groups import sole_exception
from iop_edge.core.node_input import check_node_message
from iop_edge.core.peer_text import logged
from iop_edge.runtime.nodes.heartbeat import HeartbeatGrid
from schemas import wire
from schemas.channel import (
    OUTBOX_SIZE,
    Channel,
    ChannelClosed,
    MalformedFrame,
    describe_close,
)
from schemas.config import NodeConfig

log = logging.getLogger(__name__)

RunEnd = wire.RunDone | wire.RunFailed
RunEvent = bytes | RunEnd
"""What a run hears: caller-ready bytes (server-sent events, shaped by the Node), then
one end."""

__all__ = [
    "OUTBOX_SIZE",
    "LoadListener",
    "NodeSession",
    "RefreshAckListener",
    "RunEnd",
    "RunEvent",
    "RunSink",
    "SessionClosed",
    "SessionStatistics",
    "StatusListener",
    "peer_address",
]


class SessionClosed(Exception):
    """The node's connection is gone; nothing more can be sent on it."""


class RunSink(Protocol):
    """Where a session delivers one run's events (implemented by the run's dispatch)."""

    def push(self, event: RunEvent) -> bool:
        """Take `event` without blocking; False when the consumer cannot keep up (Rule 1).

        Returning False is final: the sink has already given the run up."""
        ...

    def lost(self) -> None:
        """The session ended before the run's terminal event."""
        ...


class StatusListener(Protocol):
    def __call__(self, node_id: str, status: wire.Status) -> None: ...


class LoadListener(Protocol):
    def __call__(self, node_id: str, load: wire.Load) -> None: ...


class RefreshAckListener(Protocol):
    """Told every `refresh_ack` the Node sends, whichever push it answers."""

    def __call__(self, node_id: str, ack: wire.RefreshAck) -> None: ...


def _ignore_load(node_id: str, load: wire.Load) -> None:
    """A node that shares no provider with another Edge never reports load."""


@dataclass(frozen=True, slots=True)
class SessionStatistics:
    """What a session holds right now (for tests and diagnostics)."""

    runs: int
    outbox_used: int
    pending_cancels: int


#: The frames `NodeSession.send` writes at once when it can: one per run or push, the
#: request path's and a fleet's refresh.
_DIRECT: Final = (wire.Run, wire.Refresh)


class _Awaited:
    """The Node's answer to one model command (`NodeSession.request_model_command`): set
    once, by `_route`, or never, when the session ends first."""

    __slots__ = ("answer", "settled")

    def __init__(self) -> None:
        self.answer: wire.ModelCommandDone | None = None
        self.settled = trio.Event()

    def settle(self, answer: wire.ModelCommandDone) -> None:
        self.answer = answer
        self.settled.set()


class NodeSession:
    """The Edge's side of one Node's websocket (see the module docstring)."""

    def __init__(
        self,
        node_id: str,
        websocket: WebSocketConnection,
        *,
        applied_revision: int,
        on_status: StatusListener,
        on_load: LoadListener | None = None,
        on_ack: RefreshAckListener | None = None,
        features: frozenset[str] = frozenset(),
    ) -> None:
        self.node_id = node_id
        self.features = features
        """What the Node said it speaks in its `hello` (`wire.FEATURE_PROBE`)."""
        self.websocket = websocket
        self._channel = Channel[bytes, wire.NodeToEdge](
            websocket, decode=wire.decode_from_node, pack=self._frames, heard=self.heard
        )
        self.applied_revision = applied_revision
        """The last config revision the node acked (or was welcomed with)."""
        self._latest_sent = applied_revision
        """The newest config revision sent to the node: no ack may name a later one."""
        self._on_status = on_status
        self._on_load = on_load or _ignore_load
        self._on_ack = on_ack
        self.goaway_sent = False
        self._retired = False
        self._retired_and_idle = trio.Event()
        """Set once: retired (`retire`) with no run left. Only then, not each time the
        session runs out of runs, so the task waiting on it wakes once."""
        self._runs: dict[str, RunSink] = {}
        self._pushes: dict[int, Callable[[wire.RefreshAck | None], None]] = {}
        """Who is told the Node's ack of each revision pushed (`push_refresh`)."""
        self._commands: dict[str, _Awaited] = {}
        self._pending_cancels: set[str] = set()
        self._scope = trio.CancelScope()
        self.closed = trio.Event()
        self.end_reason: str | None = None
        """Why the session ended (for the hub's log line); None while it runs."""
        self.replaced_by: str | None = None
        """Set when a newer connection for the same node id took this session's place:
        the hub then tells this connection's Node so with a `node_replaced` reject."""
        self._heard_at = trio.current_time()
        """When something last arrived from the peer (its `hello`, at first; Rule 5)."""
        self._ping_due = trio.Event()
        self._pinging = False

    def heard(self) -> None:
        """Something arrived from the peer: it is alive (Rule 5)."""
        self._heard_at = trio.current_time()

    def look(self, now: float, quiet_s: float) -> None:
        """The heartbeat grid's look (Rule 5): have the peer pinged if it was silent for
        `quiet_s` and no ping is out."""
        if not self._pinging and now - self._heard_at > quiet_s:
            self._pinging = True
            self._ping_due.set()

    def statistics(self) -> SessionStatistics:
        return SessionStatistics(
            runs=len(self._runs),
            outbox_used=self._channel.outbox_used,
            pending_cancels=len(self._pending_cancels),
        )

    # --- sending ---------------------------------------------------------------------

    async def send(self, message: wire.Message) -> None:
        """Send a frame: a `run` or a `refresh` push is written at once when nothing waits
        to be sent and the socket takes it (the channel's `send_now`: no wake-up of the
        writer per run or push); anything else (a `goaway`, a model command: a caller
        that may be shutting down must not wait out the rest of a begun frame), or a
        frame that cannot go at once, is queued for the writer; waits only while the
        outbox is full.

        Not a checkpoint when there is room: a caller that goes on to wait for the
        answer yields there, and the writer runs then. Raises `wire.FrameTooLarge` for a
        message the Node would disconnect for (nothing is sent)."""
        if self.closed.is_set():
            raise SessionClosed(self.node_id)
        frame = wire.encode_bounded(message)
        try:
            direct = isinstance(message, _DIRECT) and not self._pending_cancels
            if not (direct and await self._channel.send_now(frame)):
                await self._channel.send(frame)
        except ChannelClosed:
            raise SessionClosed(self.node_id) from None

    def send_nowait(self, message: wire.Message) -> None:
        """Queue a frame without waiting, from paths that must not block (cleanup).

        Raises `trio.WouldBlock` when the outbox is full (a `cancel` is kept aside and
        sent after the frames ahead of it instead, Rule 4) and `SessionClosed` when the
        session has ended."""
        if self.closed.is_set():
            raise SessionClosed(self.node_id)
        try:
            self._channel.send_nowait(wire.encode(message))
        except trio.WouldBlock:
            if not isinstance(message, wire.Cancel):
                raise
            self._pending_cancels.add(message.run_id)
        except ChannelClosed:
            raise SessionClosed(self.node_id) from None

    def cancel_run(self, run_id: str) -> None:
        """Forget `run_id` and tell the Node to cancel it (if the session is still up)."""
        self._forget(run_id)
        try:
            self.send_nowait(wire.Cancel(run_id=run_id))
        except SessionClosed:
            pass  # the node is gone: so is the run

    # --- runs ------------------------------------------------------------------------

    def open_run(self, run_id: str, sink: RunSink) -> None:
        """Deliver `run_id`'s events to `sink` from now on (Rules 1 and 2)."""
        if self.closed.is_set():
            raise SessionClosed(self.node_id)
        self._runs[run_id] = sink

    def close_run(self, run_id: str) -> None:
        """Stop delivering `run_id`'s events (late ones are dropped)."""
        self._forget(run_id)

    def _forget(self, run_id: str) -> None:
        if self._runs.pop(run_id, None) is not None and not self._runs and self._retired:
            self._retired_and_idle.set()

    def retire(self) -> None:
        """The node linked again after our `goaway` and new runs go there: end this
        session once the runs still on it are done."""
        self._retired = True
        if not self._runs:
            self._retired_and_idle.set()

    async def _end_when_retired_and_idle(self) -> None:
        await self._retired_and_idle.wait()

    async def push_refresh(
        self,
        revision: int,
        node_config: NodeConfig,
        config_time: float,
        answer: Callable[[wire.RefreshAck | None], None],
    ) -> None:
        """Push a node-specific config; `answer` is told the Node's ack of `revision`
        once, from the reader, or None when the session ends first (or has ended). A push
        of a newer revision lets go of the older ones' answers: their pushes are over.
        Returns once the frame is sent (not a checkpoint when it goes at once)."""
        for older in [pushed for pushed in self._pushes if pushed < revision]:
            del self._pushes[older]
        self._pushes[revision] = answer
        self._latest_sent = max(self._latest_sent, revision)
        refresh = wire.Refresh(revision=revision, node_config=node_config, config_time=config_time)
        try:
            await self.send(refresh)
        except SessionClosed:
            if self._pushes.pop(revision, None) is answer:  # else `_finish` told it
                answer(None)
        except BaseException:
            if self._pushes.get(revision) is answer:
                del self._pushes[revision]
            raise

    async def request_model_command(self, command: wire.ModelCommand) -> wire.ModelCommandDone:
        """Ask the Node to load or unload a model and wait for its answer (the caller
        bounds the wait: a load takes as long as the runtime needs). `_route` delivers the
        answer; `SessionClosed` when the session ends first."""
        key = command.command_id
        awaited = self._commands[key] = _Awaited()
        try:
            await self.send(command)
            await awaited.settled.wait()
        finally:
            self._commands.pop(key, None)
        if awaited.answer is None:
            raise SessionClosed(self.node_id)
        return awaited.answer

    async def goaway(self, reason: str) -> None:
        """Tell the node this Edge is going away: it dials again for new runs and keeps
        this session only for the runs on it (design §3). Sent once."""
        if self.goaway_sent:
            return
        self.goaway_sent = True
        try:
            await self.send(wire.GoAway(reason=reason))
        except SessionClosed:
            pass

    # --- lifecycle -------------------------------------------------------------------

    def abort(self, reason: str = "closed by the edge") -> None:
        """End the session now (replacement by a newer connection, or Edge shutdown)."""
        self._ended(reason)
        self._scope.cancel()

    def replace(self, peer: str) -> None:
        """A newer connection from `peer` for the same node id takes this session's place."""
        self.replaced_by = peer
        self.abort(f"replaced by a new connection from {peer}")

    def _ended(self, reason: str) -> None:
        """Record the first reason the session ended for (later ones are consequences)."""
        if self.end_reason is None:
            self.end_reason = reason

    async def serve(self, heartbeats: HeartbeatGrid) -> None:
        """Run the session until the peer goes away, misses heartbeats or is replaced;
        the grid looks at it meanwhile (Rule 5; its `run` is the grid owner's)."""
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:

                    async def writer_then_stop() -> None:
                        await self._channel.write()  # returns after a reject's Close
                        nursery.cancel_scope.cancel()

                    async def heartbeat_then_stop() -> None:
                        await self._heartbeat(heartbeats)
                        nursery.cancel_scope.cancel()

                    async def retired_then_stop() -> None:
                        await self._end_when_retired_and_idle()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(writer_then_stop)
                    nursery.start_soon(self._reader)
                    nursery.start_soon(heartbeat_then_stop)
                    nursery.start_soon(retired_then_stop)
        except* ConnectionClosed as closed:
            first = sole_exception(closed.exceptions[0])
            how = describe_close(first) if isinstance(first, ConnectionClosed) else "closed"
            self._ended(f"connection closed, {how}")
        finally:
            self._ended("session ended")
            self._finish()

    def _finish(self) -> None:
        self.closed.set()
        # Wakes senders waiting for room, and lets go of this session's callbacks
        # (`_frames`, `heard`): no cycle is left for the collector (Rule 6).
        self._channel.release()
        runs, self._runs = self._runs, {}
        for sink in runs.values():
            sink.lost()
        pushes, self._pushes = self._pushes, {}
        for answer in pushes.values():
            answer(None)  # no ack: the session ended
        for done in self._commands.values():
            done.settled.set()
        self._commands.clear()

    def _frames(self, frame: bytes, _take: Callable[[], bytes | None]) -> Iterable[bytes]:
        """What the channel's writer sends for one queued frame: the frame, then the
        cancels kept aside while the outbox was full (Rule 4)."""
        if not self._pending_cancels:
            return (frame,)
        cancels = [wire.encode(wire.Cancel(run_id=run_id)) for run_id in self._pending_cancels]
        self._pending_cancels.clear()
        return (frame, *cancels)

    def _deliver(self, events: wire.RunEvents) -> None:
        """Hand each run its events without ever blocking the reader (Rules 1, 2).

        A run's chunks of one batch arrive as one piece of bytes; the ends come after
        every chunk. Events of runs the Edge already gave up on are dropped."""
        runs = self._runs
        for run_id, data in events.chunks:
            sink = runs.get(run_id)
            if sink is not None and not sink.push(data):
                log.warning("run %s: caller is not reading; cancelling the run", run_id)
                self.cancel_run(run_id)
        for end in events.ends:
            sink = runs.get(end.run_id)
            if sink is not None:
                self._forget(end.run_id)
                sink.push(end)

    def _route(self, message: wire.NodeToEdge) -> None:
        message, notes = check_node_message(message)
        for note in notes:
            log.warning("node %s sent something out of range: %s", self.node_id, note)
        match message:
            case wire.RunEvents():
                self._deliver(message)
            case wire.Status():
                self._on_status(self.node_id, message)
            case wire.Load():
                self._on_load(self.node_id, message)
            case wire.RefreshAck() if message.revision > self._latest_sent:
                log.warning(
                    "node %s acked config revision %d, which was never sent to it: ignored",
                    self.node_id,
                    message.revision,
                )
            case wire.RefreshAck():
                answer = self._pushes.pop(message.revision, None)
                if message.ok:
                    self.applied_revision = max(self.applied_revision, message.revision)
                if self._on_ack is not None:
                    self._on_ack(self.node_id, message)
                if answer is not None:
                    answer(message)
            case wire.ModelCommandDone():
                waiting = self._commands.pop(message.command_id, None)
                if waiting is not None:
                    waiting.settle(message)
            case wire.Reject():
                reason = logged(message.reason)
                log.warning("node %s rejected the session: %s", self.node_id, reason)
                self.abort(f"the node rejected the session: {reason} ({logged(message.code, 64)})")
            case wire.Hello():
                raise wire.WireError("hello on an established session")

    async def _reader(self) -> None:
        """Route every message as it arrives (Rules 1-3; `_route` never waits, so the
        channel hands each over from trio-websocket's reader: `Channel.receive_each`);
        after a reject it ends, and the session ends once the channel's writer sent the
        reject and the Close."""
        channel = self._channel
        try:
            await channel.receive_each(self._route)
        except MalformedFrame as exc:
            self._ended(f"sent a malformed frame: {exc}")
        except wire.WireError as exc:
            self._ended(f"broke the protocol: {exc}")
            channel.reject("protocol_error", str(exc))

    async def _heartbeat(self, heartbeats: HeartbeatGrid) -> None:
        """Rule 5: ping whenever a look of the grid asks for it (the channel's heartbeat)."""
        heartbeats.join(self)
        try:
            await self._channel.heartbeat(self._wait_ping_due, heartbeats.timeout_s, self._answered)
            self._ended(f"no heartbeat answer within {heartbeats.timeout_s:g}s")
        finally:
            heartbeats.leave(self)

    async def _wait_ping_due(self) -> None:
        await self._ping_due.wait()
        self._ping_due = trio.Event()

    def _answered(self) -> None:
        self.heard()  # the answer (also seen arriving, where that is watched)
        self._pinging = False


def peer_address(peer: WebSocketConnection | WebSocketRequest) -> str:
    """`HOST:PORT` of a connection's (or an upgrade request's) peer, for log lines
    (trio-websocket's `Endpoint` repr is not for them)."""
    remote = peer.remote
    if isinstance(remote, str):  # a Unix socket's path, say
        return remote
    return str(ListenAddress(str(remote.address), remote.port))
