"""The run endpoints, as plain ASGI under Hypercorn: chat completions, completions,
embeddings, Anthropic Messages (and its count_tokens) and OpenAI Responses (design §8, §14).

These carry nearly all of the Edge's traffic, so they skip the web framework: a
request is one function from ASGI `receive` to ASGI `send`. Quart-Trio's per-request
machinery (request and response objects, app and request contexts, hooks, two extra tasks
per request) would cost more than everything IOP itself does for a run
(docs/benchmarks.md#results); the rest of the surface (`/v1/models`, `/healthz`, error
pages) stays on Quart, where that cost does not matter (see `openai_app`).

A request, in the task Hypercorn gives it:

1. *Prepare*: authenticate (`Authorization: Bearer` or `x-api-key`), read the body
   (`request_body`: bounded in size and time), decode it once into a dict
   (provider-specific fields pass through untouched); the path's caller protocol (its
   `CallerProtocol`, found in `protocol_registry`: `chat`, `messages`, `responses`)
   plans it: checks it against a small view of the fields the Edge acts on and applies
   the model's generation defaults and limits. The result is a `RunPlan`; anything
   wrong is an error reply in the caller's protocol's shape naming the field. Every
   shape the reply takes (errors, rate-limit headers, a stream's end and failure) is the
   protocol object's.
2. *Dispatch*: the scheduler admits the plan and a Node starts it (`runtime.dispatch.Run`,
   which owns the slot until the run ends).
3. *Respond*: one JSON body, or the run relayed as server-sent events (written by the
   session's reader itself while this task waits, when the caller's socket takes them
   at once: dispatch Rule 9). Every reply, an error too, carries `x-request-id` (the
   caller's, when sane) and `Server-Timing` with the queue wait, the upstream time (every
   attempt's, a failed one's too) and the Edge's own share; every reply from a run that
   reached a provider carries `x-iop-provider`. A Responses run with `store: true` is
   stored before its reply's last bytes go out (`responses`).

From step 2 on, a watcher task cancels the request when the caller disconnects. The run
(`runtime.dispatch.Run`) owns its slot and its metering: this module tells it how the
exchange ended, on every path it knows, and once more in a `finally` for the paths it
does not (the caller left: 499 `client_closed`; a bug: 500). On a normal end the run is
ended (slot released, run metered) *before* the last bytes go out, so a caller that saw
the response (or `[DONE]`, or the last event of a Messages or Responses stream) can
count on both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Final

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope

from iop_edge.core.responses.unstored_reply import unstored_body, unstored_events
from iop_edge.core.routing.affinity import SESSION_HEADERS
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.auth import authenticate
from iop_edge.http.connection import ChunkedBodyWriter, current_connection
from iop_edge.http.errors import (
    ApiError,
    admission_error,
    metering_unavailable,
    method_not_allowed,
    run_failure_error,
)
from iop_edge.http.protocols.caller_protocol import Caller, CallerProtocol, Planning, ToStore
from iop_edge.http.protocols.compaction import settle, trigger_events
from iop_edge.http.protocols.protocol_registry import Route
from iop_edge.http.protocols.responses import ResponsesSurface
from iop_edge.http.request_body import CallerGone, read_json
from iop_edge.http.request_ids import new_run_id, request_id
from iop_edge.runtime.metering.access_log import RefusedRequest
from iop_edge.runtime.metering.metering import Metering
from iop_edge.runtime.metering.tracing import EdgeTracing, RequestTrace
from iop_edge.runtime.runs.admission_errors import AdmissionError
from iop_edge.runtime.runs.dispatch import (
    CALLER_GONE,
    INTERNAL_ERROR,
    DirectWrite,
    Dispatcher,
    Outcome,
    RelayEvent,
    Run,
    RunFailure,
    RunPlan,
    Unwritten,
)
from iop_edge.runtime.runs.limits import NO_RATE_LIMITS
from schemas import wire
from schemas.hosted_tools import DROPPED_TOOLS_HEADER
from schemas.runtime.telemetry import valid_traceparent, valid_tracestate

log = logging.getLogger(__name__)

_JSON_TYPE: Final = (b"content-type", b"application/json")
#: The HTTP versions whose connections carry one request at a time: their caller left
#: when the connection ends (`Connection.on_client_gone`).
_HTTP1: Final = frozenset(("1.0", "1.1"))
_SSE_HEADERS: Final = ((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"))

Headers = list[tuple[bytes, bytes]]


class _Timing:
    """Server-Timing: queue wait, upstream (node + provider) and the Edge's own share."""

    __slots__ = ("queued_s", "started", "upstream_s")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.queued_s = 0.0
        self.upstream_s = 0.0

    def header(self) -> bytes:
        total = time.perf_counter() - self.started
        edge = max(0.0, total - self.queued_s - self.upstream_s)
        return (
            f"queue;dur={self.queued_s * 1000:.2f}, upstream;dur={self.upstream_s * 1000:.2f}, "
            f"edge;dur={edge * 1000:.2f}"
        ).encode()


