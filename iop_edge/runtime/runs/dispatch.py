"""One caller request's run, from admission to its usage record (design §4 steps 5-9, §7).

What a run is asked and how it ended are `run_plan`'s; how one attempt's events reach the
run's consumer (Rules 5 and 9) is `relay`'s; the run itself, and the dispatcher that
makes and starts runs, are here.

`Dispatcher.open(plan)` makes a `Run`, and the run owns everything that happens to the
request from then on: the slot, the attempts on providers, the events the Node sends,
the provider's verdict, and the one record metering gets. Whoever serves the request
(the HTTP layer) asks the run for events and tells it how the exchange ended; it never
touches a slot, a session or a metric itself.

    new ──start()──▶ live ──terminal event──▶ settled
     │                │                          │
     └────────────────┴──────── end(outcome) ────┴──▶ ended

Rules:
1. `start()` admits the run and tries providers until one produces a first event. A
   failed attempt's slot is released before the next provider is asked for, and the
   time it took is charged to `upstream` (the caller waited on providers, not on us).
2. Failures before the first caller byte are retried on another provider only when the
   Node says `retryable`; upstream 429/503 (`capacity`) are load signals, never health
   failures.
3. The provider's verdict (a success, or a failure that counts toward its cooldown) is
   recorded once, when the run's terminal event is read. Blame (`core.routing.blame`): a failure
   counts against a provider only when it is the provider's. Transport errors, timeouts,
   a broken stream, a misconfigured provider count at once; an empty or malformed reply
   once other requests to the provider fail too (`verdicts`). An upstream 4xx refusal is
   the request's: it is not retried and counts against nobody. An upstream 5xx is ambiguous
   (llama.cpp answers a request it cannot parse with 500): it counts against its provider
   only once the same request succeeds on another one; when a second provider fails it
   with the same status, the request is at fault, nobody is penalised and the caller gets
   the upstream's status and message (`RunFailure.request_fault`); a 5xx with no other
   provider to try counts against nobody. So no caller can take a model offline for the
   others by sending it bad requests.
4. `end(outcome)` ends the run, once (later calls do nothing): it records the outcome,
   releases the slot, cancels the run on the Node if it may still be live there, and
   hands exactly one `RunRecord` to metering. The server of the request calls it on every
   path it knows and once more in a `finally` (`CALLER_GONE`, `INTERNAL_ERROR`) for the
   paths it does not: a run is metered even when its caller left before the first event.
   The record's usage is the one the Node reported (the provider's, or the Node's
   estimate), else the Edge's own estimate (`usage_source: estimated`): prompt tokens
   from `schemas.tokens`, completion tokens one per chunk the run handed to its caller
   (a run the Edge ends itself: the caller left, the node was lost), or from the text of
   a whole answer that came without usage. A run that produced output is never metered
   at zero.
5. A run whose consumer falls a whole buffer behind (`RUN_BUFFER_BYTES` of events, or
   `RUN_BUFFER_ITEMS` batches; one event larger than the buffer, with nothing waiting
   before it, is not behind) is given up at once: its slot is released while the
   consumer may still be stuck on its socket, the Node cancels it, and the consumer's
   next read says `caller_too_slow`.
6. What a run hears is caller-ready bytes (server-sent events the Node shaped) and then
   one end; the Edge does not parse them (design §3). A stream asks the Node to
   hold its last events back (`hold_tail`): a Messages or Responses stream's end then
   carries them (`run_done.tail`), and the consumer writes them only after `end`, as it
   writes chat's `[DONE]`, so a caller that hangs up the moment it reads them (Codex CLI
   does) left a run already recorded as complete.
7. A stopping Edge cuts every run still open when its grace period ends
   (`Dispatcher.cut_all`): the run ends at once as 503 `shutting_down` (metered with
   what it delivered), a `start()` in progress raises `RunFailure`, and the consumer's
   next read is the run's `shutting_down` failure, so the server of the request ends
   the exchange properly (an error event and `[DONE]`, or a 503). Runs opened after
   that are cut as they start.
8. A `busy` answer (the Node's slots are all taken, by another Edge's runs: design §13) is
   neither a failure of the provider nor a failover: the provider counts as full at once
   (in the session's reader, before any later `load` report is read) and the run goes
   back to the queue for the same providers, at most `MAX_BUSY_REQUEUES` times; after
   that it is a capacity failure like an upstream 429.
9. A consumer that can write to its caller without waiting hands the run a `DirectWrite`
   (`write_directly`). While the consumer waits for events and has none buffered, the
   session's reader hands each run's chunks to it at once: written whole, they never wake
   the consumer (for a stream, that is one task switch less per upstream read). The
   write takes what the caller's socket takes; the rest, if any, comes to the consumer
   as the next event (`Unwritten`), to be written before anything else, and no chunk
   goes to the `DirectWrite` again until the consumer waits once more. Order is kept,
   nothing is written twice, and a chunk written so is counted as any other (Rule 4).
   A `DirectWrite` that raises (a bug) is logged and never used again for that run: the
   chunk is buffered for the consumer, whose own write then meets the problem in the
   request's task, so one request's trouble never reaches the session that serves the
   Node's other runs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Final

import msgspec
import trio

from iop_edge.core.routing.blame import Attempts, Next
from iop_edge.core.routing.run_work import run_work
from iop_edge.runtime.metering.metering import RunRecord
from iop_edge.runtime.nodes.hub import NodeHub
from iop_edge.runtime.nodes.session import SessionClosed
from iop_edge.runtime.runs.admission_errors import (
    AdmissionError,
    ConcurrencyLimited,
    NoProvider,
)
from iop_edge.runtime.runs.lease import Lease
from iop_edge.runtime.runs.limits import (
    NO_RATE_LIMITS,
    PrincipalLimiter,
    RateLimits,
    Ticket,
)
from iop_edge.runtime.runs.relay import (
    RUN_BUFFER_BYTES,
    RUN_BUFFER_ITEMS,
    Attempt,
    DirectWrite,
    RelayEvent,
    Unwritten,
)
from iop_edge.runtime.runs.revival import Revival
from iop_edge.runtime.runs.run_plan import (
    CALLER_GONE,
    INTERNAL_ERROR,
    SHUTTING_DOWN,
    Outcome,
    RunFailure,
    RunPlan,
    RunTimings,
    run_failed,
)
from iop_edge.runtime.runs.scheduler import Scheduler
from iop_edge.runtime.runs.verdicts import ProviderVerdicts
from schemas import wire
from schemas.tokens import OutputTally

__all__ = [
    "CALLER_GONE",
    "INTERNAL_ERROR",
    "RUN_BUFFER_BYTES",
    "RUN_BUFFER_ITEMS",
    "SHUTTING_DOWN",
    "DirectWrite",
    "Dispatcher",
    "Outcome",
    "RelayEvent",
    "Run",
    "RunFailure",
    "RunPlan",
    "RunTimings",
    "Unwritten",
]

log = logging.getLogger(__name__)

#: How often one run may find its provider `busy` and wait again (Rule 8).
MAX_BUSY_REQUEUES: Final = 16

_json_encode = msgspec.json.Encoder().encode

#: Failures that stop a run while its provider may still be working on it (Rule 4: its
#: prompt was being read, so the estimate counts it even without output).
_CUT_WHILE_WORKING: Final = frozenset(
    {wire.FailureCode.NODE_LOST, wire.FailureCode.CALLER_TOO_SLOW}
)


class Run:
    """One request's run: owned from admission to metering (see the module docstring)."""

    def __init__(self, plan: RunPlan, dispatcher: Dispatcher) -> None:
        self.plan = plan
        self.timings = RunTimings()
        self.usage: wire.Usage | None = None
        self.usage_source: wire.UsageSource = "provider"
        self.chunks = 0
        """Chunks handed to the caller's side (the Edge's own output estimate, Rule 4)."""
        self.outcome: Outcome | None = None
        self._dispatcher = dispatcher
        self._attempt: Attempt | None = None
        self._provider_id = ""
        self._node_id = ""
        self._first: RelayEvent | None = None
        self._direct: DirectWrite | None = None
        """`write_directly`'s writer, counting what it writes (Rule 9)."""
        self._live_on_node = False
        """Whether the Node may still be running the current attempt (cancel on end)."""
        self._stopped_working = False
        """The run was stopped while its provider worked on it (Rule 4)."""
        self._unmetered_response: bytes | None = None
        """A whole answer that came without usage (from a Node that does not estimate)."""
        self._admitted = False
        self.ticket: Ticket | None = None
        """The run's hold on its principal's rate limits (admitted), settled by `end`."""
        self._start_scope = trio.CancelScope()
        self._cut: wire.RunFailed | None = None
        """Why the Edge cut the run short (it is stopping, Rule 7)."""

    @property
    def provider_id(self) -> str:
        """The provider of the current (or last) attempt; "" before the first."""
        return self._provider_id

    @property
    def node_id(self) -> str:
        """The node of the current (or last) attempt; "" before the first."""
        return self._node_id

    @property
    def rate_limits(self) -> RateLimits:
        """Where the run's principal stood against its limits when the run was admitted
        (nothing set: empty)."""
        return self.ticket.rate_limits if self.ticket is not None else NO_RATE_LIMITS

    # --- 1. start ------------------------------------------------------------------

    async def start(self) -> None:
        """Admit the run and start it on a provider; returns once its first event is here.

        Raises the scheduler's `AdmissionError`s when the run is not admitted, and
        `RunFailure` when every allowed attempt failed before the first byte (Rules 1-2).
        """
        if self._cut is None:
            with self._start_scope:  # cancelled by `cut` (Rule 7)
                await self._dispatcher.start(self)
        if self._cut is not None:
            # A slot granted just as the cut came may have begun an attempt after `end`:
            # it is closed here, so no slot outlives the run.
            attempt = self._attempt
            if attempt is not None:
                attempt.close(cancel_on_node=self._live_on_node)
                self._live_on_node = False
            raise RunFailure(self._cut, self._provider_id)

    def cut(self, reason: str) -> None:
        """End the run now because the Edge is stopping (Rule 7); idempotent."""
        if self.outcome is not None:
            return
        self._cut = run_failed(self.plan.run_id, wire.FailureCode.SHUTTING_DOWN, reason)
        if self._attempt is not None:
            self._attempt.end_reason = self._cut
        self._start_scope.cancel()
        self.end(SHUTTING_DOWN)

    # --- 2. events -----------------------------------------------------------------

    def write_directly(self, direct: DirectWrite) -> None:
        """From now on, while the consumer waits, chunks go to `direct` (Rule 9); the
        consumer then hears `Unwritten` events too."""

        def write_counted(events: bytes) -> bytes | None:
            rest = direct(events)
            if rest is not None:
                self.chunks += events.count(b"\n\n")  # as `_seen` counts them (Rule 4)
            return rest

        self._direct = write_counted

    async def next_event(self) -> RelayEvent:
        """The next event of the run; a terminal one is the last (Rule 6)."""
        event = self.ready_event()
        if event is not None:
            return event
        attempt = self._require_attempt()
        try:
            event = await attempt.receive(self._direct)
        except trio.EndOfChannel:
            event = self._ended_without_terminal(attempt)
        return self._seen(event, attempt)

    def ready_event(self) -> RelayEvent | None:
        """The next event if one is already here (lets callers coalesce), else None."""
        attempt = self._require_attempt()
        if self._first is not None:
            first, self._first = self._first, None
            return self._seen(first, attempt)
        try:
            event = attempt.take()
        except trio.EndOfChannel:
            event = self._ended_without_terminal(attempt)
        if event is None:
            return None
        return self._seen(event, attempt)

    def next_event_nowait(self) -> RelayEvent:
        """The next event if one is already here, else raise `trio.WouldBlock`."""
        event = self.ready_event()
        if event is None:
            raise trio.WouldBlock
        return event

    def reject_payload(self, code: wire.FailureCode, message: str) -> wire.RunFailed:
        """The Edge found what the Node sent unusable (not framed as events, not a JSON
        object): the run fails here, counts against the provider, and is cancelled on the
        Node when it ends."""
        attempt = self._require_attempt()
        failure = run_failed(attempt.wire_id, code, message)
        self._dispatcher.note_failure(self._provider_id, failure, self.plan)
        return failure

    def _seen(self, event: RelayEvent, attempt: Attempt) -> RelayEvent:
        if isinstance(event, Unwritten):  # counted when it was written (Rule 9)
            return event
        if isinstance(event, bytes):
            attempt.buffered -= len(event)
            self.chunks += event.count(b"\n\n")  # one server-sent event each
            return event
        self._live_on_node = False
        if event.usage is not None:
            self.usage = event.usage
            self.usage_source = event.usage_source or "provider"
        if isinstance(event, wire.RunDone):
            if event.tail:
                self.chunks += event.tail.count(b"\n\n")  # handed to the caller's side too
            if event.usage is None and not self.plan.stream:
                # (a stream's `response`, kept for the Edge, repeats what the chunks said)
                self._unmetered_response = event.response
            self._dispatcher.note_success(self._provider_id)
        else:
            self._stopped_working = event.code in _CUT_WHILE_WORKING
            self._dispatcher.note_failure(self._provider_id, event, self.plan)
        return event

    def _ended_without_terminal(self, attempt: Attempt) -> wire.RunFailed:
        return attempt.end_reason or run_failed(
            attempt.wire_id,
            wire.FailureCode.NODE_LOST,
            f"node '{attempt.lease.node_id}' disconnected during the run",
        )

    def _require_attempt(self) -> Attempt:
        if self._attempt is None:
            raise RuntimeError("the run has not started")
        return self._attempt

    # --- 3. end --------------------------------------------------------------------

    def end(self, outcome: Outcome) -> None:
        """End the run with `outcome`; the first call wins, later ones do nothing (Rule 4)."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self._dispatcher.forget(self)
        # Nothing is written from now on; the writer, a closure over the run, was its one
        # reference back to itself besides the attempt's (`Attempt.close`).
        self._direct = None
        attempt = self._attempt
        if attempt is not None:
            if self._live_on_node:
                self._stopped_working = True  # the caller left (or we gave up) meanwhile
            attempt.close(cancel_on_node=self._live_on_node)
            self._live_on_node = False
        plan = self.plan
        timings = self.timings
        first_event_at = timings.first_event_at
        usage, usage_source = self._metered_usage()
        if self.ticket is not None:
            # A server error before any of the reply reached the caller: the provider's or
            # the gateway's failure, not counted against `requests_per_minute`.
            upstream_failed = outcome.status >= 500 and self.chunks == 0
            self._dispatcher.settle(self.ticket, usage, refund_request=upstream_failed)
        record = RunRecord(
            run_id=plan.run_id,
            request_id=plan.request_id or plan.run_id,
            model=plan.model_id,
            principal_ref=plan.principal_ref,
            token_ref=plan.token_ref,
            alias=plan.principal_alias,
            provider=self._provider_id,
            node=self.node_id,
            status=outcome.status,
            code=outcome.code,
            usage=usage,
            usage_source=usage_source,
            latency_s=time.perf_counter() - plan.received_at,
            ttft_s=None if first_event_at is None else first_event_at - plan.received_at,
            queued_s=timings.queued_s if self._admitted else None,
            protocol=plan.protocol,
            operation=plan.operation,
            stream=plan.stream,
        )
        if plan.trace is not None:
            plan.trace.finished(record)
        self._dispatcher.meter(record)

    def _metered_usage(self) -> tuple[wire.Usage | None, wire.UsageSource]:
        """What the run consumed (Rule 4): the Node's report, else the Edge's estimate."""
        if self.usage is not None:
            return self.usage, self.usage_source
        answered = self._unmetered_response is not None
        if self._attempt is None or not (self.chunks or self._stopped_working or answered):
            return None, "estimated"  # never reached a provider, or refused outright
        completion = self.chunks
        if self._unmetered_response is not None:
            tally = OutputTally()
            tally.add(self._unmetered_response, whole=True)
            completion += tally.tokens()
        prompt = self.plan.prompt_tokens
        usage = wire.Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )
        return usage, "estimated"

    # --- used by the Dispatcher ------------------------------------------------------

    def _begin_attempt(self, attempt: Attempt) -> None:
        self._attempt = attempt
        self._provider_id = attempt.lease.provider_id
        self._node_id = attempt.lease.node_id
        self._admitted = True
        self._live_on_node = True

    def _drop_attempt(self, failure: wire.RunFailed) -> None:
        """The attempt failed before its first event: it is over on the Node too. What it
        consumed (a prompt read before a timeout) is metered unless a later attempt's
        report replaces it."""
        attempt, self._attempt = self._attempt, None
        self._live_on_node = False
        if failure.usage is not None:
            self.usage = failure.usage
            self.usage_source = failure.usage_source or "provider"
        if attempt is not None:
            attempt.close(cancel_on_node=False)

    def _first_event(self, event: RelayEvent) -> None:
        self._first = event

    def _give_up(self) -> None:
        """Rule 5: free the slot now; the consumer learns why at its next read."""
        attempt = self._attempt
        if attempt is not None:
            self._live_on_node = False  # the session cancels it on the Node
            attempt.lease.release()


class Dispatcher:
    """Makes runs and starts them: admission through the scheduler, attempts on nodes."""

    def __init__(
        self,
        scheduler: Scheduler,
        hub: NodeHub,
        *,
        meter: Callable[[RunRecord], None],
        on_failover: Callable[[str, str, str], None],
        on_busy_answer: Callable[[str, str], None],
        retries_before_first_byte: Callable[[], int],
        limits: PrincipalLimiter | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.meter = meter
        self._limits = limits
        """Per-principal rate limits and budgets, asked before a run queues."""
        self._hub = hub
        self._on_failover = on_failover
        self._on_busy_answer = on_busy_answer
        self._retries = retries_before_first_byte
        self._open: set[Run] = set()
        self._stopped: str | None = None
        self._verdicts = ProviderVerdicts(scheduler)
        self.revival = Revival(scheduler, hub)

    def open(self, plan: RunPlan) -> Run:
        """A new run of `plan`; the caller must `end()` it on every path (Rule 4)."""
        run = Run(plan, self)
        self._open.add(run)
        if self._stopped is not None:
            run.cut(self._stopped)  # after the grace period nothing new runs (Rule 7)
        return run

    def forget(self, run: Run) -> None:
        """`run` ended (called by `Run.end`)."""
        self._open.discard(run)

    def cut_all(self, reason: str) -> int:
        """The Edge's grace period is over: end every open run, and every later one, as
        503 `shutting_down` (Rule 7). Returns how many were open."""
        self._stopped = reason
        runs, self._open = list(self._open), set()
        for run in runs:
            run.cut(reason)
        return len(runs)

    def note_failure(self, provider_id: str, failure: wire.RunFailed, plan: RunPlan) -> None:
        """Record what `failure` of `plan` says about its provider (Rule 3, `verdicts`)."""
        self._verdicts.failure(provider_id, failure, plan.body)

    def note_success(self, provider_id: str) -> None:
        """A run of `provider_id` succeeded (Rule 3)."""
        self._verdicts.success(provider_id)

    def settle(
        self, ticket: Ticket, usage: wire.Usage | None, *, refund_request: bool = False
    ) -> None:
        """A run ended: its rate-limit ticket is settled with what it was metered for."""
        if self._limits is not None:
            used = 0 if usage is None else usage.prompt_tokens + usage.completion_tokens
            self._limits.settle(ticket, used, refund_request=refund_request)

    async def start(self, run: Run) -> None:
        """Admit and start `run` (Rules 1-2, 7); see `Run.start`."""
        plan = run.plan
        trace = plan.trace
        if self._limits is not None and run.ticket is None:
            # Before it queues: a request over its principal's limits waits for nothing.
            try:
                ticket = self._limits.admit(
                    plan.principal_ref,
                    prompt_tokens=plan.prompt_tokens,
                    max_output=plan.max_output,
                )
                # The run holds what the ticket took before anything awaits: a start cut
                # from here on (the caller left) is settled by `Run.end`, never leaked.
                run.ticket = ticket
                # Then the budget replicas share, when they do (limits Rule 7).
                await self._limits.reserve_shared(ticket)
            except AdmissionError as exc:
                if trace is not None:
                    trace.not_admitted(reason=exc.reason, code=exc.code)
                raise
        attempts = Attempts(retries=self._retries(), max_busy=MAX_BUSY_REQUEUES)
        last_failure: RunFailure | None = None
        # The provider the run leaves and why, told once another provider takes it.
        moving: tuple[str, str] | None = None
        for attempt in itertools.count():
            wire_id = plan.run_id if attempt == 0 else f"{plan.run_id}.{attempt}"
            asked_at = time.perf_counter()
            try:
                lease = await self.revival.acquire(
                    plan.model_id,
                    wire_id,
                    long=plan.long,
                    exclude=attempts.tried,
                    protocol=plan.protocol,
                    principal=plan.principal_ref,
                    work=run_work(plan.prompt_tokens, plan.max_output),
                    affinity=plan.affinity,
                )
            except AdmissionError as exc:
                # A refusal after a wait (queue timeout) shows that wait as `queue`.
                run.timings.queued_s += time.perf_counter() - asked_at
                if isinstance(exc, ConcurrencyLimited) and self._limits is not None:
                    self._limits.refused(plan.principal_ref, "max_concurrent")
                if trace is not None:
                    trace.not_admitted(reason=exc.reason, code=exc.code)
                if isinstance(exc, NoProvider) and last_failure is not None:
                    raise last_failure from None
                raise
            run.timings.queued_s += lease.queued_s
            if moving is not None:  # another provider took it: the run failed over
                left, why = moving
                self._on_failover(plan.model_id, left, why)
                if trace is not None:
                    trace.failover(provider_id=left, reason=why)
                moving = None
            if trace is not None:
                trace.admitted(
                    queued_s=lease.queued_s,
                    provider_id=lease.provider_id,
                    node_id=lease.node_id,
                    attempt=attempt,
                )
            failure = await self._attempt(run, wire_id, lease)
            if failure is None:
                # The request is fine: the 5xx answers it got elsewhere were the providers'.
                for provider_id in attempts.blamed():
                    self.scheduler.record_failure(provider_id)
                return
            last_failure = failure
            reason = str(failure.failure.code)
            if trace is not None:
                trace.attempt_failed(
                    provider_id=lease.provider_id,
                    node_id=lease.node_id,
                    code=reason,
                    retryable=failure.failure.retryable,
                    attempt=attempt,
                )
            if reason == wire.FailureCode.BUSY:
                self._on_busy_answer(plan.model_id, lease.provider_id)
            step = attempts.after(failure.failure, lease.provider_id)
            if step == Next.REQUEUE:
                continue  # Rule 8: full after all; wait for a slot like any request
            if step == Next.GIVE_UP:
                failure.request_fault = attempts.request_fault
                break
            moving = (lease.provider_id, reason)  # another provider may take it
        assert last_failure is not None
        raise last_failure

    async def _attempt(self, run: Run, wire_id: str, lease: Lease) -> RunFailure | None:
        """One try on one provider; None once the run holds its first event.

        Owns `lease` until the attempt is the run's; a failed attempt has released it."""
        session = self._hub.session(lease.node_id)
        if session is None:
            lease.release()
            return RunFailure(
                run_failed(
                    wire_id,
                    wire.FailureCode.NODE_LOST,
                    f"node '{lease.node_id}' is not connected",
                    retryable=True,
                ),
                lease.provider_id,
            )
        attempt = Attempt(wire_id, lease, session, run._give_up, self.scheduler.provider_saturated)
        try:
            session.open_run(wire_id, attempt)
        except SessionClosed:
            lease.release()
            return RunFailure(_node_lost_before_start(wire_id, lease), lease.provider_id)
        run._begin_attempt(attempt)
        plan = run.plan
        plan.body["model"] = lease.target
        message = wire.Run(
            run_id=wire_id,
            provider_id=lease.provider_id,
            target=lease.target,
            operation=plan.operation,
            body=_json_encode(plan.body),
            stream=plan.stream,
            reply_model=plan.model_id,
            strip_usage=plan.stream and not plan.caller_wants_usage,
            request_id=plan.run_id,
            long=lease.long,
            caller_headers=plan.caller_headers,
            keep_output=plan.keep_output,
            previous_response_id=plan.previous_response_id,
            hold_tail=plan.stream,
            hosted_tools=plan.hosted_tools,
            traceparent=plan.traceparent,
            tracestate=plan.tracestate,
        )
        sent_at = time.perf_counter()
        try:
            await session.send(message)
            first = await attempt.receive()
        except (SessionClosed, trio.EndOfChannel):
            # Nothing reached the caller: a lost link is retried elsewhere; an attempt
            # given up (its caller, a cut) says why.
            ended = attempt.end_reason
            if ended is None or ended.code == wire.FailureCode.NODE_LOST:
                ended = _node_lost_before_start(wire_id, lease)
            first = ended
        except wire.FrameTooLarge as exc:
            # The request grew past the wire's limit on its way (model defaults, the
            # re-encoding): refused here, never sent, so no Node loses its link over it.
            run._live_on_node = False
            first = run_failed(wire_id, wire.FailureCode.REQUEST_TOO_LARGE, str(exc))
        finally:
            # Cancelled or not, the caller waited this long on the provider (Rule 1).
            run.timings.upstream_s += time.perf_counter() - sent_at
        run.timings.first_event_at = time.perf_counter()
        if isinstance(first, wire.RunFailed):
            self.note_failure(lease.provider_id, first, plan)
            run._drop_attempt(first)
            return RunFailure(first, lease.provider_id)
        run._first_event(first)
        return None


def _node_lost_before_start(wire_id: str, lease: Lease) -> wire.RunFailed:
    return run_failed(
        wire_id,
        wire.FailureCode.NODE_LOST,
        f"node '{lease.node_id}' disconnected before the run started",
        retryable=True,
    )
