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
   attempt's span, with the response model the attempt learnt by then; the finish
   reasons and the usage are the attempt's.
5. Names, ids, counts and codes only: never a prompt, a completion or a token.
6. Spans are recorded by `schemas.runtime.spans`; the first output and the first upstream byte
   are attributes (`iop.time_to_first_output_s`, `iop.time_to_first_byte_s`, seconds
   from the span's start), which trace backends search more readily than events.
7. What every attempt of one operation, model and provider says alike (and every call
   to one upstream URL) is one shared attribute set (`schemas.runtime.spans.SharedSets`),
   written once; a span carries its own values (run id, bound, usage, status) besides.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import msgspec
import trio

from schemas.config import ProviderConfig, TelemetrySection
from schemas.runtime.spans import (
    Attributes,
    Parent,
    SharedSets,
    SpanRecorder,
    Tracing,
    remote_parent,
    start_tracing,
)
from schemas.runtime.telemetry import (
    MAX_TRACESTATE_CHARS,
    OPERATION_NAMES,
    SHUTDOWN_TIMEOUT_S,
    provider_name,
    trace_settings,
    valid_traceparent,
    valid_tracestate,
)
from schemas.wire import FailureCode, Message, Run, RunDone, RunFailed

__all__ = [
    "AttemptTrace",
    "NodeTracing",
    "ProtocolTrace",
    "UpstreamCall",
    "current",
    "node_tracing",
    "passed_on",
    "upstream_call",
]

Header = tuple[bytes, bytes]

_installed: ContextVar[NodeTracing | None] = ContextVar("iop_node_tracing", default=None)
_attempt: ContextVar[AttemptTrace | None] = ContextVar("iop_node_attempt", default=None)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtocolTrace:
    """How a caller protocol's runs are traced (each protocol's translator has one)."""

    name: str
    """`iop.protocol`."""
    end_event: bytes
    """What the event that ends a stream begins with, to find among a run's events."""
    end_reason: re.Pattern[bytes]
    """Why the stream ended, read off that event (Rule 3): its group 1."""
    status_is_reason: bool = False
    """A whole response's `status` is a finish reason too (Responses')."""


class _Limits(msgspec.Struct):
    max_completion_tokens: Any = None
    max_tokens: Any = None
    max_output_tokens: Any = None

    def bound(self) -> int | None:
        for value in (self.max_completion_tokens, self.max_tokens, self.max_output_tokens):
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None


class _Choice(msgspec.Struct):
    finish_reason: Any = None


class _Ending(msgspec.Struct):
    """What a whole response says of how it ended (chat, completions, Messages, Responses);
    everything else in it is skipped unread."""

    model: Any = None
    choices: list[_Choice] | None = None
    stop_reason: Any = None
    status: Any = None


_decode_limits: Final = msgspec.json.Decoder(_Limits).decode
_decode_ending: Final = msgspec.json.Decoder(_Ending).decode
_decode_text: Final = msgspec.json.Decoder(str).decode
#: The messages that end a run with its usage.
_ENDED: Final = (RunDone, RunFailed)


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
        self.tracing = tracing
        self.node_id = node_id
        self._shared = SharedSets()
        """The attributes attempts share, per operation, model and provider."""
        self._call_sets = SharedSets()
        """The attributes upstream calls share, per operation, model and URL."""

    @property
    def endpoint(self) -> str:
        return self.tracing.settings.endpoint

    @contextmanager
    def installed(self) -> Iterator[None]:
        """This tracing for the tasks the caller starts meanwhile (the Node's)."""
        token = _installed.set(self)
        try:
            yield
        finally:
            _installed.reset(token)

    def attempt(
        self, run: Run, provider: ProviderConfig | None, protocol: ProtocolTrace | None = None
    ) -> AttemptTrace:
        """The span of `run` (`protocol`: its caller protocol's, None: chat's)."""
        model = run.reply_model or run.target
        operation = OPERATION_NAMES.get(run.operation, run.operation)
        span = self.tracing.start(f"{operation} {model}", "internal", _parent_of(run))
        name = provider_name(provider) if provider is not None and span.sampled else None
        if span.sampled:
            key = (run.operation, model, run.provider_id, name)
            shared = self._shared.get(key)
            if shared is None:
                values: Attributes = {
                    "gen_ai.operation.name": operation,
                    "gen_ai.request.model": model,
                    "iop.node.id": self.node_id,
                    "iop.provider.id": run.provider_id,
                    "iop.protocol": "chat" if protocol is None else protocol.name,
                }
                if name is not None:
                    values["gen_ai.provider.name"] = name
                shared = self._shared.add(key, values)
            span.shared += shared
            attributes = span.attributes
            attributes["iop.run_id"] = run.run_id
            try:
                bound = _decode_limits(run.body).bound()
            except (msgspec.DecodeError, RecursionError):
                bound = None
            if bound is not None:
                attributes["gen_ai.request.max_tokens"] = bound
        return AttemptTrace(span, self.tracing, run, name, self._call_sets, protocol=protocol)

    async def aclose(self) -> None:
        """Send what is queued and stop exporting, in a worker thread, under a deadline
        (a receiver that does not answer must not hold a stopping Node)."""
        with trio.move_on_after(SHUTDOWN_TIMEOUT_S, shield=True):
            await trio.to_thread.run_sync(self.tracing.shutdown, abandon_on_cancel=True)


def _context_of(run: Run) -> tuple[str, str]:
    """The run's trace context when well-formed (`schemas.runtime.telemetry` Rule 6)."""
    if not valid_traceparent(run.traceparent):
        return "", ""
    return run.traceparent, run.tracestate if valid_tracestate(run.tracestate) else ""


def _parent_of(run: Run) -> Parent | None:
    """`_context_of(run)` as the parent of the run's span (one check of each field)."""
    traceparent = run.traceparent
    if not valid_traceparent(traceparent):
        return None
    tracestate = run.tracestate
    return remote_parent(traceparent, tracestate if len(tracestate) <= MAX_TRACESTATE_CHARS else "")


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
        "_call_sets",
        "_calls",
        "_finish_reasons",
        "_first_output",
        "_protocol",
        "_provider_name",
        "_response_model",
        "_run",
        "_token",
        "_tracing",
        "_upstream_read",
        "recording",
        "span",
    )

    def __init__(
        self,
        span: SpanRecorder,
        tracing: Tracing,
        run: Run,
        provider_name: str | None,
        call_sets: SharedSets,
        *,
        protocol: ProtocolTrace | None = None,
    ) -> None:
        self._token: Token[AttemptTrace | None] | None = None
        self._protocol = protocol
        self.span = span
        self.recording = span.sampled
        self._tracing = tracing
        self._run = run
        self._provider_name = provider_name
        self._call_sets = call_sets
        self._first_output = False
        self._response_model: str | None = None
        self._upstream_read = False
        """A translated run's upstream model was looked for (`upstream_model`: once)."""
        self._finish_reasons: list[str] = []
        self._calls: list[UpstreamCall] = []

    def active(self) -> AttemptTrace:
        """`with trace.active():` this is the current attempt of the task meanwhile: the
        adapter's upstream calls join it. (A plain context manager: a generator-based one
        costs more than the rest of a span.)"""
        return self

    def __enter__(self) -> None:
        self._token = _attempt.set(self)

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _attempt.reset(self._token)
            self._token = None

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
        if choices.__class__ is list:  # not `type()`: a call per chunk
            for choice in choices:
                if choice.finish_reason:  # each chunk has choices; few end one
                    self._learn_reason(choice.finish_reason)

    def events(self, events: bytes) -> None:
        """Caller-ready events of a Messages or Responses run."""
        if not self.recording:
            return
        if not self._first_output:
            self._output_began()
        protocol = self._protocol
        if protocol is not None and protocol.end_event in events:
            for match in protocol.end_reason.finditer(events):
                self._learn_reason(match.group(1).decode("ascii"))

    def response(self, body: bytes, *, upstream_model: bool) -> None:
        """A whole response; `upstream_model`: its `model` is the upstream's (not the
        caller's alias yet)."""
        if not self.recording:
            return
        if not self._first_output:  # a whole response: its output begins as it arrives
            self._output_began()
        try:
            ending = _decode_ending(body)
        except (msgspec.DecodeError, RecursionError):
            return
        if upstream_model and isinstance(ending.model, str):
            self._response_model = ending.model
        reasons = [choice.finish_reason for choice in ending.choices or ()]
        reasons.append(ending.stop_reason)
        if self._protocol is not None and self._protocol.status_is_reason:
            reasons.append(ending.status)
        for reason in reasons:
            if reason.__class__ is str and reason and reason not in self._finish_reasons:
                self._finish_reasons.append(reason)

    def upstream_model(self, reply: bytes) -> None:
        """The model a translated run's upstream answered as, from its first chunk or its
        response (the caller's events name the caller's alias)."""
        if not self.recording or self._upstream_read:
            return
        self._upstream_read = True
        try:
            model = _decode_ending(reply).model
        except (msgspec.DecodeError, RecursionError):
            return
        if isinstance(model, str):
            self._response_model = model

    def answered_as(self, model: str) -> None:
        """The model a native run's upstream answered as (module function `answered_as`)."""
        self._response_model = model

    def _output_began(self) -> None:
        self._first_output = True
        span = self.span
        span.attributes["iop.time_to_first_output_s"] = round(
            (time.time_ns() - span.start_ns) / 1e9, 6
        )

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
        run = self._run
        operation = OPERATION_NAMES.get(run.operation, run.operation)
        span = self._tracing.start(f"{operation} {run.target}", "client", self.span.as_parent())
        if span.sampled:
            key = (run.operation, run.target, url, self._provider_name)
            shared = self._call_sets.get(key)
            if shared is None:
                host, port = _server_of(url)
                values: Attributes = {
                    "http.request.method": "POST",
                    "url.full": url,
                    "server.address": host,
                }
                if port is not None:
                    values["server.port"] = port
                values["gen_ai.operation.name"] = operation
                values["gen_ai.request.model"] = run.target
                if self._provider_name is not None:
                    values["gen_ai.provider.name"] = self._provider_name
                shared = self._call_sets.add(key, values)
            span.shared += shared
        call = UpstreamCall(span)
        self._calls.append(call)
        return call

    # --- the end ----------------------------------------------------------------------

    def finish(self, message: Message | None) -> None:
        """The run ended with `message` (None: it was cut from outside, unanswered)."""
        span = self.span
        if self.recording:
            attributes = span.attributes
            if self._response_model is not None:
                attributes["gen_ai.response.model"] = self._response_model
            if self._finish_reasons:
                # A tuple: the encoder keeps tuples of str written (a list it cannot).
                attributes["gen_ai.response.finish_reasons"] = tuple(self._finish_reasons)
            if isinstance(message, _ENDED):
                usage = message.usage
                if usage is not None:
                    attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
                    attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
                if message.usage_source is not None:
                    attributes["iop.usage_source"] = message.usage_source
            if isinstance(message, RunFailed):
                attributes["error.type"] = str(message.code)
                span.error = True
            elif message is None:
                attributes["error.type"] = str(FailureCode.CANCELLED)
        for call in self._calls:
            call.end(self._response_model)
        span.end()


