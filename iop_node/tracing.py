"""The Node's traces (design §16): a span per attempt, the upstream call as its child.

Each run the Edge sends is one attempt at a caller's request (after a failover, the next
attempt is another run, maybe on another Node). The runner opens an INTERNAL span per
run that continues `run.traceparent` (the Edge's span of the request), and an HTTP
adapter opens a CLIENT span for its upstream request under it and sends that span's
context in the request's `traceparent` header, so a runtime that traces joins the trace:

    Edge  POST /v1/chat/completions (SERVER)
    Node    chat qwen3 (INTERNAL)            one per attempt on this Node
              chat Qwen/Qwen3-8B (CLIENT)    the upstream HTTP request

How the tracer reaches them: `run_node(tracing=...)` installs it for the Node's tasks
(`installed`: a context variable, so each in-process Node of a test or the demo keeps
its own), and the runner makes the run's attempt current in the run's task (`active`),
where the adapter finds it (`upstream_call`). The adapter interface stays
`execute(run, emit)`: no tracing argument through every adapter.

Rules:
1. Off, nothing is installed: a run costs one context-variable read and None checks (one
   per run, one per chunk); nothing of OpenTelemetry is imported. A Node that does not
   trace still passes the Edge's `traceparent` on to the upstream as it came.
2. A span the sampler dropped records nothing, but its context still travels (flags 00:
   the upstream is told not to sample either).
3. The attempt learns what only the output says: the response model (the `model` the
   upstream wrote, before the Node puts the caller's alias in), the finish reasons (each
   distinct one, in order), and from the run's end its usage and where that came from.
4. The upstream span ends when the exchange does (its own end time) and leaves with the
   attempt's span, carrying the output facts the attempt learnt by then.
5. Names, ids, counts and codes only: never a prompt, a completion or a token.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import msgspec
import trio

from schemas.config import ProviderConfig, TelemetrySection
from schemas.telemetry import (
    OPERATION_NAMES,
    SHUTDOWN_TIMEOUT_S,
    Tracing,
    carrier_of,
    parent_context,
    provider_name,
    start_tracing,
    trace_settings,
    valid_traceparent,
    valid_tracestate,
)
from schemas.tokens import ChoiceView
from schemas.wire import FailureCode, Message, Run, RunDone, RunFailed

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Status

__all__ = [
    "AttemptTrace",
    "NodeTracing",
    "UpstreamCall",
    "current",
    "node_tracing",
    "passed_on",
    "upstream_call",
]

Header = tuple[bytes, bytes]

_installed: ContextVar[NodeTracing | None] = ContextVar("iop_node_tracing", default=None)
_attempt: ContextVar[AttemptTrace | None] = ContextVar("iop_node_attempt", default=None)

_PROTOCOL_OF: Final[Mapping[str, str]] = {
    "messages": "messages",
    "count_tokens": "messages",
    "responses": "responses",
}
#: How each end of a caller-protocol stream states why it ended (Rule 3).
_STOP_REASON: Final = re.compile(rb'"stop_reason"\s*:\s*"([A-Za-z_]{1,64})"')
_RESPONSE_STATUS: Final = re.compile(rb'"status"\s*:\s*"(completed|incomplete|failed)"')
_PROTOCOL_ENDS: Final[Mapping[str, tuple[bytes, re.Pattern[bytes]]]] = {
    "messages": (b"event: message_delta", _STOP_REASON),
    "responses": (b"event: response.", _RESPONSE_STATUS),
}


class _Limits(msgspec.Struct):
    max_completion_tokens: Any = None
    max_tokens: Any = None
    max_output_tokens: Any = None

    def bound(self) -> int | None:
        for value in (self.max_completion_tokens, self.max_tokens, self.max_output_tokens):
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None


class _Ending(msgspec.Struct):
    """What a whole response says of how it ended (chat, completions, Messages, Responses)."""

    model: Any = None
    choices: list[ChoiceView] | None = None
    stop_reason: Any = None
    status: Any = None


_decode_limits: Final = msgspec.json.Decoder(_Limits).decode
_decode_ending: Final = msgspec.json.Decoder(_Ending).decode
_decode_text: Final = msgspec.json.Decoder(str).decode


def current() -> NodeTracing | None:
    """The tracing installed for this Node's tasks, if any."""
    return _installed.get()


def node_tracing(
    section: TelemetrySection | None,
    environ: Mapping[str, str],
    *,
    node_id: str,
    version: str,
    names: Mapping[str, str],
) -> NodeTracing | None:
    """The Node's tracing per its flags (or `--config`) and environment, None when off.
    Raises `TelemetryError` naming a bad setting (`names`: how the operator spells each),
    and `TelemetryUnavailable` when the SDK is missing."""
    settings = trace_settings(section, environ, default_service="iop-node", names=names)
    if settings is None:
        return None
    return NodeTracing(start_tracing(settings, instance_id=node_id, version=version), node_id)


