"""Prometheus metrics of one Edge.

Each Edge owns its own `CollectorRegistry` (several Edges can live in one test process).
Per-provider gauges (in_flight, capacity, queued, health) are not kept as counters that
could drift: a collector reads them from the scheduler at scrape time. What every
finished request updates (requests, timings, tokens, the GenAI histograms) is kept in
plain numbers on the event loop (`series`), exposed as prometheus_client would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Final

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from iop_edge.runtime.lifecycle.heap import HeapStatistics
from iop_edge.runtime.metering.genai_metrics import GenAIMetrics
from iop_edge.runtime.metering.response_store import StoreStatistics
from iop_edge.runtime.metering.run_series import RunKind, RunSeries
from iop_edge.runtime.metering.series import CounterSeries, HistogramSeries
from iop_edge.runtime.metering.usage_ledger.usage import LedgerStatistics
from schemas.catalog import Catalog
from schemas.wire import FailureCode, Usage, UsageSource

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: Distinct error codes of an upstream's own the run metrics keep as label values; later
#: ones count as `other`. They reach its callers (`core.caller_text` Rule 5): a series for
#: every code it makes up would grow without bound. IOP's own codes are always kept.
MAX_CODE_LABELS: Final = 64
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _PoolCollector(Collector):
    def __init__(self, catalog: Callable[[], Catalog]) -> None:
        self._catalog = catalog

    def collect(self) -> Iterator[GaugeMetricFamily]:
        catalog = self._catalog()
        labels = ["provider", "node"]
        in_flight = GaugeMetricFamily(
            "iop_provider_in_flight", "Runs holding a slot", labels=labels
        )
        capacity = GaugeMetricFamily("iop_provider_capacity", "Configured run slots", labels=labels)
        long_in_flight = GaugeMetricFamily(
            "iop_provider_long_in_flight", "Long-context runs holding a long slot", labels=labels
        )
        queued = GaugeMetricFamily(
            "iop_provider_queued", "Waiting requests this provider could serve", labels=labels
        )
        available = GaugeMetricFamily(
            "iop_provider_available", "1 when connected, enabled and healthy", labels=labels
        )
        model_queued = GaugeMetricFamily("iop_model_queued", "Requests waiting", labels=["model"])
        model_state = GaugeMetricFamily(
            "iop_provider_model_state",
            "1 for each served model's load state in its runtime, where the runtime reports it",
            labels=["provider", "served_model", "state"],
        )
        for p in catalog.providers:
            key = [p.id, p.node_id]
            in_flight.add_metric(key, p.in_flight)
            capacity.add_metric(key, p.capacity)
            long_in_flight.add_metric(key, p.long_in_flight)
            queued.add_metric(key, p.queued)
            up = p.connected and p.enabled and p.health == "available" and not p.cooling_down
            available.add_metric(key, 1.0 if up else 0.0)
            for held in p.model_states or ():
                model_state.add_metric([p.id, held.name, held.state], 1.0)
        for m in catalog.models:
            model_queued.add_metric([m.id], m.queued)
        yield from (
            in_flight,
            capacity,
            long_in_flight,
            queued,
            available,
            model_queued,
            model_state,
        )


class _LedgerCollector(Collector):
    """The usage ledger's health, read at scrape time from its `statistics()`."""

    def __init__(self, statistics: Callable[[], LedgerStatistics]) -> None:
        self._statistics = statistics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._statistics()
        unwritten = GaugeMetricFamily(
            "iop_usage_unwritten_records",
            "Usage records waiting in memory: the journal in state_dir cannot be written",
            value=stats.unwritten,
        )
        state = GaugeMetricFamily(
            "iop_usage_ledger_state",
            "1 for the usage journal's state now: writable, buffering (records wait in "
            "memory) or full (at edge.ledger_buffer_records)",
            labels=["state"],
        )
        changes = CounterMetricFamily(
            "iop_usage_ledger_state_changes",
            "Times the usage journal entered each state",
            labels=["state"],
        )
        for name in ("writable", "buffering", "full"):
            state.add_metric([name], 1.0 if stats.state == name else 0.0)
            changes.add_metric([name], stats.state_changes.get(name, 0))
        dropped = CounterMetricFamily(
            "iop_usage_dropped_records",
            "Usage records lost (past the in-memory buffer, or after the ledger closed)",
            value=stats.dropped,
        )
        store_down = GaugeMetricFamily(
            "iop_usage_store_down",
            "1 while the ledger's database refuses writes (records wait in the journal)",
            value=1.0 if stats.store_down else 0.0,
        )
        yield from (unwritten, state, changes, dropped, store_down)


