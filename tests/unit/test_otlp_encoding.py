"""IOP's OTLP encoder writes the message the exporter's own encoder builds, and its spans
follow the SDK's sampling rules (`schemas.runtime.otlp_encoding`, `schemas.runtime.spans`)."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip(
    "opentelemetry.sdk",
    reason="the `otel` extra is not installed: pip install -e '.[dev]' (or '.[otel]')",
)
from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
    encode_spans as sdk_encode_spans,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from schemas.runtime.compat.otlp_http import readable_span, trace_request
from schemas.runtime.otlp_encoding import encode_span
from schemas.runtime.spans import (
    Parent,
    SharedSets,
    SpanRecorder,
    Tracing,
    remote_parent,
    sdk_sampler,
)
from schemas.runtime.telemetry import TraceSettings

RESOURCE = Resource.create({"service.name": "svc", "service.instance.id": "edge/1"})
SCOPE = InstrumentationScope("iop", "9.9")


class _Kept:
    """A span pipeline's place: keeps what it is handed."""

    def __init__(self) -> None:
        self.spans: list[SpanRecorder] = []

    def emit(self, span: SpanRecorder) -> None:
        self.spans.append(span)

    def shutdown(self, timeout_s: float) -> None:
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
    return Tracing(settings, sampler=sdk_sampler(settings), pipeline=kept), kept


def _spans(tracestate: str = "a=1,b=2") -> Sequence[SpanRecorder]:
    tracing, kept = _tracing()
    caller = remote_parent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", tracestate)
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
        "one": 1,  # equal to True, written as an int
        "reasons": ["stop", "length"],
        "kept reasons": ("stop",),
        "nested": (["a"], "b"),  # not a value IOP sets, and no value to look up: still written
        "none": [],
    }
    server.attributes.update(values)
    shared = SharedSets()
    route = {"http.request.method": "POST", "url.path": "/v1/chat/completions"}
    server.shared += shared.add(("route",), route) + shared.add(("plan",), {"iop.protocol": "chat"})
    server.event("iop.admitted", {"iop.queue_wait_s": 0.5, "iop.attempt": 0})
    server.event("bare", {})
    child = tracing.start("chat m", "internal", server.as_parent())
    client = tracing.start("chat target", "client", child.as_parent())
    client.shared += shared[("route",)]  # the same set on another span
    client.error = True
    client.end(server.start_ns + 5)
    child.end()
    server.end()
    root = tracing.start("root", "server", None)
    root.attributes.update(values)
    root.attributes["one"] = True  # the same key, now a bool: not the int kept above
    root.end()
    return kept.spans


def _ours(spans: Sequence[SpanRecorder]) -> ExportTraceServiceRequest:
    data = trace_request(RESOURCE, SCOPE)([encode_span(span) for span in spans])
    request: ExportTraceServiceRequest = ExportTraceServiceRequest.FromString(data)
    return request


def _readable(spans: Sequence[SpanRecorder]) -> list[ReadableSpan]:
    return [readable_span(span, RESOURCE, SCOPE) for span in spans]


@pytest.mark.parametrize("tracestate", ["a=1,b=2", " a=1 , b=2,", ""])
def test_the_bytes_decode_to_the_message_the_exporter_builds(tracestate: str) -> None:
    spans = _spans(tracestate)
    assert len(spans) == 4
    ours = _ours(spans)
    assert ours == sdk_encode_spans(_readable(spans))
    # ... twice over (the attribute cache answers the second time).
    assert _ours(spans) == ours
    [root] = [s for s in ours.resource_spans[0].scope_spans[0].spans if s.name == "root"]
    assert {kv.key: kv.value.WhichOneof("value") for kv in root.attributes}["one"] == ("bool_value")


def test_shared_attributes_are_the_spans_own_as_the_sdk_sees_them() -> None:
    server, client = _by_name(_readable(_spans()), "POST", "chat target")
    assert (
        server.attributes["url.path"] == client.attributes["url.path"] == ("/v1/chat/completions")
    )
    assert server.attributes["iop.protocol"] == "chat" and server.attributes["count"] == 42


def test_shared_sets_start_afresh_when_full() -> None:
    sets = SharedSets(limit=2)
    first = sets.add("a", {"k": "a"})
    sets.add("b", {"k": "b"})
    assert sets.get("a") is first and first[0].values == {"k": "a"}
    sets.add("c", {"k": "c"})
    assert sets.get("a") is None and list(sets) == ["c"]


def test_spans_keep_their_parents_and_the_callers_trace() -> None:
    server, child, client, root = _by_name(
        _readable(_spans()), "POST", "chat m", "chat target", "root"
    )
    trace_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert server.context.trace_id == child.context.trace_id == client.context.trace_id
    assert server.context.trace_id == trace_id and root.context.trace_id != trace_id
    assert server.parent is not None and server.parent.span_id == 0x00F067AA0BA902B7
    assert server.parent.is_remote and child.parent is not None and not child.parent.is_remote
    assert child.parent.span_id == server.context.span_id
    assert client.parent is not None and client.parent.span_id == child.context.span_id
    assert server.start_time is not None and client.end_time == server.start_time + 5
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
    assert dropped.events is None and root.events is None


def test_a_constant_sampler_that_is_not_parent_based_ignores_the_parent() -> None:
    on, _ = _tracing("always_on")
    off, _ = _tracing("always_off")
    unsampled = Parent(trace_id=1, span_id=3, sampled=False)
    assert on.start("child", "client", unsampled).sampled
    assert not off.start("child", "client", Parent(trace_id=1, span_id=3, sampled=True)).sampled


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


def test_a_finished_span_waits_for_export_out_of_the_collectors_sight() -> None:
    tracing, kept = _tracing()
    span = tracing.start("s", "server", Parent(trace_id=1, span_id=2, sampled=True))
    span.attributes["reasons"] = ["stop"]
    span.end()
    assert kept.spans == [span]
    assert not gc.is_tracked(span) and not gc.is_tracked(span.parent)


def test_ids_are_never_zero_and_children_keep_the_trace() -> None:
    tracing, _ = _tracing()
    roots = [tracing.start("r", "server", None) for _ in range(200)]
    assert all(span.trace_id and span.span_id for span in roots)
    assert len({span.trace_id for span in roots}) == len(roots)
    child = tracing.start("c", "internal", roots[0].as_parent())
    assert child.trace_id == roots[0].trace_id and child.span_id != roots[0].span_id
