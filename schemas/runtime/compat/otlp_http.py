"""The OpenTelemetry SDK's span export pipeline, fed with IOP's span records.

The SDK's pipeline is a `BatchSpanProcessor` (a bounded queue, drained in batches by its
own thread; `OTEL_BSP_*` size it) in front of the OTLP/HTTP exporter, whose HTTP client
(`_client.export`) does everything else: the URL, the headers
(`OTEL_EXPORTER_OTLP_HEADERS`), compression, TLS, the timeout, retries with backoff.
`span_pipeline` queues IOP's finished span records in the processor's queue (its
`_batch_processor`), and the exporter writes each batch as OTLP protobuf with IOP's
encoder (`schemas.runtime.otlp_encoding`) and sends it through the same client: the processor
and the exporter as the SDK made them, minus the SDK's span objects and its encoder.
That reads the SDK's private `_batch_processor` and the exporter's `_client`,
`_shutdown` and `_max_request_size`, as opentelemetry-sdk and
opentelemetry-exporter-otlp-proto-http 1.45 have them.

`FAST_ENCODING` says whether the installed SDK and exporter are ones known to work that
way (`tests/compat/test_otlp_http.py` proves it against a real receiver). When they are
not, `span_pipeline` gives each span to the stock pipeline as the SDK's `ReadableSpan`
(`readable_span`): slower, equally correct. This module is the only place that names
the SDK's private attributes; it is imported only when tracing is on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Final, cast

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from schemas.runtime.otlp_encoding import TraceRequest, encode_span
from schemas.runtime.span_record import AttributeValue, SpanRecorder

__all__ = ["FAST_ENCODING", "OtlpPipeline", "readable_span", "span_pipeline", "trace_request"]

log = logging.getLogger(__name__)

_KNOWN_MINOR_VERSIONS: Final = ("1.45.",)

FAST_ENCODING: Final = all(
    version(package).startswith(_KNOWN_MINOR_VERSIONS)
    for package in ("opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http")
)
"""Whether the installed SDK's processor has the queue `span_pipeline` feeds, and its
exporter the client that pipeline hands bytes to."""

_KINDS: Final = {
    "internal": SpanKind.INTERNAL,
    "server": SpanKind.SERVER,
    "client": SpanKind.CLIENT,
}
_SAMPLED: Final = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED: Final = TraceFlags(TraceFlags.DEFAULT)
_UNSET: Final = Status(StatusCode.UNSET)
_FAILED: Final = Status(StatusCode.ERROR)


class _RecordedSpanExporter(OTLPSpanExporter):
    """`OTLPSpanExporter` writing its batches from IOP's span records (`encode_span`)."""

    def __init__(self, endpoint: str, request: TraceRequest) -> None:
        super().__init__(endpoint=endpoint)
        self._request = request

    def export(self, spans: Sequence[object]) -> SpanExportResult:
        """Send one batch: the items are what `OtlpPipeline.emit` queued, finished spans."""
        if self._shutdown:
            return SpanExportResult.FAILURE
        encoded = []
        for span in cast("Sequence[SpanRecorder]", spans):
            try:
                encoded.append(encode_span(span))
            except Exception:  # a value the encoder cannot write: that span, not the batch
                log.exception("could not encode the span %r", span.name)
        data = self._request(encoded)
        if 0 < self._max_request_size < len(data):
            log.warning(
                "dropping %d spans: the request would be %d bytes, more than the "
                "exporter's limit of %d",
                len(encoded),
                len(data),
                self._max_request_size,
            )
            return SpanExportResult.FAILURE
        result = self._client.export(data)
        return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE


class OtlpPipeline:
    """A process's span pipeline (`schemas.runtime.spans.SpanPipeline`): the SDK's batch
    processor and OTLP/HTTP exporter."""

    __slots__ = ("_processor", "emit")

    def __init__(self, processor: BatchSpanProcessor, emit: Callable[[SpanRecorder], None]) -> None:
        self._processor = processor
        self.emit = emit
        """Take a finished, sampled span (the request path: never blocks)."""

    def shutdown(self, timeout_s: float) -> None:
        """The export thread sends what is queued and stops; waited for `timeout_s` at
        most. (The processor's `force_flush` has no deadline: it exports until the
        collector answers, up to the exporter's own timeout per batch and its retries.)
        An export still waiting on the collector then is abandoned with its daemon
        thread; the exporter refuses any later batch."""
        if FAST_ENCODING:
            batches = self._processor._batch_processor
            batches.shutdown(timeout_millis=max(0, int(timeout_s * 1000)))
        else:
            self._processor.shutdown()  # type: ignore[no-untyped-call]  # unannotated in the SDK


def span_pipeline(
    endpoint: str, *, service_name: str, instance_id: str, version: str
) -> OtlpPipeline:
    """The pipeline to `endpoint` (the full traces URL) for one process; the resource
    says which process (`service.*`), the scope is `iop` at `version`."""
    resource = Resource.create(
        {
            "service.name": service_name,
            "service.version": version,
            "service.instance.id": instance_id,
        }
    )
    scope = InstrumentationScope("iop", version)
    if not FAST_ENCODING:
        processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
        on_end = processor.on_end

        def emit_readable(span: SpanRecorder) -> None:
            on_end(readable_span(span, resource, scope))

        return OtlpPipeline(processor, emit_readable)
    processor = BatchSpanProcessor(_RecordedSpanExporter(endpoint, trace_request(resource, scope)))
    # Typed for the SDK's spans, the queue holds what it is given: IOP's, for the exporter.
    return OtlpPipeline(
        processor, cast("Callable[[SpanRecorder], None]", processor._batch_processor.emit)
    )


def trace_request(resource: Resource, scope: InstrumentationScope) -> TraceRequest:
    """The export request of a process with this resource and scope."""
    return TraceRequest(
        resource=resource.attributes,
        resource_schema_url=resource.schema_url,
        scope_name=scope.name,
        scope_version=scope.version or "",
        scope_attributes=scope.attributes,
        scope_schema_url=scope.schema_url or "",
    )


def _attributes_of(span: SpanRecorder) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {}
    for shared in span.shared:
        attributes.update(shared.values)
    attributes.update(span.attributes)
    return attributes


def readable_span(
    span: SpanRecorder, resource: Resource, scope: InstrumentationScope
) -> ReadableSpan:
    """`span` as the SDK's finished-span type, as the SDK's own tracer would have made it."""
    state = TraceState.from_header([span.tracestate]) if span.tracestate else None
    parent = span.parent
    parent_context = None
    if parent is not None:
        flags = _SAMPLED if parent.sampled else _NOT_SAMPLED
        parent_context = SpanContext(parent.trace_id, parent.span_id, parent.remote, flags)
    return ReadableSpan(
        name=span.name,
        context=SpanContext(span.trace_id, span.span_id, False, _SAMPLED, state),
        parent=parent_context,
        resource=resource,
        attributes=_attributes_of(span),
        events=[Event(name, attributes, at) for name, at, attributes in span.events or ()],
        kind=_KINDS[span.kind],
        status=_FAILED if span.error else _UNSET,
        start_time=span.start_ns,
        end_time=span.end_ns,
        instrumentation_scope=scope,
    )