class _Request:
    """The few request headers the run endpoints read, found in one pass."""

    __slots__ = (
        "anthropic",
        "api_key",
        "authorization",
        "content_encoding",
        "content_length",
        "host",
        "origin",
        "path",
        "request_id",
        "sessions",
        "traceparent",
        "tracestate",
    )

    def __init__(self, scope: HTTPScope) -> None:
        self.path = scope["path"]
        self.host: str | None = None
        self.origin: str | None = None
        """`Host` and `Origin`, for an open API's `browser_guard`."""
        self.authorization = ""
        self.api_key = ""
        self.content_length: int | None = None
        self.content_encoding: str | None = None
        self.request_id: str | None = None
        self.anthropic: dict[str, str] = {}
        """`anthropic-version` and `anthropic-beta`, as sent."""
        self.sessions: dict[str, str] = {}
        """The session headers of `core.routing.affinity` (Rule 1), as sent."""
        self.traceparent = ""
        self.tracestate = ""
        """The caller's W3C trace context (`schemas.runtime.telemetry` Rule 6: checked when
        used)."""
        for name, value in scope["headers"]:
            if name == b"authorization":
                self.authorization = value.decode("latin-1")
            elif name == b"content-length" and value.isdigit():
                self.content_length = int(value)
            elif name == b"x-request-id":
                self.request_id = value.decode("latin-1")
            elif name == b"content-encoding":
                self.content_encoding = value.decode("latin-1").strip().lower()
            elif name == b"x-api-key":
                self.api_key = value.decode("latin-1")
            elif name == b"host":
                self.host = value.decode("latin-1")
            elif name == b"origin":
                self.origin = value.decode("latin-1")
            elif name == b"traceparent":
                self.traceparent = value.decode("latin-1").strip()
            elif name == b"tracestate":
                self.tracestate = value.decode("latin-1").strip()
            elif name in _SESSION_HEADERS:
                self.sessions[name.decode("latin-1")] = value.decode("latin-1").strip()
            elif name in _ANTHROPIC_HEADERS:
                key = name.decode("latin-1")
                joined = self.anthropic.get(key)
                text = value.decode("latin-1")
                self.anthropic[key] = text if joined is None else f"{joined},{text}"


_DROPPED_TOOLS: Final = DROPPED_TOOLS_HEADER.encode()
#: The headers that name an agent's session (`core.routing.affinity` Rule 1).
_SESSION_HEADERS: Final = frozenset(name.encode() for name in SESSION_HEADERS)
#: The caller's protocol headers a native Messages upstream sees as they were sent.
_ANTHROPIC_HEADERS: Final = frozenset({b"anthropic-version", b"anthropic-beta"})


