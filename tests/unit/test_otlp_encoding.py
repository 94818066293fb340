"""IOP's OTLP encoder writes the message the exporter's own encoder builds, and its spans
follow the SDK's sampling rules (`schemas.otlp_encoding`, `schemas.spans`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the `otel` extra is not installed")
from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
    encode_spans as sdk_encode_spans,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from schemas.otlp_encoding import encode_spans
from schemas.spans import Parent, Tracing, remote_parent, sdk_sampler
from schemas.telemetry import TraceSettings


class _Kept:
    """A batch processor's place: keeps what the pipeline hands it."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)

    def force_flush(self, timeout_millis: int = 0) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def _tracing(sampler: str = "parentbased_always_on", ratio: float = 1.0) -> tuple[Tracing, _Kept]:
    settings = TraceSettings(
        endpoint="http://127.0.0.1:9/v1/traces",
        sampler=sampler,  # type: ignore[arg-type]
        sampler_arg=ratio,
        service_name="svc",
        source="test",
    )
    kept = _Kept()
    tracing = Tracing(
        settings,
        sampler=sdk_sampler(settings),
        resource=Resource.create({"service.name": "svc"}),
        scope=InstrumentationScope("iop", "9.9"),
        processor=kept,  # type: ignore[arg-type]
    )
    return tracing, kept


def _spans() -> Sequence[ReadableSpan]:
    tracing, kept = _tracing()
    caller = remote_parent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "a=1,b=2")
    server = tracing.start("POST /v1/chat/completions", "server", caller)
    values: dict[str, Any] = {
        "text": "π is not a token: ✓",
        "empty": "",
        "count": 42,
        "negative": -7,
        "zero": 0,
        "ratio": 0.25,
        "yes": True,
        "no": False,
        "reasons": ["stop", "length"],
        "none": [],
    }
    server.attributes.update(values)
    server.event("iop.admitted", {"iop.queue_wait_s": 0.5, "iop.attempt": 0})
    server.event("bare", {})
    child = tracing.start("chat m", "internal", server.as_parent())
    client = tracing.start("chat target", "client", child.as_parent())
    client.error = True
    client.end(server.start_ns + 5)
    child.end()
    server.end()
    root = tracing.start("root", "server", None)
    root.attributes.update(values)
    root.end()
    return kept.spans


def test_the_bytes_decode_to_the_message_the_exporter_builds() -> None:
    spans = _spans()
    assert len(spans) == 4
    ours = ExportTraceServiceRequest.FromString(encode_spans(spans))
    assert ours == sdk_encode_spans(spans)
    # ... twice over (the attribute cache answers the second time).
    assert ExportTraceServiceRequest.FromString(encode_spans(spans)) == ours


def test_spans_keep_their_parents_and_the_callers_trace() -> None:
    server, child, client, root = _by_name(_spans(), "POST", "chat m", "chat target", "root")
    trace_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert server.context.trace_id == child.context.trace_id == client.context.trace_id
    assert server.context.trace_id == trace_id and root.context.trace_id != trace_id
    assert server.parent is not None and server.parent.span_id == 0x00F067AA0BA902B7
    assert server.parent.is_remote and child.parent is not None and not child.parent.is_remote
    assert child.parent.span_id == server.context.span_id
    assert client.parent is not None and client.parent.span_id == child.context.span_id
    assert client.end_time == server.start_time + 5
    assert client.status.status_code.name == "ERROR" and server.status.status_code.name == "UNSET"
    assert server.context.trace_state.to_header() == "a=1,b=2"
    assert root.parent is None


def _by_name(spans: Sequence[ReadableSpan], *prefixes: str) -> list[ReadableSpan]:
    return [next(s for s in spans if s.name.startswith(prefix)) for prefix in prefixes]


def test_a_parent_based_sampler_follows_the_parent_and_drops_what_it_does_not_sample() -> None:
    tracing, kept = _tracing("parentbased_always_off")
    sampled = Parent(trace_id=1, span_id=2, sampled=True)
    unsampled = Parent(trace_id=1, span_id=3, sampled=False)
    followed = tracing.start("followed", "server", sampled)
    dropped = tracing.start("dropped", "server", unsampled)
    root = tracing.start("root", "server", None)  # always_off decides a root
    assert (followed.sampled, dropped.sampled, root.sampled) == (True, False, False)
    assert dropped.carrier()[0].endswith("-00") and followed.carrier()[0].endswith("-01")
    for span in (followed, dropped, root):
        span.attributes["k"] = "v"
        span.event("e", {})
        span.end()
        span.end()  # once
    assert [s.name for s in kept.spans] == ["followed"]


def test_a_ratio_sampler_decides_roots_by_trace_id_and_ignores_parents_when_not_parent_based() -> (
    None
):
    tracing, _ = _tracing("traceidratio", 0.5)
    decisions = [tracing.start("r", "server", None).sampled for _ in range(2000)]
    assert 800 < sum(decisions) < 1200
    # The trace id's lower 64 bits against the ratio's bound, whatever the parent says.
    below = Parent(trace_id=(7 << 64) | (1 << 62), span_id=3, sampled=False)
    above = Parent(trace_id=(7 << 64) | (3 << 62), span_id=3, sampled=True)
    assert tracing.start("child", "server", below).sampled
    assert not tracing.start("child", "server", above).sampled