class _ResponseStoreCollector(Collector):
    """The Responses store's size and the responses it did not store, at scrape time."""

    def __init__(self, statistics: Callable[[], StoreStatistics]) -> None:
        self._statistics = statistics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._statistics()
        yield GaugeMetricFamily(
            "iop_responses_stored", "Stored Responses responses (this Edge's count)", stats.rows
        )
        yield GaugeMetricFamily(
            "iop_responses_stored_bytes",
            "Bytes of stored Responses responses (this Edge's count)",
            stats.bytes,
        )
        unstored = CounterMetricFamily(
            "iop_responses_unstored",
            "store: true responses answered but not stored, by reason",
            labels=["reason"],
        )
        for reason, count in stats.unstored.items():
            unstored.add_metric([reason], count)
        yield unstored
        yield CounterMetricFamily(
            "iop_responses_dropped_for_metering",
            "Stored responses dropped to give the usage ledger its room in state_dir back",
            value=stats.dropped_for_metering,
        )


class _HeapCollector(Collector):
    """The heap keeper's evidence of reference cycles (`runtime.lifecycle.heap` Rule 4)."""

    def __init__(self, statistics: Callable[[], HeapStatistics]) -> None:
        self._statistics = statistics

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self._statistics()
        yield CounterMetricFamily(
            "iop_heap_sessions_leaked",
            "Ended Node sessions still alive after the grace: held by reference cycles",
            stats.sessions_leaked,
        )
        yield CounterMetricFamily(
            "iop_heap_thaws",
            "Full collections of the Edge's heap (each holds callers)",
            stats.thaws,
        )


#: The error code a principal's limit refuses with -> the limit (`principals[]` key).
LIMIT_OF_CODE: Final[dict[str, str]] = {
    "rate_limit_requests": "requests_per_minute",
    "rate_limit_tokens": "tokens_per_minute",
    "budget_exceeded": "tokens_per_day",
    "concurrency_limit": "max_concurrent",
}

#: principal_ref, runs in flight, requests queued (this Edge's).
PrincipalLoadRow = tuple[str, int, int]


class _PrincipalCollector(Collector):
    """Per principal with runs in flight or waiting, read at scrape time."""

    def __init__(self, load: Callable[[], Iterable[PrincipalLoadRow]]) -> None:
        self._load = load

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["principal_ref"]
        in_flight = GaugeMetricFamily(
            "iop_principal_in_flight", "Runs of the principal holding a slot", labels=labels
        )
        queued = GaugeMetricFamily(
            "iop_principal_queued", "Requests of the principal waiting for a slot", labels=labels
        )
        for principal, running, waiting in self._load():
            in_flight.add_metric([principal], running)
            queued.add_metric([principal], waiting)
        yield from (in_flight, queued)