class _Reply:
    """Writes one response through ASGI `send`, with the headers every reply carries."""

    __slots__ = (
        "_send",
        "complete",
        "dropped_tools",
        "error_code",
        "outcome",
        "protocol",
        "provider",
        "rate_limits",
        "request_id",
        "started",
        "status",
    )

    def __init__(self, send: ASGISendCallable, request_id: str, protocol: CallerProtocol) -> None:
        self._send = send
        self.request_id = request_id
        self.protocol = protocol
        """The caller's protocol: whose shapes the reply takes."""
        self.provider: str | None = None
        self.rate_limits = NO_RATE_LIMITS
        """Where the caller's principal stands against its limits, once admitted."""
        self.started = False
        self.status = 499
        """The status the caller was answered with (499 until a response starts)."""
        self.error_code: str | None = None
        self.dropped_tools: str | None = None
        """The hosted tool types the run leaves out (`schemas.hosted_tools`), for the
        `iop-dropped-tools` header; None: none."""
        self.complete = False
        """The last body message is on its way: a disconnect from now on is the normal end
        of the exchange (Hypercorn reports one once the response is written)."""
        self.outcome: Outcome | None = None
        """How the exchange's run ended (the access line's status and code), once it
        did: a stream's may not be the status its headers said (a caller that left, an
        upstream that broke off)."""

    def _headers(self, timing: _Timing, extra: Headers) -> Headers:
        headers = [(b"x-request-id", self.request_id.encode()), (b"server-timing", timing.header())]
        if self.provider is not None:
            headers.append((b"x-iop-provider", self.provider.encode()))
        if self.dropped_tools is not None:
            headers.append((_DROPPED_TOOLS, self.dropped_tools.encode()))
        headers += extra
        if self.rate_limits:
            headers += self.protocol.rate_limit_headers(self.rate_limits)
        return headers

    async def json(
        self,
        body: bytes,
        timing: _Timing,
        status: int = 200,
        extra: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        headers = [_JSON_TYPE, (b"content-length", str(len(body)).encode()), *extra]
        await self._start(status, self._headers(timing, headers))
        await self.finish(body)

    async def error(self, error: ApiError, timing: _Timing) -> None:
        self.error_code = error.code
        if error.rate_limits is not None:  # refused for a limit: where it stands now
            self.rate_limits = error.rate_limits
        extra = [(name.lower().encode(), value.encode()) for name, value in error.headers().items()]
        body = self.protocol.error_body(error, self.request_id)
        await self.json(body, timing, error.status, extra)

    async def start_stream(self, timing: _Timing) -> None:
        await self._start(200, self._headers(timing, list(_SSE_HEADERS)))

    async def stream(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, data: bytes) -> None:
        """Send the last body message."""
        self.complete = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def _start(self, status: int, headers: Headers) -> None:
        self.started = True
        self.status = status
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    def chunk_writer(self) -> ChunkedBodyWriter | None:
        """The connection's writer of this response's chunks, when it has one (a chunked
        HTTP/1.1 response on one of the Edge's own connections)."""
        send = self._send
        return send if isinstance(send, ChunkedBodyWriter) else None


class RunEndpoints:
    """Serves `RUN_PATHS` (see the module docstring)."""

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        dispatcher: Dispatcher,
        metering: Metering,
        responses: ResponsesSurface,
        on_refused: Callable[[RefusedRequest], None] | None = None,
        *,
        tracing: EdgeTracing | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._tracing = tracing
        self._dispatcher = dispatcher
        self._metering = metering
        self._responses = responses
        self._on_refused = on_refused

    async def __call__(
        self,
        route: Route,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
    ) -> None:
        timing = _Timing()
        run_id = new_run_id()
        request = _Request(scope)
        reply = _Reply(send, request_id(request.request_id, run_id), route.protocol)
        trace = None
        if self._tracing is not None:
            traceparent, tracestate = _caller_context(request)
            trace = self._tracing.begin(
                method=scope["method"],
                path=scope["path"],
                request_id=reply.request_id,
                traceparent=traceparent,
                tracestate=tracestate,
            )
        try:
            if scope["method"] != "POST":
                refusal = method_not_allowed(scope["method"], scope["path"], allow="POST")
                await reply.error(refusal, timing)
                return
            try:
                plan, to_store = await self._prepare(
                    route, run_id, reply.request_id, request, receive
                )
            except ApiError as exc:
                self.refused(exc, reply.request_id, scope["path"], timing.started)
                await reply.error(exc, timing)
                return
            _continue_trace(plan, trace, request)
            connection = current_connection()
            if connection is not None and scope["http_version"] in _HTTP1:
                with trio.CancelScope() as cancel:
                    stop_watching = connection.on_client_gone(partial(_caller_left, cancel, reply))
                    try:
                        await self._run(plan, reply, timing, to_store)
                    finally:
                        stop_watching()
            else:  # HTTP/2 (a stream ends alone), or another server: a watcher task
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope, reply)
                    await self._run(plan, reply, timing, to_store)
                    nursery.cancel_scope.cancel()
        except CallerGone:
            return
        except Exception:
            log.exception("unexpected error serving %s %s", scope["method"], scope["path"])
            if not reply.started:
                error = ApiError(
                    500, "Internal error in the IOP Edge", type="api_error", code="internal_error"
                )
                await reply.error(error, timing)
        finally:
            if trace is not None:
                outcome = reply.outcome or Outcome(reply.status, reply.error_code)
                trace.end(status=outcome.status, code=outcome.code)

    async def run_planned(self, plan: RunPlan, reply: Reply, to_store: ToStore | None) -> None:
        """Steps 2 and 3 for a request planned elsewhere, written through `reply`: a
        Responses WebSocket turn (`responses_socket`), with its own `Reply` that writes
        events as WebSocket messages. Admission, limits, queueing, metering and storing
        are the HTTP path's own."""
        await self._run(plan, reply, _Timing(), to_store)

    def refused(self, exc: ApiError, request_id: str, path: str, started: float) -> None:
        """Meter and access-log a request refused before it was planned (`started`: its
        `time.perf_counter()` when it came)."""
        self._metering.refused(status=exc.status, code=exc.code)
        if self._on_refused is not None:
            self._on_refused(
                RefusedRequest(
                    request_id=request_id,
                    path=path,
                    status=exc.status,
                    code=exc.code,
                    latency_s=time.perf_counter() - started,
                )
            )

    @property
    def metering(self) -> Metering:
        return self._metering

    @property
    def responses(self) -> ResponsesSurface:
        return self._responses

    def snapshot(self) -> Snapshot:
        return self._snapshot()

    # --- 1. prepare -------------------------------------------------------------------

    async def _prepare(
        self,
        route: Route,
        run_id: str,
        request_id: str,
        request: _Request,
        receive: ASGIReceiveCallable,
    ) -> tuple[RunPlan, ToStore | None]:
        """Authenticate, read and check the request: the plan the dispatcher runs, and
        what to store of its result (a Responses run with `store: true`)."""
        snapshot = self._snapshot()
        try:
            principal = authenticate(
                snapshot.principals,
                request.authorization,
                request.api_key,
                host=request.host,
                origin=request.origin,
                listen=snapshot.config.openai.listen,
            )
        except ApiError as refused:  # the body stays unread: the connection ends here
            refused.close_connection = True
            raise
        encoding = request.content_encoding
        if encoding not in (None, "", "identity"):
            unsupported = ApiError(
                415,
                f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                code="unsupported_content_encoding",
            )
            unsupported.close_connection = True  # the body stays unread
            raise unsupported
        body = await read_json(
            receive, request.content_length, snapshot.config.openai.max_request_bytes
        )
        unmetered = self._metering.refusal()
        if unmetered is not None:  # no run starts that could not be metered
            raise metering_unavailable(unmetered)
        caller = Caller(
            run_id=run_id,
            request_id=request_id,
            principal=principal,
            anthropic_headers=request.anthropic,
            session_headers=request.sessions,
        )
        planning = Planning(
            path=request.path,
            body=body,
            snapshot=snapshot,
            caller=caller,
            store=self._responses.store,
        )
        return await route.protocol.plan(route.operation, planning)

    # --- 2. dispatch ------------------------------------------------------------------

    async def _run(
        self, plan: RunPlan, reply: _Reply, timing: _Timing, to_store: ToStore | None
    ) -> None:
        run = self._dispatcher.open(plan)
        try:
            try:
                await run.start()
            except AdmissionError as exc:
                error = admission_error(exc, request_id=plan.request_id or plan.run_id)
                await self._refuse(run, error, reply, timing)
                return
            except RunFailure as exc:
                error = run_failure_error(
                    exc.failure,
                    exc.provider_id,
                    request_id=plan.request_id or plan.run_id,
                    request_fault=exc.request_fault,
                )
                reply.provider = exc.provider_id
                await self._refuse(run, error, reply, timing)
                return
            finally:
                timing.queued_s = run.timings.queued_s
                timing.upstream_s = run.timings.upstream_s
                reply.rate_limits = run.rate_limits
            reply.provider = run.provider_id
            reply.dropped_tools = self._dropped_tools(plan, reply.protocol, run.provider_id)
            if plan.stream:
                await self._relay_stream(run, reply, timing, to_store)
            else:
                await self._respond(run, reply, timing, to_store)
        except Exception:
            run.end(INTERNAL_ERROR)  # a bug of ours, not the caller leaving
            raise
        finally:
            run.end(CALLER_GONE)  # a no-op unless the caller left before the run ended
            reply.outcome = run.outcome

    def _dropped_tools(
        self, plan: RunPlan, protocol: CallerProtocol, provider_id: str
    ) -> str | None:
        """The hosted tools a run on `provider_id` leaves out, comma-separated: those of
        a request the provider's Node translates (as far as the Edge knows: the Node's
        last status), unless the model refuses them instead (`schemas.hosted_tools`
        Rule 2)."""
        if plan.hosted_tools != "drop":
            return None
        if self._dispatcher.scheduler.speaks(provider_id, plan.protocol):
            return None
        return ", ".join(protocol.hosted_tools(plan.body)) or None

    async def _refuse(self, run: Run, error: ApiError, reply: _Reply, timing: _Timing) -> None:
        """Answer with `error`; the reply carries the same timing (every failed attempt's
        wait charged to `upstream`) and provider and rate-limit headers as a success would."""
        run.end(Outcome(error.status, error.code))
        timing.queued_s = run.timings.queued_s
        timing.upstream_s = run.timings.upstream_s
        reply.rate_limits = run.rate_limits
        await reply.error(error, timing)

    # --- 3. respond -------------------------------------------------------------------

    async def _respond(
        self, run: Run, reply: _Reply, timing: _Timing, to_store: ToStore | None
    ) -> None:
        """A non-stream run: one JSON body (or the run's failure as an error)."""
        event = await run.next_event()
        while isinstance(event, bytes | Unwritten):  # a non-stream run has none: strays
            event = await run.next_event()
        if isinstance(event, wire.RunFailed):
            error = run_failure_error(event, run.provider_id, request_id=_request_id(run))
            await self._refuse(run, error, reply, timing)
            return
        payload = event.response
        if payload is None or not _is_json_object(payload):
            problem = "no response body" if payload is None else "not a JSON object"
            failure = run.reject_payload(wire.FailureCode.BAD_RESPONSE, problem)
            error = run_failure_error(failure, run.provider_id, request_id=_request_id(run))
            await self._refuse(run, error, reply, timing)
            return
        compaction = None if to_store is None else to_store.compaction
        if compaction is not None:  # a summary turn: the compaction it makes
            settled = settle(compaction, payload, _request_id(run))
            if settled is None:
                failure = run.reject_payload(wire.FailureCode.BAD_RESPONSE, "no summary text")
                error = run_failure_error(failure, run.provider_id, request_id=_request_id(run))
                await self._refuse(run, error, reply, timing)
                return
            payload = settled
            log.info(
                "request %s: compacted the conversation with the model (%s)",
                _request_id(run),
                "/v1/responses/compact" if compaction.endpoint else "compaction_trigger",
            )
        run.end(Outcome(200))
        extra: list[tuple[bytes, bytes]] = []
        if to_store is not None and to_store.store:
            unstored = await self._responses.keep(to_store, payload)
            if unstored is not None:
                payload = unstored_body(payload)
            extra.append((_STORED_HEADER, b"false" if unstored else b"true"))
        if compaction is not None and compaction.stream:
            await reply.start_stream(timing)
            await reply.finish(trigger_events(payload))
            return
        await reply.json(payload, timing, extra=extra)

    async def _relay_stream(
        self, run: Run, reply: _Reply, timing: _Timing, to_store: ToStore | None
    ) -> None:
        """Relay a stream run's events as they come, then the protocol's end (chat's
        `[DONE]`; Messages and Responses end with their last events, which the run's end
        carries, `run_done.tail`), written only once the run is ended and metered: a
        caller may hang up the moment it reads them, and that is a completed run.

        The Node sends events ready for the caller (SSE-framed, with the caller's alias);
        the Edge checks their framing and writes them as they are. While this task waits,
        the session's reader writes them to the caller itself when the socket takes them
        at once (dispatch Rule 9): no task switch per upstream read. What is already here
        goes out in one write: when the caller's side is slower than the provider, the
        cost per event stays flat."""
        await reply.start_stream(timing)
        writer = reply.chunk_writer()
        if writer is not None:
            run.write_directly(_framing_checked(writer.write_now))
        event: RelayEvent = await run.next_event()
        while True:
            pending: list[bytes] = []
            while isinstance(event, bytes | Unwritten):
                if isinstance(event, Unwritten):  # the rest of a write begun for us
                    assert writer is not None and not pending  # it comes only to a waiter
                    await writer.write_rest(event.data)
                    event = await run.next_event()
                    continue
                if not _is_sse_events(event):
                    # End the stream properly; the run may still be live on the Node, and
                    # ending it below cancels it there.
                    event = run.reject_payload(
                        wire.FailureCode.BAD_CHUNK, "events not framed as server-sent events"
                    )
                    break
                pending.append(event)
                ready = run.ready_event()
                if ready is None:
                    await reply.stream(pending[0] if len(pending) == 1 else b"".join(pending))
                    pending = []
                    ready = await run.next_event()
                event = ready
            if isinstance(event, wire.RunDone) and event.tail:
                if _is_sse_events(event.tail):
                    pending.append(event.tail)  # after `run.end` below, as `[DONE]` is
                else:
                    event = run.reject_payload(
                        wire.FailureCode.BAD_CHUNK,
                        "the stream's last events are not framed as server-sent events",
                    )
            outcome = Outcome(200)
            protocol = reply.protocol
            if isinstance(event, wire.RunFailed):
                error = run_failure_error(event, run.provider_id, request_id=_request_id(run))
                outcome = Outcome(error.status, error.code)
                plan = run.plan
                pending.append(
                    protocol.stream_error(
                        error, plan=plan, sequence=run.chunks, request_id=reply.request_id
                    )
                )
            pending.append(protocol.stream_end)
            run.end(outcome)
            if (
                to_store is not None
                and isinstance(event, wire.RunDone)
                and await self._responses.keep(to_store, event.response) is not None
            ):
                # Not stored: the held tail's final response says so
                # (`core.responses.unstored_reply`).
                pending = [unstored_events(part) for part in pending]
            await reply.finish(b"".join(pending))
            return


