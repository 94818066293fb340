"""OpenTelemetry traces through a real Edge and Node, into a real OTLP/HTTP receiver.

The receiver is a small HTTP server on 127.0.0.1:0 that takes `POST /v1/traces` and
decodes each body with the OTLP protobuf types (`opentelemetry-proto`), as a collector
would. The Edge exports through its config (`edge.telemetry`), the Node through its own
settings; both export in batches, and the spans are read once each process has flushed
on stopping. A caller's `traceparent` is continued: one trace per request, the Edge's
SERVER span under the caller's, the Node's attempt span under the Edge's, the upstream
HTTP call under the attempt, and the upstream request carries the upstream span's
context. No attribute holds the prompt or the completion.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import trio
import yaml

from iop_node import __version__ as node_version
from iop_node.cli import TELEMETRY_FLAGS
from iop_node.tracing import NodeTracing, node_tracing
from schemas.config import TelemetrySection
from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import Stack, edge_config, start_stack
from tests.e2e.upstreams import upstream_provider
from tests.recording_server import RecordingServer, Seen

pytest.importorskip(
    "opentelemetry.sdk",
    reason="the `otel` extra is not installed: pip install -e '.[dev]' (or '.[otel]')",
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

#: Words a caller sends or an upstream writes: no attribute may carry them.
PROMPT = "the password is PAPAYA-7731, keep it secret"
CALLER_TRACE = secrets.token_hex(16)
CALLER_SPAN = secrets.token_hex(8)


@dataclass(frozen=True)
class Exported:
    """One span as the receiver decoded it, with its process's `service.name`."""

    service: str
    span: Span

    @property
    def attributes(self) -> dict[str, Any]:
        return {kv.key: _value(kv.value) for kv in self.span.attributes}

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    def events(self) -> dict[str, list[dict[str, Any]]]:
        found: dict[str, list[dict[str, Any]]] = {}
        for event in self.span.events:
            found.setdefault(event.name, []).append(
                {kv.key: _value(kv.value) for kv in event.attributes}
            )
        return found


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


class Receiver:
    """An OTLP/HTTP traces receiver (the collector's side of the exporter)."""

    def __init__(self) -> None:
        self.server = RecordingServer(self._answer)
        self.paths: list[bytes] = []

    def _answer(self, seen: Seen) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        self.paths.append(seen.target)
        if seen.method != b"POST" or seen.target != b"/v1/traces":
            return 404, [], b""
        ExportTraceServiceRequest.FromString(seen.body)  # a body that does not decode fails
        body = ExportTraceServiceResponse().SerializeToString()
        return 200, [(b"content-type", b"application/x-protobuf")], body

    def spans(self) -> list[Exported]:
        exported = []
        for seen in self.server.seen:
            request = ExportTraceServiceRequest.FromString(seen.body)
            for resource in request.resource_spans:
                service = next(
                    kv.value.string_value
                    for kv in resource.resource.attributes
                    if kv.key == "service.name"
                )
                for scope in resource.scope_spans:
                    exported += [Exported(service, span) for span in scope.spans]
        return exported


def _strings(exported: list[Exported]) -> Iterator[str]:
    """Every string an attribute or event of these spans carries."""
    for item in exported:
        values: list[Any] = list(item.attributes.values())
        for events in item.events().values():
            for event in events:
                values += event.values()
        for value in values:
            for one in value if isinstance(value, list) else [value]:
                if isinstance(one, str):
                    yield one


@asynccontextmanager
async def traced_stack(
    tmp_path: Path,
    upstreams: list[FakeUpstream],
    *,
    principals: list[dict[str, Any]] | None = None,
    **sections: Any,
) -> AsyncIterator[tuple[Stack, Receiver]]:
    """An Edge and a Node that both trace into a fresh receiver, over `upstreams` (one
    `vllm` provider each, `up-1`, `up-2`, ... serving the model `m`, in that order of
    priority), with `principals` as the config's. On exit both processes stop and flush;
    `Receiver.spans` then has it all."""
    receiver = Receiver()
    async with trio.open_nursery() as nursery:
        await nursery.start(receiver.server.serve)
        providers = []
        for index, upstream in enumerate(upstreams, 1):
            await nursery.start(upstream.serve)
            providers.append(upstream_provider(f"up-{index}", upstream.base_url, priority=index))
        text = edge_config(
            tmp_path / "state",
            providers=providers,
            models=[{"id": "m", "providers": {p["id"]: "fake-model" for p in providers}}],
            edge_section={"telemetry": {"endpoint": receiver.server.url}},
            **sections,
        )
        if principals is not None:
            text += yaml.safe_dump({"principals": principals})
        tracing = node_tracing(
            TelemetrySection(endpoint=receiver.server.url),
            {},
            node_id="node-1",
            version=node_version,
            names=TELEMETRY_FLAGS,
        )
        assert isinstance(tracing, NodeTracing)
        async with trio.open_nursery() as serving:
            stack = await start_stack(
                serving,
                text,
                tmp_path / "edge.yaml",
                wait_models=("m",),
                node_kwargs={"tracing": tracing},
            )
            yield stack, receiver
            stack.kill_node()
            stack.edge.stop()  # `serve` returns once drained, its spans sent
        await tracing.aclose()
        nursery.cancel_scope.cancel()


