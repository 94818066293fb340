"""A finished run's series children, kept per kind of run (`metering.run_series`): the
counts add up across runs of a kind and apart between kinds, and a child appears in
`/metrics` only once a run used it, as when each was looked up by its labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from iop_edge.runtime.metering.metrics import MAX_CODE_LABELS, EdgeMetrics
from schemas.catalog import Catalog
from schemas.wire import Usage


def _samples(metrics: EdgeMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = metrics.render().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("iop_") and not sample.name.endswith("_created")
    }


def _value(metrics: EdgeMetrics, name: str, **labels: str) -> float | None:
    return _samples(metrics).get((name, frozenset(labels.items())))


def _run(metrics: EdgeMetrics, **changes: object) -> None:
    run: dict[str, object] = {
        "model": "m",
        "provider": "p1",
        "status": 200,
        "latency_s": 0.2,
        "queued_s": 0.01,
        "usage": Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15, cached_tokens=4),
        "principal_ref": "alice",
        "token_ref": "t",
    }
    run.update(changes)
    metrics.observe_request(**run)  # type: ignore[arg-type]


def test_runs_of_one_kind_add_up_and_kinds_stay_apart() -> None:
    metrics = EdgeMetrics(lambda: Catalog(revision=1))
    _run(metrics)
    _run(metrics)
    _run(metrics, principal_ref="bob", status=429, code="rate_limit_requests", usage=None)
    assert (
        _value(metrics, "iop_requests_total", model="m", provider="p1", status="200", code="")
        == 2.0
    )
    assert (
        _value(
            metrics,
            "iop_requests_total",
            model="m",
            provider="p1",
            status="429",
            code="rate_limit_requests",
        )
        == 1.0
    )
    prompt = {"principal_ref": "alice", "token_ref": "t", "model": "m", "provider": "p1"}
    assert _value(metrics, "iop_tokens_total", **prompt, kind="prompt") == 20.0
    assert _value(metrics, "iop_tokens_total", **prompt, kind="completion") == 10.0
    cache = {"model": "m", "provider": "p1"}
    assert _value(metrics, "iop_prompt_cache_tokens_total", **cache, kind="cached") == 8.0
    assert _value(metrics, "iop_request_latency_seconds_count", **cache) == 3.0
    assert _value(metrics, "iop_queue_wait_seconds_count", model="m") == 3.0
    assert _value(metrics, "iop_principal_queue_wait_seconds_count", principal_ref="bob") == 1.0
    limit = {"principal_ref": "bob", "limit": "requests_per_minute"}
    assert _value(metrics, "iop_principal_rejections_total", **limit) == 1.0


def test_a_child_appears_only_once_a_run_used_it() -> None:
    metrics = EdgeMetrics(lambda: Catalog(revision=1))
    _run(metrics)  # no first token, provider-reported usage
    names = {name for name, _ in _samples(metrics)}
    assert "iop_time_to_first_token_seconds_count" not in names
    assert "iop_estimated_tokens_total" not in names
    assert "iop_principal_rejections_total" not in names
    _run(metrics, ttft_s=0.05, usage_source="estimated")
    names = {name for name, _ in _samples(metrics)}
    assert {"iop_time_to_first_token_seconds_count", "iop_estimated_tokens_total"} <= names
    cache = {"model": "m", "provider": "p1"}
    assert _value(metrics, "iop_time_to_first_token_seconds_count", **cache) == 1.0
    estimated = {"principal_ref": "alice", "token_ref": "t", "model": "m", "provider": "p1"}
    assert _value(metrics, "iop_estimated_tokens_total", **estimated, kind="prompt") == 10.0


def test_an_upstreams_made_up_codes_are_labels_only_up_to_a_bound() -> None:
    metrics = EdgeMetrics(lambda: Catalog(revision=1))
    for number in range(MAX_CODE_LABELS + 5):
        _run(metrics, status=400, code=f"made_up_{number}", usage=None)
    _run(metrics, status=429, code="rate_limit_requests", usage=None)  # IOP's own: kept
    codes = {
        dict(labels)["code"] for name, labels in _samples(metrics) if name == "iop_requests_total"
    }
    assert len(codes) == MAX_CODE_LABELS + 2
    assert {"made_up_0", "other", "rate_limit_requests"} <= codes
    assert f"made_up_{MAX_CODE_LABELS}" not in codes
    other = {"model": "m", "provider": "p1", "status": "400", "code": "other"}
    assert _value(metrics, "iop_requests_total", **other) == 5.0