class NodeTracing:
    """Opens an `AttemptTrace` per run; owns the export pipeline (`aclose`)."""

    def __init__(self, tracing: Tracing, node_id: str) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self._tracing = tracing
        self.tracer = tracing.tracer
        self.node_id = node_id
        self.internal = SpanKind.INTERNAL
        self.client = SpanKind.CLIENT
        self.error = Status(StatusCode.ERROR)

    @property
    def endpoint(self) -> str:
        return self._tracing.settings.endpoint

    @contextmanager
    def installed(self) -> Iterator[None]:
        """This tracing for the tasks the caller starts meanwhile (the Node's)."""
        token = _installed.set(self)
        try:
            yield
        finally:
            _installed.reset(token)

    def attempt(self, run: Run, provider: ProviderConfig | None) -> AttemptTrace:
        model = run.reply_model or run.target
        operation = OPERATION_NAMES.get(run.operation, run.operation)
        span = self.tracer.start_span(
            f"{operation} {model}",
            context=parent_context(*_context_of(run)),
            kind=self.internal,
        )
        trace = AttemptTrace(span, self, run, provider)
        if trace.recording:
            attributes: dict[str, str | int | bool] = {
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": model,
                "iop.node.id": self.node_id,
                "iop.provider.id": run.provider_id,
                "iop.run_id": run.run_id,
                "iop.protocol": _PROTOCOL_OF.get(run.operation, "chat"),
                "iop.stream": run.stream,
            }
            if provider is not None:
                attributes["gen_ai.provider.name"] = provider_name(provider)
            try:
                bound = _decode_limits(run.body).bound()
            except (msgspec.DecodeError, RecursionError):
                bound = None
            if bound is not None:
                attributes["gen_ai.request.max_tokens"] = bound
            span.set_attributes(attributes)
        return trace

    async def aclose(self) -> None:
        """Send what is queued and stop exporting, in a worker thread, under a deadline
        (a receiver that does not answer must not hold a stopping Node)."""
        with trio.move_on_after(SHUTDOWN_TIMEOUT_S * 2, shield=True):
            await trio.to_thread.run_sync(self._tracing.shutdown, abandon_on_cancel=True)


def _context_of(run: Run) -> tuple[str, str]:
    """The run's trace context when well-formed (`schemas.telemetry` Rule 6)."""
    if not valid_traceparent(run.traceparent):
        return "", ""
    return run.traceparent, run.tracestate if valid_tracestate(run.tracestate) else ""


def passed_on(run: Run) -> list[Header]:
    """The headers that carry the Edge's trace context on to the upstream when this Node
    does not trace (Rule 1)."""
    traceparent, tracestate = _context_of(run)
    if not traceparent:
        return []
    headers = [(b"traceparent", traceparent.encode("latin-1"))]
    if tracestate:
        headers.append((b"tracestate", tracestate.encode("latin-1")))
    return headers