class EdgeMetrics:
    def __init__(
        self,
        catalog: Callable[[], Catalog],
        principal_load: Callable[[], Iterable[PrincipalLoadRow]] | None = None,
        provider_name: Callable[[str], str] = str,
    ) -> None:
        """`provider_name`: a provider id's `gen_ai.provider.name` (`genai_metrics`)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # The series every finished request updates are plain numbers (`series`); the
        # rare ones (failovers, busy answers) are prometheus_client's own.
        self.requests = CounterSeries(
            "iop_requests",
            "Finished requests; `code` is the OpenAI error code (empty on success)",
            ["model", "provider", "status", "code"],
            r,
        )
        # A run's two timings, with the same labels and buckets.
        timing = partial(
            HistogramSeries, labelnames=["model", "provider"], registry=r, buckets=_LATENCY_BUCKETS
        )
        self.latency = timing("iop_request_latency_seconds", "Request latency at the Edge")
        self.ttft = timing("iop_time_to_first_token_seconds", "Time to the first streamed chunk")
        self.queue_wait = HistogramSeries(
            "iop_queue_wait_seconds",
            "Time spent waiting for a slot",
            ["model"],
            r,
            buckets=_QUEUE_BUCKETS,
        )
        self.failovers = Counter(
            "iop_failovers",
            "Attempts moved to another provider before the first byte; `provider` is the"
            " one that failed, `reason` its failure code",
            ["model", "provider", "reason"],
            registry=r,
        )
        self.busy_answers = Counter(
            "iop_busy_answers",
            "Runs a Node answered `busy` (its provider's slots were taken by another Edge's"
            " runs); each waited for a slot again or, after too many, was refused",
            ["model", "provider"],
            registry=r,
        )
        # The tokens, and the estimated part of them, with the same labels.
        token_count = partial(
            CounterSeries,
            labelnames=["principal_ref", "token_ref", "model", "provider", "kind"],
            registry=r,
        )
        self.tokens = token_count(
            "iop_tokens", "Tokens metered per finished run (reported by the provider or estimated)"
        )
        self.estimated_tokens = token_count(
            "iop_estimated_tokens",
            "The part of iop_tokens that was estimated: the provider reported no usage"
            " (the ledger's usage_source `estimated`)",
        )
        self.prompt_cache_tokens = CounterSeries(
            "iop_prompt_cache_tokens",
            "Prompt tokens of runs whose runtime reported its usage (`kind` prompt), and the"
            " part of them it took from its prefix cache (`kind` cached): their ratio is the"
            " prefix cache's hit ratio",
            ["model", "provider", "kind"],
            r,
        )
        self.principal_rejections = CounterSeries(
            "iop_principal_rejections",
            "Requests refused for a principal's limit (`limit`: requests_per_minute,"
            " tokens_per_minute, tokens_per_day; max_concurrent when a request timed out"
            " waiting at its principal's max_concurrent)",
            ["principal_ref", "limit"],
            r,
        )
        self.principal_queue_wait = HistogramSeries(
            "iop_principal_queue_wait_seconds",
            "Time a principal's requests spent waiting for a slot",
            ["principal_ref"],
            r,
            buckets=_QUEUE_BUCKETS,
        )
        self.genai = GenAIMetrics(r, provider_name)
        self._runs: dict[RunKind, RunSeries] = {}
        """The children each kind of finished run updates (`run_series`)."""
        self._codes: set[str] = {"", *LIMIT_OF_CODE, *FailureCode}
        """The error codes kept as label values: IOP's own, and the first
        `MAX_CODE_LABELS` others."""
        self._others = 0
        r.register(_PoolCollector(catalog))
        if principal_load is not None:
            r.register(_PrincipalCollector(principal_load))

    def observe_request(
        self,
        *,
        model: str,
        provider: str,
        status: int,
        latency_s: float,
        code: str = "",
        ttft_s: float | None = None,
        queued_s: float | None = None,
        usage: Usage | None = None,
        usage_source: UsageSource = "provider",
        principal_ref: str = "anonymous",
        token_ref: str = "anonymous",
        operation: str = "chat",
        stream: bool = False,
    ) -> None:
        if code not in self._codes:
            code = self._code_label(code)
        kind: RunKind = (model, provider, status, code, principal_ref, token_ref)
        run = self._runs.get(kind)
        if run is None:
            run = self._runs[kind] = RunSeries()
        requests = run.requests or run.keep(
            "requests", self.requests.labels(model, provider, str(status), code)
        )
        requests.inc()
        if provider:
            latency = run.latency or run.keep("latency", self.latency.labels(model, provider))
            latency.observe(latency_s)
            if ttft_s is not None:
                (run.ttft or run.keep("ttft", self.ttft.labels(model, provider))).observe(ttft_s)
            self.genai.observe(
                operation=operation,
                model=model,
                provider=provider,
                status=status,
                code=code,
                stream=stream,
                latency_s=latency_s,
                ttft_s=ttft_s,
                usage=usage,
            )
        if queued_s is not None:
            wait = run.queue_wait or run.keep("queue_wait", self.queue_wait.labels(model))
            wait.observe(queued_s)
            principal_wait = run.principal_queue_wait or run.keep(
                "principal_queue_wait", self.principal_queue_wait.labels(principal_ref)
            )
            principal_wait.observe(queued_s)
        limit = LIMIT_OF_CODE.get(code)
        if limit is not None:
            rejections = run.rejections or run.keep(
                "rejections", self.principal_rejections.labels(principal_ref, limit)
            )
            rejections.inc()
        if usage is None:
            return
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        names = (principal_ref, token_ref, model, provider)
        tokens = self.tokens
        child = run.tokens_prompt or run.keep("tokens_prompt", tokens.labels(*names, "prompt"))
        child.inc(prompt)
        child = run.tokens_completion or run.keep(
            "tokens_completion", tokens.labels(*names, "completion")
        )
        child.inc(completion)
        if usage_source == "provider" and provider:
            cache = self.prompt_cache_tokens
            child = run.cache_prompt or run.keep(
                "cache_prompt", cache.labels(model, provider, "prompt")
            )
            child.inc(prompt)
            child = run.cache_cached or run.keep(
                "cache_cached", cache.labels(model, provider, "cached")
            )
            child.inc(usage.cached_tokens)
        if usage_source == "estimated":
            estimated = self.estimated_tokens
            child = run.estimated_prompt or run.keep(
                "estimated_prompt", estimated.labels(*names, "prompt")
            )
            child.inc(prompt)
            child = run.estimated_completion or run.keep(
                "estimated_completion", estimated.labels(*names, "completion")
            )
            child.inc(completion)

    def _code_label(self, code: str) -> str:
        """`code`, not IOP's own, as a label value: kept while fewer than
        `MAX_CODE_LABELS` such are."""
        if self._others < MAX_CODE_LABELS:
            self._others += 1
            self._codes.add(code)
            return code
        return "other"

    def observe_refusal(self, *, status: int, code: str) -> None:
        """A request refused before it named a model we know (400/401/404/413).

        No model label: the caller's string is untrusted and would explode cardinality.
        """
        self.requests.labels("", "", str(status), code).inc()

    def watch_ledger(self, statistics: Callable[[], LedgerStatistics]) -> None:
        """Report the usage ledger's state and backlog (`iop_usage_*`) from now on."""
        self.registry.register(_LedgerCollector(statistics))

    def watch_responses(self, statistics: Callable[[], StoreStatistics]) -> None:
        """Report the Responses store (`iop_responses_*`) from now on."""
        self.registry.register(_ResponseStoreCollector(statistics))

    def watch_heap(self, statistics: Callable[[], HeapStatistics]) -> None:
        """Report the heap keeper's leaked sessions and thaws (`iop_heap_*`) from now on."""
        self.registry.register(_HeapCollector(statistics))

    def render(self) -> bytes:
        return generate_latest(self.registry)
