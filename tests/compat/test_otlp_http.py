"""schemas.runtime.compat.otlp_http on the installed SDK and OTLP/HTTP exporter: spans IOP
encoded go through the SDK's batch processor and the exporter's own client (its headers
from the environment, its content type), and what arrives at a receiver decodes to the
spans that ended, as the stock pipeline would have sent them.
"""

from __future__ import annotations

import pytest
import trio

pytest.importorskip(
    "opentelemetry.sdk",
    reason="the `otel` extra is not installed: pip install -e '.[dev]' (or '.[otel]')",
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from schemas.runtime.compat import otlp_http
from schemas.runtime.spans import Tracing, sdk_sampler
from schemas.runtime.telemetry import TraceSettings
from tests.timing import GUARD_S

from ..recording_server import RecordingServer, Seen, clear_proxy_env


def _answer(seen: Seen) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    return 200, [(b"content-type", b"application/x-protobuf")], b""


def test_the_installed_sdk_and_exporter_are_ones_the_fast_encoding_knows() -> None:
    assert otlp_http.FAST_ENCODING, "a new OpenTelemetry SDK or exporter: check the compat module"


async def _export(url: str) -> None:
    """Two traced requests' worth of spans, then the pipeline's shutdown (which sends)."""
    settings = TraceSettings(
        endpoint=f"{url}/v1/traces",
        sampler="parentbased_always_on",
        sampler_arg=1.0,
        service_name="svc",
        source="test",
    )
    pipeline = otlp_http.span_pipeline(
        settings.endpoint, service_name="svc", instance_id="node/1", version="9.9"
    )
    tracing = Tracing(settings, sampler=sdk_sampler(settings), pipeline=pipeline)
    for number in (1, 2):
        server = tracing.start(f"POST /{number}", "server", None)
        server.attributes["gen_ai.usage.input_tokens"] = 7
        server.event("iop.admitted", {"iop.attempt": number})
        client = tracing.start("chat m", "client", server.as_parent())
        client.error = True
        client.end()
        server.end()
    with trio.fail_after(GUARD_S):
        await trio.to_thread.run_sync(tracing.shutdown)
    # Shut down, it sends nothing more.
    tracing.start("late", "server", None).end()


async def _exported_once() -> Seen:
    """What a receiver saw of `_export`: one batch."""
    receiver = RecordingServer(_answer)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(receiver.serve)
        await _export(url)
        nursery.cancel_scope.cancel()
    [seen] = receiver.seen
    return seen


@pytest.mark.parametrize("fast", [True, False], ids=["iop-encoding", "stock-pipeline"])
async def test_spans_reach_a_receiver_through_the_sdk_pipeline(
    monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    clear_proxy_env(monkeypatch)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-tenant=blue")
    monkeypatch.setattr(otlp_http, "FAST_ENCODING", fast)
    seen = await _exported_once()
    assert (seen.method, seen.target) == (b"POST", b"/v1/traces")
    assert seen.values(b"content-type") == [b"application/x-protobuf"]
    assert seen.values(b"x-tenant") == [b"blue"]
    request = ExportTraceServiceRequest.FromString(seen.body)
    [resource_spans] = request.resource_spans
    resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
    assert resource["service.name"] == "svc" and resource["service.instance.id"] == "node/1"
    [scope_spans] = resource_spans.scope_spans
    assert (scope_spans.scope.name, scope_spans.scope.version) == ("iop", "9.9")
    spans = list(scope_spans.spans)
    assert [s.name for s in spans] == ["chat m", "POST /1", "chat m", "POST /2"]
    client, server = spans[:2]
    assert client.parent_span_id == server.span_id and client.trace_id == server.trace_id
    assert client.kind == Span.SpanKind.SPAN_KIND_CLIENT
    assert client.status.code == client.status.STATUS_CODE_ERROR
    assert [e.name for e in server.events] == ["iop.admitted"]
    assert server.attributes[0].key == "gen_ai.usage.input_tokens"
    assert server.attributes[0].value.int_value == 7


async def test_the_same_spans_arrive_as_the_same_message_either_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stock pipeline and IOP's encoding send equal messages but for the ids and
    times, which are new each run."""
    clear_proxy_env(monkeypatch)
    bodies = []
    for fast in (True, False):
        monkeypatch.setattr(otlp_http, "FAST_ENCODING", fast)
        seen = await _exported_once()
        request = ExportTraceServiceRequest.FromString(seen.body)
        for span in request.resource_spans[0].scope_spans[0].spans:
            span.trace_id = span.span_id = span.parent_span_id = b""
            span.start_time_unix_nano = span.end_time_unix_nano = 0
            for event in span.events:
                event.time_unix_nano = 0
        bodies.append(request)
    assert bodies[0] == bodies[1]


async def test_a_span_that_cannot_be_written_is_dropped_and_the_rest_sent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clear_proxy_env(monkeypatch)
    settings = TraceSettings(
        endpoint="",
        sampler="always_on",
        sampler_arg=1.0,
        service_name="svc",
        source="test",
    )
    receiver = RecordingServer(_answer)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(receiver.serve)
        pipeline = otlp_http.span_pipeline(
            f"{url}/v1/traces", service_name="svc", instance_id="edge/1", version="9.9"
        )
        tracing = Tracing(settings, sampler=sdk_sampler(settings), pipeline=pipeline)
        bad = tracing.start("bad", "server", None)
        bad.attributes["weird"] = object()  # type: ignore[assignment]  # not an attribute value
        bad.end()
        tracing.start("good", "server", None).end()
        with trio.fail_after(GUARD_S):
            await trio.to_thread.run_sync(tracing.shutdown)
        nursery.cancel_scope.cancel()
    [seen] = receiver.seen
    request = ExportTraceServiceRequest.FromString(seen.body)
    spans = request.resource_spans[0].scope_spans[0].spans
    assert [s.name for s in spans] == ["good"]
    assert "could not encode the span 'bad'" in caplog.text