class AttemptTrace:
    """The span of one run on this Node (see the module docstring)."""

    __slots__ = (
        "_calls",
        "_finish_reasons",
        "_first_output",
        "_owner",
        "_provider",
        "_response_model",
        "_run",
        "recording",
        "span",
    )

    def __init__(
        self, span: Span, owner: NodeTracing, run: Run, provider: ProviderConfig | None
    ) -> None:
        self.span = span
        self.recording = span.is_recording()
        self._owner = owner
        self._run = run
        self._provider = provider
        self._first_output = False
        self._response_model: str | None = None
        self._finish_reasons: list[str] = []
        self._calls: list[UpstreamCall] = []

    @contextmanager
    def active(self) -> Iterator[None]:
        """The current attempt of this task: the adapter's upstream calls join it."""
        token = _attempt.set(self)
        try:
            yield
        finally:
            _attempt.reset(token)

    # --- what the output says (Rule 3) ---------------------------------------------

    def chunk(self, fields: Mapping[str, msgspec.Raw], choices: object) -> None:
        """One chat or completions stream chunk, as `reply.read_chunk` read it."""
        if not self.recording:
            return
        if not self._first_output:
            self._output_began()
            model = fields.get("model")
            if model is not None:
                self._learn_model(model)
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, ChoiceView):
                    self._learn_reason(choice.finish_reason)

    def events(self, events: bytes) -> None:
        """Caller-ready events of a Messages or Responses run."""
        if not self.recording:
            return
        if not self._first_output:
            self._output_began()
        end = _PROTOCOL_ENDS.get(_PROTOCOL_OF.get(self._run.operation, ""))
        if end is not None and end[0] in events:
            for match in end[1].finditer(events):
                self._learn_reason(match.group(1).decode("ascii"))

    def response(self, body: bytes, *, upstream_model: bool) -> None:
        """A whole response; `upstream_model`: its `model` is the upstream's (not the
        caller's alias yet)."""
        if not self.recording:
            return
        try:
            ending = _decode_ending(body)
        except (msgspec.DecodeError, RecursionError):
            return
        if upstream_model and isinstance(ending.model, str):
            self._response_model = ending.model
        for choice in ending.choices or ():
            self._learn_reason(choice.finish_reason)
        self._learn_reason(ending.stop_reason)
        if self._run.operation == "responses":
            self._learn_reason(ending.status)

    def _output_began(self) -> None:
        self._first_output = True
        self.span.add_event("iop.first_output")

    def _learn_model(self, raw: msgspec.Raw) -> None:
        try:
            self._response_model = _decode_text(raw)
        except msgspec.DecodeError:
            pass

    def _learn_reason(self, reason: object) -> None:
        if isinstance(reason, str) and reason and reason not in self._finish_reasons:
            self._finish_reasons.append(reason)

    # --- the upstream call ----------------------------------------------------------

    def upstream(self, url: str) -> UpstreamCall:
        """A CLIENT span for the upstream request to `url`, a child of this attempt."""
        from opentelemetry.trace import set_span_in_context

        owner = self._owner
        run = self._run
        span = owner.tracer.start_span(
            f"{OPERATION_NAMES.get(run.operation, run.operation)} {run.target}",
            context=set_span_in_context(self.span),
            kind=owner.client,
        )
        call = UpstreamCall(span, owner.error)
        if call.recording:
            try:
                parts = urlsplit(url)
                host, port = parts.hostname or "", parts.port
            except ValueError:
                host, port = "", None
            attributes: dict[str, str | int] = {
                "http.request.method": "POST",
                "url.full": url,
                "server.address": host,
                "gen_ai.operation.name": OPERATION_NAMES.get(run.operation, run.operation),
                "gen_ai.request.model": run.target,
            }
            if port is not None:
                attributes["server.port"] = port
            if self._provider is not None:
                attributes["gen_ai.provider.name"] = provider_name(self._provider)
            span.set_attributes(attributes)
        self._calls.append(call)
        return call

    # --- the end ----------------------------------------------------------------------

    def finish(self, message: Message | None) -> None:
        """The run ended with `message` (None: it was cut from outside, unanswered)."""
        span = self.span
        if not self.recording:
            for call in self._calls:
                call.span.end(end_time=call.ended_at)
            span.end()
            return
        output: dict[str, str | int | list[str]] = {}
        if self._response_model is not None:
            output["gen_ai.response.model"] = self._response_model
        if self._finish_reasons:
            output["gen_ai.response.finish_reasons"] = list(self._finish_reasons)
        usage = message.usage if isinstance(message, RunDone | RunFailed) else None
        if usage is not None:
            output["gen_ai.usage.input_tokens"] = usage.prompt_tokens
            output["gen_ai.usage.output_tokens"] = usage.completion_tokens
        attributes = dict(output)
        if isinstance(message, RunDone | RunFailed) and message.usage_source is not None:
            attributes["iop.usage_source"] = message.usage_source
        if isinstance(message, RunFailed):
            attributes["error.type"] = str(message.code)
            span.set_status(self._owner.error)
        elif message is None:
            attributes["error.type"] = str(FailureCode.CANCELLED)
        span.set_attributes(attributes)
        for call in self._calls:
            if call.error is None:
                call.span.set_attributes(output)
            call.span.end(end_time=call.ended_at)
        span.end()


class UpstreamCall:
    """The CLIENT span of one upstream request (Rule 4: the attempt ends it)."""

    __slots__ = ("_error_status", "ended_at", "error", "headers", "recording", "span")

    def __init__(self, span: Span, error_status: Status) -> None:
        self.span = span
        self._error_status = error_status
        self.recording = span.is_recording()
        traceparent, tracestate = carrier_of(span)
        self.headers: list[Header] = [(b"traceparent", traceparent.encode("ascii"))]
        """The trace context the upstream request carries: this span as its parent."""
        if tracestate:
            self.headers.append((b"tracestate", tracestate.encode("latin-1")))
        self.error: str | None = None
        self.ended_at: int | None = None

    def first_byte(self) -> None:
        if self.recording:
            self.span.add_event("iop.first_byte")

    def status(self, code: int) -> None:
        if self.recording:
            self.span.set_attribute("http.response.status_code", code)
            if code >= 400:
                self.error = str(code)
                self.span.set_attribute("error.type", self.error)
                self.span.set_status(self._error_status)

    def failed(self, code: str) -> None:
        """The exchange failed (the adapter's failure code)."""
        if self.recording and self.error is None:
            self.error = code
            self.span.set_attribute("error.type", code)
            self.span.set_status(self._error_status)

    def done(self) -> None:
        """The exchange is over: its span's end time (it leaves with the attempt)."""
        if self.ended_at is None:
            self.ended_at = time.time_ns()


def upstream_call(base_url: str, path: str) -> UpstreamCall | None:
    """A span for an upstream request to `base_url + path` of the current attempt; None
    when the run is not traced."""
    attempt = _attempt.get()
    return None if attempt is None else attempt.upstream(base_url + path)