async def _ask(stack: Stack, *, traceparent: str | None = None, model: str = "m") -> str:
    headers = {"traceparent": traceparent} if traceparent else {}
    async with stack.client() as client:
        stream = await client.chat.completions.create(
            model=model,
            stream=True,
            max_tokens=16,
            messages=[{"role": "user", "content": PROMPT}],
            extra_headers=headers,
        )
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream])


async def test_one_trace_per_request_from_the_caller_through_edge_and_node_to_upstream(
    tmp_path: Path,
) -> None:
    upstream = FakeUpstream(chunks=4)
    async with traced_stack(tmp_path, [upstream]) as (stack, receiver):
        answer = await _ask(stack, traceparent=f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")
        await _ask(stack)  # no caller context: a trace of its own
        seen_upstream = [r for r in upstream.requests if r.path == "/v1/chat/completions"]
    assert answer and receiver.paths and set(receiver.paths) == {b"/v1/traces"}

    spans = receiver.spans()
    traces: dict[str, list[Exported]] = {}
    for item in spans:
        traces.setdefault(item.trace_id, []).append(item)
    assert len(traces) == 2
    for trace in traces.values():  # one request each: one span per hop
        assert sorted((s.service, Span.SpanKind.Name(s.span.kind)) for s in trace) == [
            ("iop-edge", "SPAN_KIND_SERVER"),
            ("iop-node", "SPAN_KIND_CLIENT"),
            ("iop-node", "SPAN_KIND_INTERNAL"),
        ]

    # The caller's trace continues: caller -> Edge -> Node attempt -> upstream call.
    ours = traces[CALLER_TRACE]
    edge = next(s for s in ours if s.span.kind == Span.SpanKind.SPAN_KIND_SERVER)
    attempt = next(s for s in ours if s.span.kind == Span.SpanKind.SPAN_KIND_INTERNAL)
    call = next(s for s in ours if s.span.kind == Span.SpanKind.SPAN_KIND_CLIENT)
    assert edge.parent_id == CALLER_SPAN
    assert attempt.parent_id == edge.span_id
    assert call.parent_id == attempt.span_id
    assert edge.span.name == "POST /v1/chat/completions" and attempt.span.name == "chat m"
    assert call.span.name == "chat fake-model"
    # The upstream request carried the upstream call's context.
    sent = {r.headers.get("traceparent") for r in seen_upstream}
    assert f"00-{CALLER_TRACE}-{call.span_id}-01" in sent

    # GenAI attributes, and IOP's own.
    usage = {"gen_ai.usage.input_tokens": 11, "gen_ai.usage.output_tokens": 4}
    assert edge.attributes | usage == edge.attributes
    assert {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": "m",
        "gen_ai.request.max_tokens": 16,
        "iop.principal_ref": "anonymous",
        "iop.provider.id": "up-1",
        "iop.node.id": "node-1",
        "iop.protocol": "chat",
        "iop.usage_source": "provider",
        "http.response.status_code": 200,
    }.items() <= edge.attributes.items()
    assert {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": "m",
        "gen_ai.request.max_tokens": 16,
        "gen_ai.response.model": "fake-model",
        "gen_ai.response.finish_reasons": ["stop"],
        "iop.provider.id": "up-1",
        "iop.node.id": "node-1",
        "iop.protocol": "chat",
        "iop.usage_source": "provider",
        **usage,
    }.items() <= attempt.attributes.items()
    assert {
        "gen_ai.request.model": "fake-model",
        "gen_ai.response.model": "fake-model",
        "http.request.method": "POST",
        "http.response.status_code": 200,
        "server.address": "127.0.0.1",
        "url.full": f"{upstream.base_url}/chat/completions",
    }.items() <= call.attributes.items()
    [admitted] = edge.events()["iop.admitted"]
    assert admitted["iop.provider.id"] == "up-1" and admitted["iop.queue_wait_s"] >= 0
    first_output = attempt.attributes["iop.time_to_first_output_s"]
    first_byte = call.attributes["iop.time_to_first_byte_s"]
    attempt_s = (attempt.span.end_time_unix_nano - attempt.span.start_time_unix_nano) / 1e9
    assert first_byte > 0 and 0 < first_output <= attempt_s
    assert call.span.end_time_unix_nano <= attempt.span.end_time_unix_nano

    # Never a prompt, never a completion.
    words = [*PROMPT.split(), *answer.split()]
    leaks = [text for text in _strings(spans) for word in words if word in text]
    assert leaks == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_translated_messages_run_names_its_upstream_model_and_why_it_ended(
    tmp_path: Path, stream: bool
) -> None:
    """The Node translates a Messages run for a chat-only upstream: its span has the
    model the upstream answered as, and the stop reason in the caller's terms, also when
    the stream's end was held back for the Edge."""
    async with traced_stack(tmp_path, [FakeUpstream(chunks=3)]) as (stack, receiver):
        client = anthropic.AsyncAnthropic(
            base_url=stack.addresses.openai_url, api_key="unused", max_retries=0
        )
        async with client:
            body: dict[str, Any] = {
                "model": "m",
                "max_tokens": 16,
                "messages": [{"role": "user", "content": PROMPT}],
            }
            if stream:
                async with client.messages.stream(**body) as events:
                    await events.get_final_message()
            else:
                await client.messages.create(**body)
    [attempt] = [s for s in receiver.spans() if s.span.kind == Span.SpanKind.SPAN_KIND_INTERNAL]
    assert attempt.attributes["iop.protocol"] == "messages"
    assert attempt.attributes["gen_ai.response.model"] == "fake-model"
    assert attempt.attributes["gen_ai.response.finish_reasons"] == ["end_turn"]
    assert attempt.attributes["iop.time_to_first_output_s"] > 0  # a whole reply's too


@pytest.mark.parametrize("protocol", ["messages", "responses"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_native_run_names_the_model_its_upstream_answered_as(
    tmp_path: Path, protocol: str, stream: bool
) -> None:
    """A runtime that speaks the caller's protocol answers in it: the model it names is
    read before the caller's alias takes its place, for the attempt span and its
    upstream call's."""
    native = FakeUpstream(chunks=3, native=frozenset({protocol}))
    async with traced_stack(tmp_path, [native]) as (stack, receiver):
        if protocol == "messages":
            client = anthropic.AsyncAnthropic(
                base_url=stack.addresses.openai_url, api_key="unused", max_retries=0
            )
            body: dict[str, Any] = {
                "model": "m",
                "max_tokens": 16,
                "messages": [{"role": "user", "content": PROMPT}],
            }
            async with client:
                if stream:
                    async with client.messages.stream(**body) as events:
                        await events.get_final_message()
                else:
                    await client.messages.create(**body)
        else:
            async with stack.client() as openai_client:
                if stream:
                    async for _ in await openai_client.responses.create(
                        model="m", input=PROMPT, stream=True
                    ):
                        pass
                else:
                    await openai_client.responses.create(model="m", input=PROMPT)
    node = [s for s in receiver.spans() if s.service == "iop-node"]
    models = {s.span.kind: s.attributes.get("gen_ai.response.model") for s in node}
    assert models == {
        Span.SpanKind.SPAN_KIND_INTERNAL: "fake-model",
        Span.SpanKind.SPAN_KIND_CLIENT: "fake-model",
    }


async def test_a_failover_shows_as_events_and_a_second_attempt_span(tmp_path: Path) -> None:
    broken = FakeUpstream(status=503)
    working = FakeUpstream(chunks=2)
    async with traced_stack(tmp_path, [broken, working]) as (stack, receiver):
        await _ask(stack, traceparent=f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")
    spans = receiver.spans()
    assert {s.trace_id for s in spans} == {CALLER_TRACE}
    [edge] = [s for s in spans if s.service == "iop-edge"]
    attempts = [s for s in spans if s.span.kind == Span.SpanKind.SPAN_KIND_INTERNAL]
    assert sorted(a.attributes["iop.provider.id"] for a in attempts) == ["up-1", "up-2"]
    assert {a.parent_id for a in attempts} == {edge.span_id}
    failed = next(a for a in attempts if a.attributes["iop.provider.id"] == "up-1")
    assert failed.attributes["error.type"] == "upstream_busy"
    assert failed.span.status.code == failed.span.status.STATUS_CODE_ERROR
    events = edge.events()
    assert [e["iop.provider.id"] for e in events["iop.admitted"]] == ["up-1", "up-2"]
    [attempt_failed] = events["iop.attempt_failed"]
    assert attempt_failed["error.type"] == "upstream_busy" and attempt_failed["iop.retryable"]
    assert events["iop.failover"] == [{"iop.provider.id": "up-1", "iop.reason": "upstream_busy"}]
    assert edge.attributes["iop.provider.id"] == "up-2"
    assert edge.attributes["http.response.status_code"] == 200


async def test_a_stream_that_breaks_off_is_traced_as_it_ended_not_as_its_headers_said(
    tmp_path: Path,
) -> None:
    """The headers said 200; the upstream broke off mid-stream: the span says 502, as the
    access line and the metrics do."""
    async with traced_stack(tmp_path, [FakeUpstream(chunks=6, drop_after_chunks=2)]) as (
        stack,
        receiver,
    ):
        with pytest.raises(openai.APIError):
            await _ask(stack)
    [edge] = [s for s in receiver.spans() if s.service == "iop-edge"]
    assert edge.attributes["http.response.status_code"] == 502
    assert edge.attributes["error.type"] == "upstream_stream_error"
    assert edge.span.status.code == edge.span.status.STATUS_CODE_ERROR


async def test_a_failure_with_no_provider_left_is_not_a_failover(tmp_path: Path) -> None:
    async with traced_stack(tmp_path, [FakeUpstream(status=500)]) as (stack, receiver):
        with pytest.raises(openai.APIError):
            await _ask(stack)
        metrics = stack.edge.metrics_text().decode()
    [edge] = [s for s in receiver.spans() if s.service == "iop-edge"]
    events = edge.events()
    assert [e["iop.provider.id"] for e in events["iop.attempt_failed"]] == ["up-1"]
    assert "iop.failover" not in events
    assert "iop_failovers_total{" not in metrics


async def test_a_request_refused_before_it_is_planned_carries_its_request_id(
    tmp_path: Path,
) -> None:
    """An unknown model: its span joins its access line by the id the caller got."""
    async with traced_stack(tmp_path, [FakeUpstream()]) as (stack, receiver):
        with pytest.raises(openai.NotFoundError) as unknown:
            await _ask(stack, model="nope")
    [edge] = [s for s in receiver.spans() if s.service == "iop-edge"]
    assert edge.attributes["iop.request_id"] == unknown.value.response.headers["x-request-id"]
    assert edge.attributes["http.response.status_code"] == 404


async def test_a_request_over_its_principals_limit_shows_as_not_admitted(tmp_path: Path) -> None:
    """A limit refuses before the request queues; its trace still says why it was not run."""
    limited = [{"ref": "anonymous", "requests_per_minute": 0}]
    async with traced_stack(tmp_path, [FakeUpstream()], principals=limited) as (stack, receiver):
        with pytest.raises(openai.RateLimitError):
            await _ask(stack)
    [edge] = [s for s in receiver.spans() if s.service == "iop-edge"]
    [refused] = edge.events()["iop.not_admitted"]
    assert refused["iop.reason"] == "rate_limit_requests"  # the caller's error code
    assert "iop.admitted" not in edge.events()
    assert edge.attributes["http.response.status_code"] == 429


async def test_a_sampled_out_caller_is_not_traced_but_its_context_flows(tmp_path: Path) -> None:
    upstream = FakeUpstream(chunks=2)
    async with traced_stack(tmp_path, [upstream]) as (stack, receiver):
        await _ask(stack, traceparent=f"00-{CALLER_TRACE}-{CALLER_SPAN}-00")
        [seen] = [r for r in upstream.requests if r.path == "/v1/chat/completions"]
    assert receiver.spans() == []  # parentbased: the caller's "not sampled" is kept
    traceparent = seen.headers["traceparent"]
    assert traceparent.startswith(f"00-{CALLER_TRACE}-") and traceparent.endswith("-00")


async def test_an_edge_that_does_not_trace_passes_the_callers_context_on(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    upstream = FakeUpstream(chunks=2)
    await nursery.start(upstream.serve)
    text = edge_config(
        tmp_path / "state",
        providers=[upstream_provider("up-1", upstream.base_url)],
        models=[{"id": "m", "providers": {"up-1": "fake-model"}}],
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    assert stack.edge.tracing is None
    caller = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    async with stack.client() as client:
        await client.chat.completions.create(
            model="m",
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"traceparent": caller, "tracestate": "vendor=opaque"},
        )
        with pytest.raises(openai.APIStatusError):  # a refusal carries nothing on
            await client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "hi"}]
            )
        await client.chat.completions.create(  # a malformed context is dropped
            model="m",
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"traceparent": "00-not-a-trace-01"},
        )
    first, second = [r for r in upstream.requests if r.path == "/v1/chat/completions"]
    assert first.headers["traceparent"] == caller
    assert first.headers["tracestate"] == "vendor=opaque"
    assert "traceparent" not in second.headers
