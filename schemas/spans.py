"""Spans as IOP records them, handed to the OpenTelemetry SDK's export pipeline (design §16).

Why not through the SDK's `Tracer`: every span made there pays for a sampler call, a
context and span object with its lock, and a type check and a lock per attribute set;
in Python that is more than IOP spends on a whole request, three spans a request. IOP's
spans are few and known, so each is recorded in a plain object (`SpanRecorder`: ids,
times, a dict of attributes, a list of events) and, when it ends, turned once into the
SDK's own finished-span type (`ReadableSpan`) and handed to the SDK's
`BatchSpanProcessor`, which queues it for its export thread and the OTLP/HTTP exporter
(`schemas.compat.otlp_http`). The resource, batching, the export thread and everything
the exporter does (headers, TLS, compression, retries) are the SDK's; so is the rule of
which traces are sampled (its samplers). docs/observability.md has the measured costs.

Rules:
1. Ids are random: 128-bit trace ids and 64-bit span ids from `random.getrandbits`, as
   the SDK's `RandomIdGenerator` makes them. A child keeps its parent's trace id and
   `tracestate`.
2. Sampling: under a parent-based sampler, a span with a parent follows the parent's
   sampled flag (what the SDK's `ParentBased` does); any other span asks the SDK sampler
   (`should_sample`), so a root is decided once, by the configured rule.
3. A span that is not sampled records nothing and builds no SDK object; its context still
   travels on (flags 00), so what follows is not sampled either.
4. Attribute values are the ones IOP sets (str, int, float, bool, list of str): valid by
   construction, they are not checked again.
5. Nothing here imports OpenTelemetry until `start_tracing` runs (tracing is on).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from schemas.telemetry import OTEL_EXTRA, SHUTDOWN_TIMEOUT_S, TelemetryUnavailable, TraceSettings

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

__all__ = [
    "Kind",
    "Parent",
    "SpanRecorder",
    "Tracing",
    "remote_parent",
    "sdk_sampler",
    "start_tracing",
]

Kind = Literal["internal", "server", "client"]
AttributeValue = str | int | float | bool | Sequence[str]
Attributes = dict[str, AttributeValue]

_getrandbits: Final = random.getrandbits
_time_ns: Final = time.time_ns


@dataclass(frozen=True, slots=True)
class Parent:
    """The span a new span continues: the caller's or the Edge's (`remote`), or one of
    this process's own."""

    trace_id: int
    span_id: int
    sampled: bool
    tracestate: str = ""
    remote: bool = True


def remote_parent(traceparent: str, tracestate: str) -> Parent | None:
    """The parent a W3C `traceparent` names; None for "". `traceparent` is one
    `schemas.telemetry.valid_traceparent` accepted: its fields are read by position."""
    if not traceparent:
        return None
    return Parent(
        trace_id=int(traceparent[3:35], 16),
        span_id=int(traceparent[36:52], 16),
        sampled=bool(int(traceparent[53:55], 16) & 1),
        tracestate=tracestate,
    )


class SpanRecorder:
    """One span being recorded (see the module docstring). `end` hands it on, once."""

    __slots__ = (
        "_ended",
        "_tracing",
        "attributes",
        "error",
        "events",
        "kind",
        "name",
        "parent",
        "sampled",
        "span_id",
        "start_ns",
        "trace_id",
        "tracestate",
    )

    def __init__(
        self, tracing: Tracing, name: str, kind: Kind, parent: Parent | None, sampled: bool
    ) -> None:
        self._tracing = tracing
        self.name = name
        self.kind = kind
        self.parent = parent
        self.trace_id = parent.trace_id if parent is not None else _getrandbits(128)
        self.span_id = _getrandbits(64)
        self.tracestate = parent.tracestate if parent is not None else ""
        self.sampled = sampled
        self.start_ns = _time_ns()
        self.attributes: Attributes = {}
        self.events: list[tuple[str, int, Attributes]] = []
        self.error = False
        self._ended = False

    def event(self, name: str, attributes: Attributes) -> None:
        if self.sampled:
            self.events.append((name, _time_ns(), attributes))

    def carrier(self) -> tuple[str, str]:
        """`(traceparent, tracestate)` that make this span the parent of what follows."""
        flags = "01" if self.sampled else "00"
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{flags}", self.tracestate

    def as_parent(self) -> Parent:
        """This span as the parent of another span of this process."""
        return Parent(self.trace_id, self.span_id, self.sampled, self.tracestate, remote=False)

    def end(self, end_ns: int | None = None) -> None:
        """The span is over (at `end_ns`, else now); later calls do nothing."""
        if self._ended:
            return
        self._ended = True
        if self.sampled:
            self._tracing.export(self, end_ns or _time_ns())


