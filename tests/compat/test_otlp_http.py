"""schemas.compat.otlp_http on the installed OTLP/HTTP exporter: the exporter with IOP's
encoding sends through the exporter's own client (its headers from the environment, its
content type), and what arrives at a receiver decodes to the spans that were exported.
"""

from __future__ import annotations

import pytest
import trio

pytest.importorskip("opentelemetry.sdk", reason="the `otel` extra is not installed")
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.trace import SpanContext, TraceFlags

from schemas.compat.otlp_http import FAST_ENCODING, span_exporter
from tests.timing import GUARD_S

from ..recording_server import RecordingServer, Seen, clear_proxy_env


def _span(name: str) -> ReadableSpan:
    return ReadableSpan(
        name=name,
        context=SpanContext(0x1234, 0x5678, False, TraceFlags(TraceFlags.SAMPLED)),
        resource=Resource.create({"service.name": "svc"}),
        attributes={"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 7},
        start_time=1,
        end_time=2,
    )


def test_the_installed_exporter_is_one_the_fast_encoding_knows() -> None:
    exporter = span_exporter("http://127.0.0.1:9/v1/traces")
    assert isinstance(exporter, OTLPSpanExporter)
    assert FAST_ENCODING, "a new opentelemetry-exporter-otlp-proto-http: check the compat module"
    assert type(exporter) is not OTLPSpanExporter
    exporter.shutdown()


async def test_a_batch_reaches_a_receiver_through_the_exporters_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clear_proxy_env(monkeypatch)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-tenant=blue")

    def answer(seen: Seen) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return 200, [(b"content-type", b"application/x-protobuf")], b""

    receiver = RecordingServer(answer)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(receiver.serve)
        exporter = span_exporter(f"{url}/v1/traces")
        spans = [_span("one"), _span("two")]
        with trio.fail_after(GUARD_S):
            result = await trio.to_thread.run_sync(exporter.export, spans)
        exporter.shutdown()
        nursery.cancel_scope.cancel()
    assert result is SpanExportResult.SUCCESS
    [seen] = receiver.seen
    assert (seen.method, seen.target) == (b"POST", b"/v1/traces")
    assert seen.values(b"content-type") == [b"application/x-protobuf"]
    assert seen.values(b"x-tenant") == [b"blue"]
    request = ExportTraceServiceRequest.FromString(seen.body)
    names = [s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert names == ["one", "two"]
    # Shut down, it refuses further batches, as the stock exporter does.
    assert exporter.export(spans) is SpanExportResult.FAILURE
