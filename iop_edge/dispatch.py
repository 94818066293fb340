"""One run end to end: admission, the run on a Node, failover, and the caller's stream.

`Dispatcher.start` takes a validated request (`RunPlan`), gets a slot from the scheduler,
sends the run to the provider's Node and waits for the first event. Until a byte is
committed to the caller, a retryable failure (node lost, upstream unreachable, upstream
5xx/429/503) moves the run to the next candidate, at most
`dispatch.retries_before_first_byte` times. What it returns, an `ActiveRun`, owns the slot
and the node-side run; `ActiveRun.close()` is synchronous and idempotent, so the slot is
released exactly once from whichever path ends the run (completion, failure, caller gone,
node gone), and a run still live on the Node is cancelled there.

Rules:
1. Once a run is open on a session, its slot is released by `_end_run` and nowhere
   else (from `ActiveRun.close()`, or from `_attempt` before the hand-over); every
   `start` that raises has already closed what it opened.
2. `model` in the body is rewritten to the provider's served name per attempt; callers
   always get their alias back (`relabel`).
3. Failures before the first caller byte are retried only when the Node says
   `retryable`; upstream 429/503 (`capacity`) are load signals, never health failures.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from iop_edge.errors import ApiError
from iop_edge.hub import NodeHub, NodeSession, RunEvent, SessionClosed
from iop_edge.metrics import EdgeMetrics
from iop_edge.scheduler import (
    RETRY_AFTER_BUSY_S,
    AdmissionError,
    Lease,
    NoProvider,
    QueueFull,
    QueueTimeout,
    Scheduler,
    UnknownModel,
)
from schemas import wire

if TYPE_CHECKING:
    from iop_edge.snapshot import Snapshot

log = logging.getLogger(__name__)

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode
_decode_top_level = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode

# Failure codes that say something about the provider's health (count toward cooldown).
_HEALTH_FAILURES = frozenset(
    {
        "upstream_unreachable",
        "upstream_timeout",
        "upstream_error",
        "upstream_stream_error",
        "upstream_misconfigured",
        "bad_chunk",
        "bad_response",
    }
)


@dataclass(slots=True)
class RunPlan:
    """A validated caller request, ready to dispatch."""

    run_id: str
    model_id: str
    operation: wire.Operation
    body: dict[str, Any]
    stream: bool
    long: bool
    caller_wants_usage: bool
    principal_ref: str = "anonymous"
    token_ref: str = "anonymous"
    principal_alias: str | None = None
    received_at: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class RunTimings:
    queued_s: float = 0.0
    dispatch_s: float = 0.0
    first_event_at: float | None = None


class RunFailure(Exception):
    """The run failed for good; `api_error()` is what the caller gets."""

    def __init__(self, failure: wire.RunFailed | None, provider_id: str) -> None:
        message = failure.message if failure else "the node serving this request went away"
        super().__init__(message)
        self.failure = failure
        self.provider_id = provider_id

    def api_error(self) -> ApiError:
        failure = self.failure
        if failure is None:
            return ApiError(
                502,
                f"provider '{self.provider_id}' failed: node connection lost",
                type="api_error",
                code="node_lost",
            )
        if failure.code == "upstream_rejected" and failure.status in (400, 413, 422):
            return ApiError(failure.status, failure.message, code="upstream_rejected")
        if failure.code == "deadline_exceeded":
            return ApiError(504, failure.message, type="api_error", code=failure.code)
        if failure.capacity:
            # Upstream 429/503 on every provider tried: busy, not broken (rule 3), so the
            # caller gets a retryable 503 with Retry-After rather than a 502 failure.
            return ApiError(
                503,
                f"provider '{self.provider_id}' is at capacity: {failure.message}",
                type="service_unavailable_error",
                code=failure.code,
                retry_after_s=RETRY_AFTER_BUSY_S,
            )
        return ApiError(
            502,
            f"provider '{self.provider_id}' failed: {failure.message}",
            type="api_error",
            code=failure.code,
        )


def admission_error(exc: AdmissionError) -> ApiError:
    """Map the scheduler's refusals onto OpenAI-shaped HTTP errors."""
    if isinstance(exc, QueueFull):
        return ApiError(
            429,
            exc.reason,
            type="rate_limit_error",
            code="queue_full",
            retry_after_s=exc.retry_after_s or 1.0,
        )
    if isinstance(exc, QueueTimeout):
        return ApiError(
            503,
            exc.reason,
            type="service_unavailable_error",
            code="queue_timeout",
            retry_after_s=exc.retry_after_s or 1.0,
        )
    if isinstance(exc, UnknownModel):
        return ApiError(
            404, exc.reason, type="not_found_error", code="model_not_found", param="model"
        )
    return ApiError(
        503,
        exc.reason,
        type="service_unavailable_error",
        code="no_provider",
        retry_after_s=exc.retry_after_s or 1.0,
    )


