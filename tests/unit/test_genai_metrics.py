"""The GenAI histograms (`metering.genai_metrics`) measure what the conventions say, and the
pool page's per-model series (`metering.activity`) stay bounded and say it per bucket."""

from __future__ import annotations

import msgspec
import pytest

from iop_edge.runtime.metering.activity import Activity
from iop_edge.runtime.metering.metering import RunRecord
from iop_edge.runtime.metering.metrics import EdgeMetrics
from schemas.catalog import Catalog
from schemas.wire import Usage

LABELS = {
    "gen_ai_operation_name": "chat",
    "gen_ai_request_model": "m",
    "gen_ai_provider_name": "vllm",
    "iop_provider_id": "p1",
}


def _record(**changes: object) -> RunRecord:
    base = RunRecord(
        run_id="r",
        request_id="r",
        model="m",
        principal_ref="alice",
        token_ref="t",
        alias=None,
        provider="p1",
        node="n1",
        status=200,
        code=None,
        usage=Usage(prompt_tokens=10, completion_tokens=21, total_tokens=31),
        usage_source="provider",
        latency_s=2.5,
        ttft_s=0.5,
        queued_s=0.0,
        stream=True,
    )
    return msgspec.structs.replace(base, **changes)


def _metrics() -> EdgeMetrics:
    return EdgeMetrics(lambda: Catalog(revision=1), provider_name=lambda p: "vllm")


def _observe(metrics: EdgeMetrics, record: RunRecord) -> None:
    metrics.observe_request(
        model=record.model,
        provider=record.provider,
        status=record.status,
        code=record.code or "",
        latency_s=record.latency_s,
        ttft_s=record.ttft_s,
        queued_s=record.queued_s,
        usage=record.usage,
        operation=record.operation,
        stream=record.stream,
    )


def _value(metrics: EdgeMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {**LABELS, **labels})


def test_a_successful_stream_is_timed_to_its_first_token_and_per_output_token() -> None:
    metrics = _metrics()
    _observe(metrics, _record())
    assert _value(metrics, "gen_ai_server_time_to_first_token_seconds_sum") == 0.5
    # (2.5 s - 0.5 s) over the 20 tokens after the first.
    assert _value(metrics, "gen_ai_server_time_per_output_token_seconds_sum") == pytest.approx(0.1)
    duration = "gen_ai_client_operation_duration_seconds_sum"
    assert _value(metrics, duration, error_type="") == 2.5
    assert _value(metrics, "gen_ai_client_token_usage_sum", gen_ai_token_type="input") == 10
    assert _value(metrics, "gen_ai_client_token_usage_sum", gen_ai_token_type="output") == 21


def test_only_successful_streams_are_timed_per_token_and_failures_carry_their_error() -> None:
    metrics = _metrics()
    _observe(metrics, _record(stream=False))
    _observe(metrics, _record(status=502, code="upstream_error"))
    _observe(metrics, _record(usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)))
    assert _value(metrics, "gen_ai_server_time_to_first_token_seconds_count") == 1
    assert _value(metrics, "gen_ai_server_time_per_output_token_seconds_count") is None
    duration = "gen_ai_client_operation_duration_seconds_count"
    assert _value(metrics, duration, error_type="upstream_error") == 1
    assert _value(metrics, duration, error_type="") == 2
    # Messages and Responses runs are chat operations; a refused request is no operation.
    _observe(metrics, _record(operation="messages"))
    assert _value(metrics, "gen_ai_server_time_to_first_token_seconds_count") == 2
    _observe(metrics, _record(provider=""))
    assert _value(metrics, duration, error_type="") == 3


def test_failovers_are_counted_by_reason() -> None:
    metrics = _metrics()
    metrics.failovers.labels("m", "p1", "upstream_busy").inc()
    labels = {"model": "m", "provider": "p1", "reason": "upstream_busy"}
    assert metrics.registry.get_sample_value("iop_failovers_total", labels) == 1


def test_each_model_has_its_ttft_percentiles_rate_and_queue_per_bucket() -> None:
    now = [1000.0]
    depths = {"m": 0, "other": 0}
    activity = Activity(bucket_s=10, buckets=6, clock=lambda: now[0], queue_depth=lambda: depths)
    for ttft in [0.1] * 18 + [2.0, 4.0]:  # twenty streams, p95 in the slow tail
        activity.run_finished(_record(ttft_s=ttft))
    depths["other"] = 3
    now[0] = 1011.0  # the next bucket: a queue and a failed run (not timed)
    activity.run_finished(_record(model="other", status=503, code="queue_timeout", usage=None))
    report = activity.report()
    [m, other] = report.models
    assert m.model == "m" and len(m.ttft_p50_s) == 6
    p50, p95 = m.ttft_p50_s[-2], m.ttft_p95_s[-2]
    assert p50 is not None and p95 is not None
    assert p50 == pytest.approx(0.1, rel=0.07) and p95 == pytest.approx(2.0, rel=0.07)
    assert m.streams[-2] == 20 and m.tokens_per_s[-2] == 20 * 21 / 10
    assert m.ttft_p50_s[-1] is None and m.tokens_per_s[-1] == 0
    assert m.tokens_per_s_last_minute == pytest.approx(20 * 21 / 51, abs=0.01)  # 51 s
    assert other.queue_depth[-1] == 3 and other.streams == [0] * 6
    # A minute later everything has left the window: the models go too.
    now[0] = 1080.0
    depths["other"] = 0
    assert activity.report().models == []
