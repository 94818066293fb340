"""Spans as IOP records them, handed to the OpenTelemetry SDK's export pipeline (design §16).

Why not through the SDK's `Tracer`: every span made there pays for a sampler call, a
context and span object with its lock, and a type check and a lock per attribute set;
in Python that is more than IOP spends on a whole request, three spans a request. IOP's
spans are few and known, so each is recorded in a plain object (`SpanRecorder`: ids,
times, a dict of attributes, a list of events) and, when it ends, handed to the
process's `SpanPipeline` (`schemas.runtime.compat.otlp_http`): queued in the SDK's
`BatchSpanProcessor`, whose export thread writes a batch as OTLP protobuf
(`schemas.runtime.otlp_encoding`) for the SDK's OTLP/HTTP exporter. The attributes a span shares
with many others (a route's, a model's, a provider's) are written once for all
(`SharedSets`).
The resource, batching, the export thread and everything the exporter does (headers,
TLS, compression, retries) are the SDK's; so is the rule of which traces are sampled
(its samplers). docs/observability.md has the measured costs.

Rules:
1. Ids are random: 128-bit trace ids and 64-bit span ids from `random.getrandbits`, never
   zero, as the SDK's `RandomIdGenerator` makes them. A child keeps its parent's trace
   id and `tracestate`.
2. Sampling: under a parent-based sampler, a span with a parent follows the parent's
   sampled flag (what the SDK's `ParentBased` does); any other span asks the SDK sampler
   (`should_sample`), so a root is decided once, by the configured rule. `always_on` and
   `always_off` answer the same for every span, so theirs is known without asking.
3. A span that is not sampled records nothing and is not exported; its context still
   travels on (flags 00), so what follows is not sampled either.
4. Attribute values are the ones IOP sets (str, int, float, bool, list of str): valid by
   construction, they are not checked again.
5. Nothing here imports OpenTelemetry until `start_tracing` runs (tracing is on).
"""

from __future__ import annotations

import random
import time
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Final, Protocol

