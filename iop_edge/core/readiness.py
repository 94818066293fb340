"""Readiness (SPEC §12): can the Edge serve a request right now?

`GET /healthz` is liveness (the process answers); `GET /readyz` is readiness, what a
load balancer or an orchestrator should route by. Pure: it reads a `Catalog`.

Rules:
1. A provider *can take runs now* when its node is connected, it is enabled, its health
   admits runs (`available`, or `busy`: alive and generating, SPEC §4 item 11), and it
   is not cooling down after failures. (A full provider still counts: a request would
   queue and be served, not be refused.)
2. A model is *servable* when at least one of its providers can take runs now.
3. The Edge is *ready* when at least one model is servable, and nothing else stops it
   from serving (a usage ledger that cannot record refuses every run: `unready`, with
   the reason).
"""

from __future__ import annotations

import msgspec

from schemas.catalog import Catalog, CatalogProvider

__all__ = ["NO_SERVABLE_MODEL", "Readiness", "can_take_runs", "readiness"]

NO_SERVABLE_MODEL = "no model has a provider that can take runs now"


class Readiness(msgspec.Struct, frozen=True, kw_only=True):
    ready: bool
    servable_models: list[str]
    """Sorted ids of the models that could be served now (Rule 2)."""
    models: int
    """How many models the catalog has."""
    reason: str | None = None
    """Why the Edge is not ready, when it is not."""

    def unready(self, reason: str) -> Readiness:
        """This state, made not ready for `reason` (Rule 3)."""
        return msgspec.structs.replace(self, ready=False, reason=reason)


def can_take_runs(provider: CatalogProvider) -> bool:
    """Rule 1."""
    return (
        provider.connected
        and provider.enabled
        and provider.health in ("available", "busy")
        and not provider.cooling_down
    )


def readiness(catalog: Catalog) -> Readiness:
    """Rules 2 and 3."""
    taking = {provider.id for provider in catalog.providers if can_take_runs(provider)}
    servable = sorted(
        model.id for model in catalog.models if any(pid in taking for pid in model.providers)
    )
    return Readiness(
        ready=bool(servable),
        servable_models=servable,
        models=len(catalog.models),
        reason=None if servable else NO_SERVABLE_MODEL,
    )
