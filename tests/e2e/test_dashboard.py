"""The Grafana dashboard in docs/grafana is ready to import: it parses as a dashboard, and
every PromQL query in it names only metrics a real Edge exposes at /metrics (scraped
after a request), grouping and filtering by labels those metrics carry."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.stack import Stack

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "iop-dashboard.json"
#: A metric name in a query: IOP's own and the GenAI conventions' (nothing else is ours).
_METRIC = re.compile(r"\b((?:iop|gen_ai)_[a-z0-9_]+)\b")
_GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")
#: What in a query names labels, not metrics: matchers, groupings, label_values' label.
_LABEL_PARTS = re.compile(r"\{[^}]*\}|\b(?:by|without)\s*\([^)]*\)|,\s*[a-z_]+\s*\)$")
_MATCHER = re.compile(r"([a-z_][a-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
#: What a sample of each metric type is called, by the family's name.
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "summary": ("", "_sum", "_count", "_created"),
}


def _queries(dashboard: dict[str, Any]) -> list[str]:
    queries = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["definition"])
    return queries


async def _scrape(stack: Stack) -> tuple[set[str], dict[str, set[str]]]:
    """Every sample name the Edge can expose, and the labels of those it has exposed."""
    async with stack.admin() as admin:
        response = await admin.get("/metrics")
    response.raise_for_status()
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(response.text):
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return names, labels


async def test_every_dashboard_query_names_metrics_the_edge_exposes(stack_one: Stack) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    assert all(panel["gridPos"]["w"] <= 24 for panel in dashboard["panels"])
    async with stack_one.client() as client:
        stream = await client.chat.completions.create(
            model="m", stream=True, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
        async for _ in stream:
            pass
    exposed, labels = await _scrape(stack_one)

    queries = _queries(dashboard)
    assert len(queries) > 20
    unknown: list[str] = []
    unlabelled: list[str] = []
    for query in queries:
        metrics = _METRIC.findall(_LABEL_PARTS.sub(" ", query))
        assert metrics, f"a query naming no IOP metric: {query}"
        unknown += [f"{name} in {query}" for name in metrics if name not in exposed]
        seen = [labels[name] for name in metrics if name in labels]
        if not seen:
            continue  # not observed yet (no failover happened): its labels are unknown
        wanted = {label.strip() for group in _GROUPING.findall(query) for label in group.split(",")}
        wanted |= set(_MATCHER.findall(query))
        unlabelled += [
            f"{label} in {query}"
            for label in wanted - {""}
            if not any(label in carried for carried in seen)
        ]
    assert unknown == []
    assert unlabelled == []
    # What the dashboard is for: time to first token and per output token by model, queue
    # wait, in flight against capacity, tokens by principal, rejections, errors by code.
    text = "\n".join(queries)
    for needed in (
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "gen_ai_server_time_per_output_token_seconds_bucket",
        "iop_queue_wait_seconds_bucket",
        "iop_provider_in_flight",
        "iop_provider_capacity",
        "iop_tokens_total",
        "iop_principal_rejections_total",
        "iop_failovers_total",
    ):
        assert needed in text, needed
