"""Readiness (design §12): can the Edge serve a request right now?

`GET /healthz` is liveness (the process answers); `GET /readyz` is readiness, what a
load balancer or an orchestrator should route by. Pure: it reads a `Catalog`.

Rules:
1. A provider *can take runs now* when its node is connected, it is enabled, its health
   admits runs (`available`, or `busy`: alive and generating, design §4 item 11), and it
   is not cooling down after failures. (A full provider still counts: a request would
   queue and be served, not be refused.)
2. A model is *servable* when at least one of its providers can take runs now, and that
   provider's Node has not refused the config that maps the model to it (`unapplied`:
   a mapping `pending` its Node's ack counts, since its runs wait for the ack and are
   served; a `refused` one does not, since its runs are refused).
3. The Edge is *ready* when at least one model is servable, and nothing else stops it
   from serving (a usage ledger that cannot record refuses every run: `unready`, with
   the reason).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from schemas.catalog import Catalog, CatalogProvider

__all__ = ["NO_SERVABLE_MODEL", "Readiness", "can_take_runs", "readiness", "readiness_of"]

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
    records = {provider.id: provider for provider in catalog.providers}
    return readiness_of({model.id: model.providers for model in catalog.models}, records.get)


def readiness_of(
    models: Mapping[str, Mapping[str, str]], provider: Callable[[str], CatalogProvider | None]
) -> Readiness:
    """Rules 2 and 3 over each model's providers (id -> served name), reading a
    provider's record only when needed: a model is servable at its first provider that
    can take runs, so a fleet's pool is judged by a few records per model, not a catalog
    of all of them."""
    judged: dict[str, CatalogProvider | None] = {}
    """Each provider read so far: its record when it can take runs now, else None."""

    def serves(provider_id: str, served: str) -> bool:
        if provider_id in judged:
            record = judged[provider_id]
        else:
            record = provider(provider_id)
            if record is not None and not can_take_runs(record):
                record = None
            judged[provider_id] = record
        return record is not None and record.unapplied.get(served) != "refused"

    servable = sorted(
        model_id
        for model_id, providers in models.items()
        if any(serves(provider_id, served) for provider_id, served in providers.items())
    )
    return Readiness(
        ready=bool(servable),
        servable_models=servable,
        models=len(models),
        reason=None if servable else NO_SERVABLE_MODEL,
    )
