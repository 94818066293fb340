"""Metering (design §7): one record per finished run, to Prometheus and the usage ledger.

A run hands its `RunRecord` here exactly once, whatever ended it (see `dispatch.Run`).
A record with a provider (the run reached one) is billed at once: written to the usage
ledger, and its runtime's reported cached prompt tokens count in that provider's recent
cached share (`core.routing.cache_share`, the catalog's). Every record is counted in the
metrics, which may come a little later (`books`: the Edge enters them in batches). A
request refused before it named a model the Edge knows (bad JSON, bad token, unknown
model) is counted as a refusal only.
"""

from __future__ import annotations

import time

import msgspec

from iop_edge.core.routing.cache_share import CacheShares
from iop_edge.runtime.metering.metrics import EdgeMetrics
from iop_edge.runtime.metering.usage_ledger.usage import UsageLedger
from iop_edge.runtime.metering.usage_ledger.usage_store import UsageRecord
from schemas import wire
from schemas.protocols import CallerProtocol


class RunRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """How one run ended, with everything metering needs.

    A struct, not a dataclass: one is built for every request, and a frozen dataclass's
    constructor sets each of its fields through `object.__setattr__`. It holds strings,
    numbers and a `wire.Usage`, never a cycle, so the collector need not track it."""

    run_id: str
    request_id: str
    """The `x-request-id` the caller saw (its own when it sent a sane one): the key that
    joins the caller's logs to the access log."""
    model: str
    principal_ref: str
    token_ref: str
    alias: str | None
    provider: str
    """"" when the run never reached a provider (refused at admission, or the caller left
    while it was queued)."""
    node: str
    status: int
    """The HTTP status the caller was answered with; 499 when the caller left first."""
    code: str | None
    usage: wire.Usage | None
    usage_source: wire.UsageSource
    """"provider" when the provider reported `usage`, "estimated" when IOP estimated it."""
    latency_s: float
    ttft_s: float | None
    queued_s: float | None
    """Seconds spent waiting for a slot; None when the run was never admitted."""
    protocol: CallerProtocol = "chat"
    """The caller's protocol (design §14): chat (completions and embeddings too),
    messages (Anthropic Messages, count_tokens too) or responses (OpenAI Responses)."""
    operation: wire.Operation = "chat"
    """What the run asked of its provider (`gen_ai.operation.name` in metrics and traces)."""
    stream: bool = False
    """Whether the caller asked for a stream: time to first token and per output token
    are measured on streams only (a whole answer has no first token to time)."""


class Metering:
    """Where finished runs and refused requests are counted."""

    def __init__(
        self, metrics: EdgeMetrics, ledger: UsageLedger, cache_shares: CacheShares | None = None
    ) -> None:
        self._metrics = metrics
        self._ledger = ledger
        self._cache_shares = cache_shares

    def record(self, record: RunRecord) -> None:
        """Bill and count `record` at once (`bill`, then `count`)."""
        self.bill(record)
        self.count(record)

    def bill(self, record: RunRecord) -> None:
        """The ledger's part, before the caller's last byte: a record with a provider is
        written to the usage ledger (its journal: durable once this returns), and its
        runtime's reported cached prompt tokens count in the provider's cached share."""
        if not record.provider:
            return  # refused at admission: no run, nothing to bill
        usage = record.usage
        shares = self._cache_shares
        if usage is not None and record.usage_source == "provider" and shares is not None:
            shares.observe(
                record.provider,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_tokens,
            )
        self._ledger.record(
            UsageRecord(
                time=time.time(),
                run_id=record.run_id,
                principal_ref=record.principal_ref,
                token_ref=record.token_ref,
                alias=record.alias,
                model=record.model,
                provider=record.provider,
                node=record.node,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                completion_tokens=usage.completion_tokens if usage else 0,
                status=record.status,
                latency_ms=record.latency_s * 1000,
                ttft_ms=None if record.ttft_s is None else record.ttft_s * 1000,
                usage_source=record.usage_source,
                protocol=record.protocol,
                cached_tokens=usage.cached_tokens if usage else 0,
            )
        )

    def count(self, record: RunRecord) -> None:
        """The metrics' part, which may come later (`books.RunBooks` enters it in batches)."""
        self._metrics.observe_request(
            model=record.model,
            provider=record.provider,
            status=record.status,
            code=record.code or "",
            latency_s=record.latency_s,
            ttft_s=record.ttft_s,
            queued_s=record.queued_s,
            usage=record.usage,
            usage_source=record.usage_source,
            principal_ref=record.principal_ref,
            token_ref=record.token_ref,
            operation=record.operation,
            stream=record.stream,
        )

    def refusal(self) -> str | None:
        """Why new runs must be refused now: their usage could not be recorded (the
        ledger's buffer is full and `edge.ledger_when_unwritable` is `refuse`); None
        while they may run."""
        return self._ledger.problem() if self._ledger.refuses_runs else None

    def refused(self, *, status: int, code: str | None) -> None:
        """A request refused before it named a model the Edge knows (no run was made)."""
        self._metrics.observe_refusal(status=status, code=code or "")