class Tracing:
    """A process's traces: its sampler, resource and the SDK's batch processor with the
    OTLP/HTTP exporter behind it. Made by `start_tracing` (one per process; several in
    one test process are independent: nothing is installed as OpenTelemetry's global)."""

    def __init__(
        self,
        settings: TraceSettings,
        *,
        sampler: Sampler,
        resource: Resource,
        scope: InstrumentationScope,
        processor: BatchSpanProcessor,
    ) -> None:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.trace.sampling import Decision
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
        from opentelemetry.trace.span import TraceState

        self.settings = settings
        self._sampler = sampler
        self._record_and_sample = Decision.RECORD_AND_SAMPLE
        self._parent_based = settings.sampler.startswith("parentbased_")
        self._resource = resource
        self._scope = scope
        self._processor = processor
        self._readable_span = ReadableSpan
        self._event = Event
        self._context = SpanContext
        self._trace_state = TraceState
        self._sampled_flags = TraceFlags(TraceFlags.SAMPLED)
        self._unsampled_flags = TraceFlags(TraceFlags.DEFAULT)
        self._kinds: Mapping[Kind, Any] = {
            "internal": SpanKind.INTERNAL,
            "server": SpanKind.SERVER,
            "client": SpanKind.CLIENT,
        }
        self._unset = Status(StatusCode.UNSET)
        self._failed = Status(StatusCode.ERROR)

    def start(self, name: str, kind: Kind, parent: Parent | None) -> SpanRecorder:
        """A span starting now, under `parent` (None: the root of a new trace)."""
        if parent is not None and self._parent_based:
            return SpanRecorder(self, name, kind, parent, parent.sampled)  # Rule 2
        span = SpanRecorder(self, name, kind, parent, False)
        result = self._sampler.should_sample(None, span.trace_id, name, self._kinds[kind])
        span.sampled = result.decision is self._record_and_sample
        return span

    def export(self, span: SpanRecorder, end_ns: int) -> None:
        """Hand a finished, sampled span to the batch processor (its export thread)."""
        state = self._trace_state.from_header([span.tracestate]) if span.tracestate else None
        parent = span.parent
        parent_context = None
        if parent is not None:
            parent_context = self._context(
                parent.trace_id,
                parent.span_id,
                parent.remote,
                self._sampled_flags if parent.sampled else self._unsampled_flags,
            )
        event = self._event
        self._processor.on_end(
            self._readable_span(
                name=span.name,
                context=self._context(
                    span.trace_id, span.span_id, False, self._sampled_flags, state
                ),
                parent=parent_context,
                resource=self._resource,
                attributes=span.attributes,
                events=[event(name, attrs, at) for name, at, attrs in span.events],
                kind=self._kinds[span.kind],
                status=self._failed if span.error else self._unset,
                start_time=span.start_ns,
                end_time=end_ns,
                instrumentation_scope=self._scope,
            )
        )

    def shutdown(self) -> None:
        """Send the queued spans (within `SHUTDOWN_TIMEOUT_S`) and stop exporting.

        Blocking (the export is an HTTP request): a Trio process runs it in a worker
        thread under a deadline, so a receiver that does not answer cannot hold a
        stopping process."""
        self._processor.force_flush(int(SHUTDOWN_TIMEOUT_S * 1000))
        self._processor.shutdown()  # type: ignore[no-untyped-call]  # unannotated in the SDK


def start_tracing(settings: TraceSettings, *, instance_id: str, version: str) -> Tracing:
    """Start exporting per `settings`; raises `TelemetryUnavailable` (naming the extra to
    install) when the SDK or its exporter is missing."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from schemas.compat.otlp_http import span_exporter
    except ImportError as exc:
        raise TelemetryUnavailable(
            f"tracing is on ({settings.source}) but the OpenTelemetry SDK is not installed "
            f"({exc.name or exc}): pip install '{OTEL_EXTRA}'"
        ) from None
    resource = Resource.create(
        {
            "service.name": settings.service_name,
            "service.version": version,
            "service.instance.id": instance_id,
        }
    )
    return Tracing(
        settings,
        sampler=sdk_sampler(settings),
        resource=resource,
        scope=InstrumentationScope("iop", version),
        processor=BatchSpanProcessor(span_exporter(settings.endpoint)),
    )


def sdk_sampler(settings: TraceSettings) -> Sampler:
    """The SDK sampler `settings` name (`OTEL_TRACES_SAMPLER`'s meaning)."""
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_OFF,
        ALWAYS_ON,
        ParentBased,
        TraceIdRatioBased,
    )

    root: Sampler
    match settings.sampler:
        case "always_on" | "parentbased_always_on":
            root = ALWAYS_ON
        case "always_off" | "parentbased_always_off":
            root = ALWAYS_OFF
        case "traceidratio" | "parentbased_traceidratio":
            root = TraceIdRatioBased(settings.sampler_arg)
    # A root span has no parent, so `ParentBased` hands it to `root`; and a span with a
    # parent never reaches the sampler under a parent-based rule (Rule 2).
    return ParentBased(root) if settings.sampler.startswith("parentbased_") else root