class ActiveRun:
    """A run that is live on a Node and owns its slot until `close()`."""

    def __init__(
        self,
        *,
        plan: RunPlan,
        lease: Lease,
        session_run_id: str,
        session: NodeSession,
        events: trio.MemoryReceiveChannel[RunEvent],
        first: wire.RunChunk | wire.RunDone,
        timings: RunTimings,
        dispatcher: Dispatcher,
    ) -> None:
        self.plan = plan
        self.lease = lease
        self._session_run_id = session_run_id
        self._session = session
        self._events = events
        self._first: RunEvent | None = first
        self.timings = timings
        self._dispatcher = dispatcher
        self._finished = False
        self._closed = False
        self._end_reason: wire.RunFailed | None = None
        self.metered = False
        self.usage: wire.Usage | None = None

    @property
    def provider_id(self) -> str:
        return self.lease.provider_id

    async def next_event(self) -> RunEvent:
        """The first event, then the rest; a closed channel means the node went away."""
        event = self.next_event_nowait()
        if event is not None:
            return event
        try:
            return await self._events.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):  # closed: abandoned, see hub
            return self._ended_without_terminal()

    def next_event_nowait(self) -> RunEvent | None:
        """The next event if one is already here, else None (lets callers coalesce)."""
        if self._first is not None:
            first, self._first = self._first, None
            return first
        try:
            return self._events.receive_nowait()
        except trio.WouldBlock:
            return None
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return self._ended_without_terminal()

    def _ended_without_terminal(self) -> wire.RunFailed:
        if self._end_reason is not None:
            return self._end_reason
        return wire.RunFailed(
            run_id=self._session_run_id,
            code="node_lost",
            message=f"node '{self.lease.node_id}' disconnected during the run",
        )

    def finished(self, event: wire.RunDone | wire.RunFailed, *, on_node: bool = True) -> None:
        """Record how the run ended. `on_node=False`: the Edge ended it (the Node may still
        be running it, so `close()` will cancel it there)."""
        self._finished = on_node
        if isinstance(event, wire.RunDone):
            self.usage = event.usage
            self._dispatcher.scheduler.record_success(self.lease.provider_id)
        else:
            self._dispatcher.note_failure(self.lease.provider_id, event)

    def abandoned(self, reason: wire.RunFailed) -> None:
        """The hub gave up on this run's consumer: free everything now, say why later."""
        self._end_reason = reason
        self.close()

    def close(self) -> None:
        """Release everything exactly once; cancel the run on the Node if still live."""
        if self._closed:
            return
        self._closed = True
        _end_run(
            self._session,
            self._session_run_id,
            self._events,
            self.lease,
            cancel_on_node=not self._finished,
        )


def _end_run(
    session: NodeSession,
    run_id: str,
    events: trio.MemoryReceiveChannel[RunEvent],
    lease: Lease,
    *,
    cancel_on_node: bool,
) -> None:
    """Tear down one run on the Edge side: the only place a dispatched slot is released."""
    if cancel_on_node:
        session.post(wire.Cancel(run_id=run_id))
    session.close_run(run_id)
    events.close()
    lease.release()


