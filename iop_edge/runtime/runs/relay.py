"""How one attempt's events reach its run's consumer (`dispatch` Rules 5 and 9): a
bounded buffer the Node's session fills without ever blocking, and, while the consumer
waits with nothing buffered, a `DirectWrite` that takes them straight to the caller."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

import trio

from iop_edge.runtime.nodes.session import NodeSession, RunEvent
from iop_edge.runtime.runs.lease import Lease
from iop_edge.runtime.runs.run_plan import run_failed
from schemas import wire

__all__ = [
    "RUN_BUFFER_BYTES",
    "RUN_BUFFER_ITEMS",
    "Attempt",
    "DirectWrite",
    "RelayEvent",
    "Unwritten",
]

log = logging.getLogger(__name__)

#: What a run buffers for a consumer that is slower than its provider (Rule 5).
RUN_BUFFER_BYTES: Final = 4 * 1024 * 1024
RUN_BUFFER_ITEMS: Final = 1024


class DirectWrite(Protocol):
    """Writes a run's chunks to its caller without waiting, when it can (Rule 9)."""

    def __call__(self, events: bytes, /) -> bytes | None:
        """Write `events` now, as far as the caller's socket takes them.

        None: nothing was written (the events are buffered for the consumer as usual).
        Otherwise the bytes of the write the socket did not take, b"" when it took all:
        the consumer writes them first (`Unwritten`)."""
        ...


@dataclass(frozen=True, slots=True)
class Unwritten:
    """The rest of a write a `DirectWrite` began (Rule 9): bytes for the caller's
    connection, as they are, before any later event."""

    data: bytes


RelayEvent = RunEvent | Unwritten
"""What a consumer that writes directly (Rule 9) hears: run events, and the rest of a
write it began."""


class Attempt:
    """One try of a run on one provider: its slot, its session, its buffered events.

    The session delivers events here (`RunSink`) without ever blocking; the run takes
    them in order (`take`, `receive`). Every chunk of every stream passes through here,
    so the buffer is a deque with one parked reader rather than a memory channel."""

    __slots__ = (
        "_closed",
        "_events",
        "_give_up",
        "_on_busy",
        "_open",
        "_reader",
        "buffered",
        "direct",
        "direct_failed",
        "end_reason",
        "lease",
        "session",
        "wire_id",
    )

    def __init__(
        self,
        wire_id: str,
        lease: Lease,
        session: NodeSession,
        give_up: Callable[[], None],
        on_busy: Callable[[str], None],
    ) -> None:
        self.wire_id = wire_id
        self.lease = lease
        self.session = session
        self._events: deque[RelayEvent] = deque()
        self._reader = trio.lowlevel.ParkingLot()
        self._open = True
        """Events are still taken: no end, give-up or loss yet (what is buffered stays)."""
        self._closed = False
        """Torn down: what was buffered is dropped, and so is anything later."""
        self.buffered = 0
        """Bytes delivered and not yet read by the run."""
        self.end_reason: wire.RunFailed | None = None
        self.direct: DirectWrite | None = None
        """Set while the consumer waits with nothing buffered (Rule 9)."""
        self.direct_failed = False
        """The `DirectWrite` raised once: it is not used again (Rule 9)."""
        self._give_up = give_up
        self._on_busy = on_busy

    # --- RunSink --------------------------------------------------------------------

    def push(self, event: RunEvent) -> bool:
        if not self._open:
            return True  # the run already stopped listening: its end has been decided
        if isinstance(event, bytes):
            direct = self.direct
            if direct is not None and not self._events:
                try:
                    rest = direct(event)
                except Exception:
                    log.exception("run %s: writing to its caller directly failed", self.wire_id)
                    self.direct, self.direct_failed = None, True
                    rest = None
                if rest is not None:
                    if rest:  # the consumer writes it first; later chunks queue behind
                        self._events.append(Unwritten(rest))
                        self._reader.unpark()
                    return True
            self.buffered += len(event)
            # Behind: a whole buffer waits, besides this event (one larger than the
            # buffer, which the wire bounds, is not the caller's fault).
            if self._events and (
                len(self._events) >= RUN_BUFFER_ITEMS or self.buffered > RUN_BUFFER_BYTES
            ):
                self.end_reason = run_failed(
                    self.wire_id,
                    wire.FailureCode.CALLER_TOO_SLOW,
                    f"the caller fell {self.buffered} bytes of events behind the provider",
                )
                self._stop()
                self._give_up()
                return False
        else:
            if isinstance(event, wire.RunFailed) and event.code == wire.FailureCode.BUSY:
                self._on_busy(self.lease.provider_id)  # Rule 8: before any later report
            self._open = False  # the end is the last event
        self._events.append(event)
        self._reader.unpark()
        return True

    def lost(self) -> None:
        self.end_reason = run_failed(
            self.wire_id,
            wire.FailureCode.NODE_LOST,
            f"node '{self.lease.node_id}' disconnected during the run",
        )
        self._stop()

    def _stop(self) -> None:
        """Take no more events; the reader still gets those buffered, then the end."""
        self._open = False
        self._reader.unpark()

    # --- the run's side -------------------------------------------------------------

    def take(self) -> RelayEvent | None:
        """The next event if one is here; None when the reader would have to wait.

        Raises `trio.EndOfChannel` once nothing more will come (ended, given up, lost,
        torn down): the run then hears `end_reason`."""
        if self._events:
            return self._events.popleft()
        if self._open:
            return None
        raise trio.EndOfChannel

    async def receive(self, direct: DirectWrite | None = None) -> RelayEvent:
        """The next event, waiting for it; raises `trio.EndOfChannel` as `take` does.

        While it waits, chunks go to `direct` when it takes them (Rule 9)."""
        if self.direct_failed:
            direct = None
        while not self._events and self._open:
            self.direct = direct
            try:
                await self._reader.park()
            finally:
                self.direct = None
        event = self.take()
        assert event is not None
        return event

    # --- teardown -------------------------------------------------------------------

    def close(self, *, cancel_on_node: bool) -> None:
        """Stop listening, release the slot; cancel on the Node when it may be live there."""
        if cancel_on_node:
            self.session.cancel_run(self.wire_id)
        else:
            self.session.close_run(self.wire_id)
        self.direct = None
        if not self._closed:
            self._closed = True
            self._events.clear()
            self.buffered = 0
            self._stop()
        self.lease.release()
        # Torn down, it gives nothing up any more (`push` takes no event now). The run's
        # bound method was the one reference back to the run: without it a finished run
        # is freed by reference counting, not left to the cyclic collector (nor kept
        # until a thaw when a freeze caught it in flight: `runtime.lifecycle.heap`).
        self._give_up = _nothing


def _nothing() -> None:
    """What a torn-down attempt gives up (`Attempt.close`)."""