#: How a run's reply is written: `runs` writes HTTP; a WebSocket turn subclasses it.
Reply = _Reply
Timing = _Timing

#: Whether a `store: true` response was stored (non-stream replies; `http.protocols.responses`).
_STORED_HEADER: Final = b"x-iop-response-stored"


def _request_id(run: Run) -> str:
    """The `x-request-id` the caller got."""
    return run.plan.request_id or run.plan.run_id


def _caller_context(request: _Request) -> tuple[str, str]:
    """The caller's `traceparent` and `tracestate`, each "" when absent or malformed
    (`schemas.runtime.telemetry` Rule 6)."""
    if not valid_traceparent(request.traceparent):
        return "", ""
    return request.traceparent, request.tracestate if valid_tracestate(request.tracestate) else ""


def _continue_trace(plan: RunPlan, trace: RequestTrace | None, request: _Request) -> None:
    """Set the trace context the Node continues: the request's span when the Edge traces,
    else the caller's own context, passed on as it came (an Edge that does not trace is
    transparent to a caller's trace)."""
    if trace is not None:
        trace.planned(
            model=plan.model_id,
            operation=plan.operation,
            protocol=plan.protocol,
            principal_ref=plan.principal_ref,
            body=plan.body,
        )
        plan.trace = trace
        plan.traceparent, plan.tracestate = trace.traceparent, trace.tracestate
    elif request.traceparent:
        plan.traceparent, plan.tracestate = _caller_context(request)


