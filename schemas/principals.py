"""Principal standing records (design §15): each principal against its limits, as
`GET /usage`, `iop-edge usage` and the pool page show it.

Frozen, keyword-only; a limit that is not set is null, and so is what remains of it.
Counts are this Edge's (in flight, queued, per-minute allowance: a share when several
replicas serve); `tokens_today` is the shared ledger's, plus this Edge's runs since it
last read it.
"""

from __future__ import annotations

import msgspec


class PrincipalStanding(msgspec.Struct, frozen=True, kw_only=True):
    principal_ref: str
    limited_by: str | None
    """The `principals[].ref` entry that applies (the name itself or `*`); null: none."""
    models: list[str] | None
    """The allow-list (glob patterns); null: every model."""
    weight: float
    in_flight: int
    queued: int
    max_concurrent: int | None
    """This Edge's share of the principal's `max_concurrent`."""
    requests_per_minute: int | None
    requests_remaining: int | None
    """Requests this Edge would admit now (its share of the per-minute limit)."""
    tokens_per_minute: int | None
    tokens_remaining: int | None
    tokens_per_day: int | None
    tokens_today: int
    """Tokens metered today (UTC), runs in flight not included."""
    budget_remaining: int | None
    rejected: dict[str, int] = {}
    """Requests this Edge refused per limit since it started."""


class PrincipalsReport(msgspec.Struct, frozen=True, kw_only=True):
    replicas: int
    """Live Edge replicas the per-minute and concurrency limits are split between."""
    day_start: float
    """When the budget day began (00:00 UTC), Unix seconds."""
    principals: list[PrincipalStanding]
