"""The usage record the ledger tests write: one run's, all but its id the same."""

from __future__ import annotations

from iop_edge.runtime.metering.usage_ledger.usage_store import UsageRecord

__all__ = ["usage_record"]


def usage_record(run_id: str) -> UsageRecord:
    """A finished run's record (200, 3 prompt and 4 completion tokens), named `run_id`."""
    return UsageRecord(
        time=1.0, run_id=run_id, principal_ref="p", token_ref="t", alias=None, model="m",
        provider="pr", node="n", prompt_tokens=3, completion_tokens=4, status=200,
        latency_ms=1.0, ttft_ms=None,
    )  # fmt: skip
