"""What the scheduler shows of the pool: statistics, principals' load and the catalog.

The read side of `Scheduler`, kept apart from admission: nothing here changes a slot, a
queue or a provider's state. `PoolObservation` is a base of `Scheduler` and reads the
state it declares, which the scheduler keeps; the catalog's records are built by
`core.catalog_view` from it (design §6).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from iop_edge.core.catalog_view import catalog_provider
from iop_edge.core.routing.cache_share import CacheShares
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.runs.fair_queue import FairQueue
from iop_edge.runtime.runs.lease import Lease
from iop_edge.runtime.runs.provider_state import ProviderState, long_capacity
from iop_edge.runtime.runs.unapplied_models import UnappliedModels
from iop_edge.runtime.runs.waiter import Waiter
from schemas.catalog import Catalog, CatalogModel, CatalogProvider
from schemas.wire import Health


@dataclass(frozen=True, slots=True)
class SlotStatistics:
    """One provider's slots at one instant (for tests and diagnostics)."""

    in_flight: int
    capacity: int
    long_in_flight: int
    long_capacity: int | float
    """`long_context_slots`, or infinite when that is null (long runs only counted)."""
    holders: tuple[Lease, ...]
    """The leases holding its regular slots."""
    removed: bool
    """Gone from config, kept only until its last lease is released."""


@dataclass(frozen=True, slots=True)
class PrincipalLoad:
    """One principal's share of the pool at one instant (this Edge's)."""

    in_flight: int
    queued: int


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """The scheduler's state at one instant (for tests and diagnostics)."""

    providers: dict[str, SlotStatistics]
    """Every provider the scheduler tracks, removed ones with leases still out included."""
    queued: dict[str, int]
    """Waiters per model of the running snapshot."""


class PoolObservation:
    """The scheduler's read side: the state below is the scheduler's own, read here."""

    _snapshot: Snapshot
    _clock: Callable[[], float]
    _states: dict[str, ProviderState]
    _connected: set[str]
    _queues: dict[str, FairQueue[Waiter]]
    _running: dict[str, int]
    _models_of: dict[str, tuple[str, ...]]
    _unapplied: UnappliedModels
    cache_shares: CacheShares

    def principal_load(self) -> dict[str, PrincipalLoad]:
        """Each principal with runs in flight or waiting: how many of each."""
        load = {
            principal: PrincipalLoad(in_flight=n, queued=0)
            for principal, n in self._running.items()
        }
        for queue in self._queues.values():
            for principal, waiting in queue.principals():
                known = load.get(principal)
                in_flight = known.in_flight if known is not None else 0
                queued = (known.queued if known is not None else 0) + waiting
                load[principal] = PrincipalLoad(in_flight=in_flight, queued=queued)
        return load

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            providers={
                provider_id: SlotStatistics(
                    in_flight=state.limiter.borrowed_tokens,
                    capacity=state.config.capacity,
                    long_in_flight=state.long_limiter.borrowed_tokens,
                    long_capacity=long_capacity(state.config),
                    holders=tuple(
                        lease
                        for lease in state.limiter.statistics().borrowers
                        if isinstance(lease, Lease)
                    ),
                    removed=state.removed,
                )
                for provider_id, state in self._states.items()
            },
            queued=self.queue_depths(),
        )

    def queue_depths(self) -> dict[str, int]:
        """Waiters per model of the running snapshot: `statistics().queued` without
        looking at every provider (a fleet has tens of thousands)."""
        return {model_id: self._queued(model_id) for model_id in self._snapshot.models}

    def _queued(self, model_id: str) -> int:
        return len(self._queues.get(model_id, ()))

    def catalog(self) -> Catalog:
        """The pool as `GET /catalog` shows it: models and providers, sorted by id."""
        snapshot = self._snapshot
        return Catalog(
            revision=snapshot.revision,
            models=self.catalog_models(),
            providers=self.catalog_providers(snapshot.provider_order),
        )

    @property
    def snapshot(self) -> Snapshot:
        """The snapshot the pool runs on (the catalog's provider set and revision)."""
        return self._snapshot

    def catalog_models(self, model_ids: Iterable[str] | None = None) -> list[CatalogModel]:
        """The catalog's model records, sorted by id: all, or those of `model_ids`."""
        models = self._snapshot.models
        chosen = (
            models.values() if model_ids is None else [models[m] for m in model_ids if m in models]
        )
        return [
            CatalogModel(
                id=model.id,
                display_name=model.display_name,
                providers=dict(sorted(model.providers.items())),
                queued=self._queued(model.id),
            )
            for model in sorted(chosen, key=lambda model: model.id)
        ]

    def catalog_providers(self, provider_ids: Iterable[str]) -> list[CatalogProvider]:
        """The catalog's records of `provider_ids`, in that order; ids no longer in the
        pool are left out (a catalog read in pages meets refreshes)."""
        now = self._clock()
        waiting = any(self._queues.values())
        states = self._states
        return [
            self._catalog_provider(state, now, waiting=waiting)
            for provider_id in provider_ids
            if (state := states.get(provider_id)) is not None and not state.removed
        ]

    def catalog_provider(self, provider_id: str) -> CatalogProvider | None:
        """One provider's catalog record, or None when it is not in the pool."""
        found = self.catalog_providers((provider_id,))
        return found[0] if found else None

    def catalog_health(self, provider_id: str) -> Health | None:
        """A provider's health as its catalog record says it (`unavailable` while its
        Node is not connected), or None when it is not in the pool."""
        state = self._states.get(provider_id)
        if state is None or state.removed:
            return None
        return state.health if state.node_id in self._connected else "unavailable"

    def _catalog_provider(
        self, state: ProviderState, now: float, *, waiting: bool
    ) -> CatalogProvider:
        """One provider's record (`core.catalog_view`) from its state. Its lists are the
        config's and the state's own (both are replaced, never changed in place): a
        catalog of thousands of providers allocates one untracked record per provider,
        and nothing for the cycle collector to chase."""
        queued = 0
        if waiting:
            queued = sum(
                waiter.could_use(state)
                for model_id in self._models_of.get(state.id, ())
                for waiter in self._queues.get(model_id, ())
            )
        return catalog_provider(
            state.config,
            node_id=state.node_id,
            connected=state.node_id in self._connected,
            health=state.health,
            detail=state.detail,
            in_flight=state.in_flight,
            long_in_flight=state.long_in_flight,
            other_edges_in_flight=state.others,
            discovered_models=state.discovered,
            discovered_lifecycle=state.discovered_lifecycle,
            queued=queued,
            cooling_down=state.passive.breaker(now=now, probing=state.trial is not None) == "open",
            consecutive_failures=state.passive.consecutive_failures,
            rate_limited_s=state.resting(now),
            protocols=state.protocols,
            model_states=state.holdings.states,
            max_loaded=state.holdings.max_loaded,
            pinned=state.holdings.all_pinned(),
            cached_share=self.cache_shares.share(state.id),
            unapplied=self._unapplied.of(state.node_id, state.id) if self._unapplied else None,
        )