from schemas.runtime.otlp_encoding import SPAN_ATTRIBUTES, write_attributes
from schemas.runtime.span_record import (
    Attributes,
    AttributeValue,
    Event,
    Kind,
    Parent,
    Shared,
    SharedAttributes,
    SpanRecorder,
)
from schemas.runtime.telemetry import (
    OTEL_EXTRA,
    SHUTDOWN_TIMEOUT_S,
    TelemetryUnavailable,
    TraceSettings,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.sampling import Sampler

__all__ = [
    "AttributeValue",
    "Attributes",
    "Event",
    "Kind",
    "Parent",
    "Shared",
    "SharedAttributes",
    "SharedSets",
    "SpanPipeline",
    "SpanRecorder",
    "Tracing",
    "remote_parent",
    "sdk_sampler",
    "start_tracing",
]

_getrandbits: Final = random.getrandbits
_time_ns: Final = time.time_ns
#: Samplers whose answer is the same for every span (Rule 2).
_CONSTANT: Final[Mapping[str, bool]] = {
    "always_on": True,
    "parentbased_always_on": True,
    "always_off": False,
    "parentbased_always_off": False,
}


def remote_parent(traceparent: str, tracestate: str) -> Parent | None:
    """The parent a W3C `traceparent` names; None for "". `traceparent` is one
    `schemas.runtime.telemetry.valid_traceparent` accepted: its fields are read by position."""
    if not traceparent:
        return None
    return Parent(
        int(traceparent[3:35], 16),
        int(traceparent[36:52], 16),
        bool(int(traceparent[53:55], 16) & 1),
        tracestate,
    )


def _random_id(bits: int) -> int:
    """A random id of `bits` bits other than 0 (the invalid id), Rule 1."""
    value = _getrandbits(bits)
    while not value:
        value = _getrandbits(bits)
    return value


class SharedSets(dict[Hashable, Shared]):
    """Shared attribute sets by a key that decides their values (a provider id and a
    model name, ...), made once per key: look one up with `get`, make it with `add`; each
    is kept as a one-set `Shared`, so a span that carries only it (`span.shared +=`)
    costs no new tuple. Bounded: once `limit` keys are kept, the memo starts afresh, so
    keys that stopped coming (a provider removed, a model renamed) leave."""

    __slots__ = ("_limit",)

    def __init__(self, limit: int = 1024) -> None:
        super().__init__()
        self._limit = limit

    def add(self, key: Hashable, values: Attributes) -> Shared:
        """The set of `values`, kept under `key` (the values `key` decides)."""
        if len(self) >= self._limit:
            self.clear()
        shared = self[key] = (SharedAttributes(values, write_attributes(SPAN_ATTRIBUTES, values)),)
        return shared


class SpanPipeline(Protocol):
    """Where finished, sampled spans go (`schemas.runtime.compat.otlp_http.span_pipeline`)."""

    def emit(self, span: SpanRecorder) -> None:
        """Take a finished span; never blocks (a full queue drops it)."""

    def shutdown(self, timeout_s: float) -> None:
        """Send what is queued, within `timeout_s`, and stop exporting."""


class Tracing:
    """A process's traces: its sampler and its span pipeline. Made by `start_tracing`
    (one per process; several in one test process are independent: nothing is installed
    as OpenTelemetry's global)."""

    def __init__(
        self, settings: TraceSettings, *, sampler: Sampler, pipeline: SpanPipeline
    ) -> None:
        from opentelemetry.sdk.trace.sampling import Decision
        from opentelemetry.trace import SpanKind

        self.settings = settings
        self._sampler = sampler
        self._constant = _CONSTANT.get(settings.sampler)
        self._parent_based = settings.sampler.startswith("parentbased_")
        self._pipeline = pipeline
        self._emit = pipeline.emit
        self._sample = Decision.RECORD_AND_SAMPLE
        self._kinds: Mapping[Kind, SpanKind] = {
            "internal": SpanKind.INTERNAL,
            "server": SpanKind.SERVER,
            "client": SpanKind.CLIENT,
        }

    def start(self, name: str, kind: Kind, parent: Parent | None) -> SpanRecorder:
        """A span starting now, under `parent` (None: the root of a new trace)."""
        sampled = self._constant
        if parent is None:
            trace_id = _getrandbits(128) or _random_id(128)
            if sampled is None:
                sampled = self._decide(trace_id, name, kind)
            return SpanRecorder(
                self._emit,
                name,
                kind,
                None,
                trace_id,
                _getrandbits(64) or _random_id(64),
                "",
                sampled,
                _time_ns(),
            )
        if self._parent_based:  # Rule 2
            sampled = parent.sampled
        elif sampled is None:
            sampled = self._decide(parent.trace_id, name, kind)
        return SpanRecorder(
            self._emit,
            name,
            kind,
            parent,
            parent.trace_id,
            _getrandbits(64) or _random_id(64),
            parent.tracestate,
            sampled,
            _time_ns(),
        )

    def _decide(self, trace_id: int, name: str, kind: Kind) -> bool:
        """Whether the SDK sampler samples a span of this trace (Rule 2)."""
        result = self._sampler.should_sample(None, trace_id, name, self._kinds[kind])
        return result.decision is self._sample

    def shutdown(self) -> None:
        """Send the queued spans (within `SHUTDOWN_TIMEOUT_S`) and stop exporting.

        Blocking (the export is an HTTP request): a Trio process runs it in a worker
        thread under a deadline, so a receiver that does not answer cannot hold a
        stopping process."""
        self._pipeline.shutdown(SHUTDOWN_TIMEOUT_S)


def start_tracing(settings: TraceSettings, *, instance_id: str, version: str) -> Tracing:
    """Start exporting per `settings`; raises `TelemetryUnavailable` (naming the extra to
    install) when the SDK or its exporter is missing."""
    try:
        from schemas.runtime.compat.otlp_http import span_pipeline
    except ImportError as exc:
        raise TelemetryUnavailable(
            f"tracing is on ({settings.source}) but the OpenTelemetry SDK is not installed "
            f"({exc.name or exc}): pip install '{OTEL_EXTRA}'"
        ) from None
    pipeline = span_pipeline(
        settings.endpoint,
        service_name=settings.service_name,
        instance_id=instance_id,
        version=version,
    )
    return Tracing(settings, sampler=sdk_sampler(settings), pipeline=pipeline)


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