class UpstreamCall:
    """The CLIENT span of one upstream request (Rule 4: the attempt ends it)."""

    __slots__ = ("ended_at", "error", "headers", "span")

    def __init__(self, span: SpanRecorder) -> None:
        self.span = span
        traceparent, tracestate = span.carrier()
        self.headers: list[Header] = [(b"traceparent", traceparent.encode("ascii"))]
        """The trace context the upstream request carries: this span as its parent."""
        if tracestate:
            self.headers.append((b"tracestate", tracestate.encode("latin-1")))
        self.error: str | None = None
        self.ended_at: int | None = None

    def first_byte(self) -> None:
        span = self.span
        attributes = span.attributes
        if span.sampled and "iop.time_to_first_byte_s" not in attributes:
            elapsed = (time.time_ns() - span.start_ns) / 1e9
            attributes["iop.time_to_first_byte_s"] = round(elapsed, 6)

    def status(self, code: int) -> None:
        if self.span.sampled:
            self.span.attributes["http.response.status_code"] = code
        if code >= 400:
            self.error = str(code)

    def failed(self, code: str) -> None:
        """The exchange failed (the adapter's failure code)."""
        if self.error is None:
            self.error = code

    def done(self) -> None:
        """The exchange is over: its span's end time (it leaves with the attempt)."""
        if self.ended_at is None:
            self.ended_at = time.time_ns()

    def end(self, response_model: str | None) -> None:
        """End the span at its own end time, with the model the upstream answered as
        (Rule 4: the finish reasons and usage are on the attempt's span); a failed call
        gets its error instead."""
        span = self.span
        if span.sampled:
            if self.error is not None:
                span.attributes["error.type"] = self.error
                span.error = True
            elif response_model is not None:
                span.attributes["gen_ai.response.model"] = response_model
        span.end(self.ended_at)


@functools.lru_cache(maxsize=256)
def _server_of(url: str) -> tuple[str, int | None]:
    """`server.address` and `server.port` of an upstream URL (a provider's few URLs)."""
    try:
        parts = urlsplit(url)
        return parts.hostname or "", parts.port
    except ValueError:
        return "", None


def upstream_model(reply: bytes) -> None:
    """A translated run's upstream chat chunk or response (`reply`): the model it names is
    the upstream's (`gen_ai.response.model`), once. Nothing when the run is not traced."""
    attempt = _attempt.get()
    if attempt is not None:
        attempt.upstream_model(reply)


def answered_as(model: str) -> None:
    """A native run's upstream named `model` (`gen_ai.response.model`), read before the
    caller's alias took its place. Nothing when the run is not traced."""
    attempt = _attempt.get()
    if attempt is not None and attempt.recording:
        attempt.answered_as(model)


def upstream_call(base_url: str, path: str) -> UpstreamCall | None:
    """A span for an upstream request to `base_url + path` of the current attempt; None
    when the run is not traced."""
    attempt = _attempt.get()
    return None if attempt is None else attempt.upstream(base_url + path)
