"""The pool as `GET /catalog` shows it: one provider's record from what the scheduler
knows of it (design §12). Pure: the scheduler gathers its state's values and calls
`catalog_provider`; what the record says, and why a provider is out of the pool, is
decided here.

Rules:
1. A provider whose Node is not connected is `unavailable` ("node disconnected"),
   whatever its last health report said.
2. `health_reason` says why a provider is not fully in the pool, first reason first: its
   Node is gone, it cools down after consecutive failures, the config disables it, its
   Node has not reported its health yet, or the Node's own words for its health, without
   the health itself in front (a Node's `busy: ...` reads `busy: busy: ...` beside the
   health column otherwise).
3. Lifecycle flags become one shared, frozen record per set of flags; a provider whose
   Node is not connected shows no discovered lifecycle.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Final

from schemas.catalog import CatalogLifecycle, CatalogProvider, Unapplied
from schemas.config import LifecycleFlag, ProviderConfig
from schemas.protocols import CallerProtocol
from schemas.wire import Health, ModelState

__all__ = ["catalog_lifecycle", "catalog_provider", "health_reason"]

#: The `pinned` of every provider with no pin: one list, never changed.
_NOTHING_PINNED: Final[list[str]] = []
#: The `unapplied` of every provider whose Node runs its config: one dict, never changed.
_ALL_APPLIED: Final[dict[str, Unapplied]] = {}


def catalog_provider(
    config: ProviderConfig,
    *,
    node_id: str,
    connected: bool,
    health: Health,
    detail: str | None,
    in_flight: int,
    long_in_flight: int,
    other_edges_in_flight: int,
    discovered_models: list[str],
    discovered_lifecycle: Iterable[LifecycleFlag] | None,
    queued: int,
    cooling_down: bool,
    consecutive_failures: int,
    protocols: list[CallerProtocol],
    rate_limited_s: float | None = None,
    model_states: list[ModelState] | None = None,
    max_loaded: int | None = None,
    cached_share: float | None = None,
    pinned: frozenset[str] = frozenset(),
    unapplied: dict[str, Unapplied] | None = None,
) -> CatalogProvider:
    """One provider's record (Rules 1-3). Its lists are the config's and the caller's own,
    not copied: a catalog of thousands of providers allocates one record per provider."""
    return CatalogProvider(
        id=config.id,
        node_id=node_id,
        type=config.type,
        category=config.effective_category,
        enabled=config.enabled,
        connected=connected,
        health=health if connected else "unavailable",
        health_reason=health_reason(
            connected=connected,
            cooling_down=cooling_down,
            consecutive_failures=consecutive_failures,
            rate_limited_s=rate_limited_s,
            enabled=config.enabled,
            health=health,
            detail=detail,
        ),
        capacity=config.capacity,
        in_flight=in_flight,
        load_ratio=in_flight / config.capacity if config.capacity > 0 else None,
        long_context_slots=config.long_context_slots,
        long_in_flight=long_in_flight,
        other_edges_in_flight=other_edges_in_flight,
        models=config.models,
        discovered_models=discovered_models,
        queued=queued,
        priority=config.priority,
        lifecycle=catalog_lifecycle(config.lifecycle),
        discovered_lifecycle=(
            None
            if discovered_lifecycle is None or not connected
            else catalog_lifecycle(discovered_lifecycle)
        ),
        cooling_down=cooling_down,
        consecutive_failures=consecutive_failures,
        rate_limited_s=rate_limited_s,
        protocols=protocols,
        model_states=model_states if connected else None,
        max_loaded=max_loaded if connected else None,
        cached_share=cached_share,
        pinned=sorted(pinned) if pinned else _NOTHING_PINNED,
        unapplied=unapplied or _ALL_APPLIED,
    )


def health_reason(
    *,
    connected: bool,
    cooling_down: bool,
    consecutive_failures: int,
    enabled: bool,
    health: Health,
    detail: str | None,
    rate_limited_s: float | None = None,
) -> str | None:
    """Why the provider is not fully in the pool, or None when it is (Rule 2)."""
    if not connected:
        return "node disconnected"
    if cooling_down:
        return f"cooling down after {consecutive_failures} consecutive failures"
    if rate_limited_s is not None:
        return f"rate-limited by its upstream for {math.ceil(rate_limited_s)} s more"
    if not enabled:
        return "disabled in config"
    if health == "available":
        return None
    if health == "unknown":
        return detail or "waiting for the node's first health report"
    if detail and detail.startswith(f"{health}: "):
        detail = detail[len(health) + 2 :]
    return detail or health


def catalog_lifecycle(flags: Iterable[LifecycleFlag]) -> CatalogLifecycle:
    """The record of a set of lifecycle flags (Rule 3)."""
    return _lifecycle_of(frozenset(flags))


@functools.cache
def _lifecycle_of(present: frozenset[LifecycleFlag]) -> CatalogLifecycle:
    """One shared (frozen) record per set of flags."""
    return CatalogLifecycle(
        list_models="list_models" in present,
        load_model="load_model" in present,
        unload_model="unload_model" in present,
        pull_model="pull_model" in present,
        delete_model="delete_model" in present,
    )