def _framing_checked(write_now: Callable[[bytes], bytes | None]) -> DirectWrite:
    """`write_now` for events framed as server-sent events; the others are left to the
    relay, which ends the run for them."""

    def write(events: bytes) -> bytes | None:
        return write_now(events) if _is_sse_events(events) else None

    return write


def _is_sse_events(data: bytes) -> bool:
    """Whether `data` looks like whole server-sent events (a framing check, O(1)): chat's
    start with their `data:` line, Messages' and Responses' with their `event:` line."""
    return data.startswith(_SSE_STARTS) and data.endswith(b"\n\n")


_SSE_STARTS: Final = (b"data: ", b"event: ")


def _is_json_object(data: bytes) -> bool:
    """Whether `data` is framed as a JSON object (its ends, not its contents)."""
    body = data.strip()
    return body.startswith(b"{") and body.endswith(b"}")


def _caller_left(scope: trio.CancelScope, reply: _Reply) -> None:
    """Cancel the request when its caller disconnects (the body is already read) before
    the response is complete; after that, the disconnect only ends the exchange."""
    if not reply.complete:
        scope.cancel()


async def _cancel_on_disconnect(
    receive: ASGIReceiveCallable, scope: trio.CancelScope, reply: _Reply
) -> None:
    """`_caller_left` when ASGI `receive` says the caller disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass
    _caller_left(scope, reply)