class Dispatcher:
    def __init__(self, scheduler: Scheduler, hub: NodeHub, metrics: EdgeMetrics) -> None:
        self.scheduler = scheduler
        self.hub = hub
        self.metrics = metrics

    def note_failure(self, provider_id: str, failure: wire.RunFailed) -> None:
        if failure.capacity:
            self.scheduler.record_capacity_signal(provider_id)
        elif failure.code in _HEALTH_FAILURES:
            self.scheduler.record_failure(provider_id)

    async def start(self, plan: RunPlan, snapshot: Snapshot) -> ActiveRun:
        """Admit and start `plan`; returns once the first event is in hand.

        Raises `ApiError` for admission refusals and `RunFailure` when every allowed
        attempt failed before the first byte.
        """
        retries = snapshot.config.dispatch.retries_before_first_byte
        tried: set[str] = set()
        last_failure: RunFailure | None = None
        timings = RunTimings()
        for attempt in range(retries + 1):
            try:
                lease = await self.scheduler.acquire(
                    plan.model_id,
                    plan.run_id if attempt == 0 else f"{plan.run_id}.{attempt}",
                    long=plan.long,
                    exclude=frozenset(tried),
                )
            except NoProvider as exc:
                if last_failure is not None:
                    raise last_failure from None
                raise admission_error(exc) from None
            except AdmissionError as exc:
                raise admission_error(exc) from None
            timings.queued_s += lease.queued_s
            tried.add(lease.provider_id)
            active = await self._attempt(plan, lease, attempt, timings)
            if isinstance(active, ActiveRun):
                return active
            last_failure = active
            if active.failure is not None and not active.failure.retryable:
                break
            if attempt < retries:  # another provider gets the run
                self.metrics.failovers.labels(plan.model_id, lease.provider_id).inc()
        assert last_failure is not None
        raise last_failure

    async def _attempt(
        self, plan: RunPlan, lease: Lease, attempt: int, timings: RunTimings
    ) -> ActiveRun | RunFailure:
        """One try on one provider. Owns `lease` until it hands it to an ActiveRun."""
        session_run_id = plan.run_id if attempt == 0 else f"{plan.run_id}.{attempt}"
        session = self.hub.session(lease.node_id)
        if session is None:
            lease.release()
            return RunFailure(
                wire.RunFailed(
                    run_id=session_run_id,
                    code="node_lost",
                    retryable=True,
                    message=f"node '{lease.node_id}' is not connected",
                ),
                lease.provider_id,
            )
        sent_at = time.perf_counter()
        try:
            events = session.open_run(session_run_id)
        except SessionClosed:
            lease.release()
            return RunFailure(None, lease.provider_id)
        plan.body["model"] = lease.target
        run = wire.Run(
            run_id=session_run_id,
            provider_id=lease.provider_id,
            target=lease.target,
            operation=plan.operation,
            body=_json_encode(plan.body),
            stream=plan.stream,
        )
        active: ActiveRun | None = None
        try:
            await session.send(run)
            try:
                first = await events.receive()
            except trio.EndOfChannel:
                first = wire.RunFailed(
                    run_id=session_run_id,
                    code="node_lost",
                    retryable=True,
                    message=f"node '{lease.node_id}' disconnected before the run started",
                )
            timings.dispatch_s = time.perf_counter() - sent_at
            timings.first_event_at = time.perf_counter()
            if isinstance(first, wire.RunFailed):
                self.note_failure(lease.provider_id, first)
                return RunFailure(first, lease.provider_id)
            active = ActiveRun(
                plan=plan,
                lease=lease,
                session_run_id=session_run_id,
                session=session,
                events=events,
                first=first,
                timings=timings,
                dispatcher=self,
            )
            # If the caller stops reading, the hub cancels the run and this frees the
            # slot at once, even while the response writer is stuck on the socket.
            session.on_abandon(session_run_id, active.abandoned)
            return active
        except SessionClosed:
            return RunFailure(None, lease.provider_id)
        finally:
            if active is None:
                # Cancelled, failed or lost before the run was handed over.
                _end_run(session, session_run_id, events, lease, cancel_on_node=True)


class BadPayload(Exception):
    """A Node sent a chunk or response that is not JSON."""


def relabel(data: bytes, alias: str, *, strip_usage: bool) -> bytes | None:
    """Rewrite an OpenAI JSON chunk/response so `model` is the caller's alias.

    Only the top level is parsed: every other value is kept as raw JSON and written back
    byte for byte, so provider fields pass through untouched and a large response (an
    embedding batch) costs a scan, not a full decode and re-encode. Returns None for a
    usage-only stream chunk the caller did not ask for; raises `BadPayload` when `data`
    is not a JSON object.
    """
    try:
        fields = _decode_top_level(data)
    except msgspec.DecodeError as exc:
        raise BadPayload(f"not a JSON object ({exc})") from None
    if strip_usage:
        usage = fields.get("usage")
        if usage is not None and bytes(usage) != b"null":
            choices = fields.get("choices")
            if choices is None or not _json_decode(choices):
                return None
            del fields["usage"]
    if "model" in fields:
        fields["model"] = msgspec.Raw(_json_encode(alias))
    return _json_encode(fields)
