"""What the scheduler keeps of one provider at run time, across snapshots (design §4).

A provider's state outlives the snapshots it appears in: its slot limiters (resized in
place, never replaced), its health and the Node's reason for it, its passive health, what
other Edges hold on it, what its runtime holds. It reads its config and Node through the
running snapshot's `Lookups`, which a swap replaces for every state at once.
"""

from __future__ import annotations

import math
from typing import Final

import trio

from iop_edge.core.routing.holdings import Holdings
from iop_edge.core.routing.pool import Applied, Holding, PassiveHealth, ProviderView
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.runs.lease import Lease
from schemas.config import LifecycleFlag, ProviderConfig
from schemas.protocols import CallerProtocol
from schemas.wire import Health

#: The longest an upstream's Retry-After rests its provider (pool Rule 9): a provider
#: that asked for an hour (a daily quota, say) is tried again by one run a minute.
MAX_REST_S: Final = 60.0


def long_capacity(config: ProviderConfig) -> int | float:
    """Null `long_context_slots` = no separate budget: count long runs, limit nothing."""
    slots = config.long_context_slots
    return math.inf if slots is None else slots


class Lookups:
    """The running snapshot's per-provider lookups, through which every provider state
    reads its config and Node: a swap replaces them for all states in one assignment, so
    a refresh that changes every provider of a fleet costs the swap no pass over them."""

    __slots__ = ("provider_node", "providers")

    def __init__(self, snapshot: Snapshot) -> None:
        self.adopt(snapshot)

    def adopt(self, snapshot: Snapshot) -> None:
        self.providers = snapshot.providers
        self.provider_node = snapshot.provider_node


class ProviderState:
    """Everything the Edge knows about one provider at run time, across snapshots."""

    __slots__ = (
        "_last_config",
        "_last_node",
        "_lookups",
        "detail",
        "discovered",
        "discovered_lifecycle",
        "health",
        "holdings",
        "id",
        "limiter",
        "long_limiter",
        "others",
        "others_long",
        "passive",
        "removed",
        "reported_protocols",
        "rest_until",
        "saturated",
        "trial",
    )

    def __init__(self, provider_id: str, lookups: Lookups) -> None:
        self.id = provider_id
        self._lookups = lookups
        config = self._last_config = lookups.providers[provider_id]
        self._last_node = lookups.provider_node[provider_id]
        self.limiter = trio.CapacityLimiter(config.capacity)
        self.long_limiter = trio.CapacityLimiter(long_capacity(config))
        self.health: Health = "unknown"
        self.detail: str | None = None
        """The Node's reason for `health`, from its last `status`."""
        self.discovered: list[str] = []
        self.discovered_lifecycle: list[LifecycleFlag] | None = None
        self.holdings = Holdings()
        """Which models its runtime holds: the Node's last report of each served model's
        load state, and this Edge's account since (`core.routing.holdings`, design §18)."""
        self.reported_protocols: frozenset[CallerProtocol] | None = None
        """The protocols the Node last said the provider speaks natively; None until it
        says (the config's then count)."""
        self.passive = PassiveHealth()
        self.rest_until: float | None = None
        """Until when its upstream asked, with a 429/503's Retry-After, to be left alone
        (pool Rule 9)."""
        self.trial: Lease | None = None
        """The half-open breaker's one trial run, while it is in flight."""
        self.removed = False
        """Gone from config; kept only until its last lease is released."""
        self.others = 0
        """Runs other Edges hold on the provider, as its Node last reported."""
        self.others_long = 0
        self.saturated = False
        """The Node answered `busy`: full until its next load report."""

    def rest(self, seconds: float, now: float) -> bool:
        """Its upstream asked to be left alone for `seconds` (at most `MAX_REST_S`) from
        `now`: whether that rests it longer than it already rested (pool Rule 9)."""
        until = now + min(seconds, MAX_REST_S)
        if self.rest_until is not None and until <= self.rest_until:
            return False
        self.rest_until = until
        return True

    def resting(self, now: float) -> float | None:
        """Seconds its rest has still to run at `now`, while it rests."""
        until = self.rest_until
        return until - now if until is not None and until > now else None

    def forget_others(self) -> None:
        self.others = self.others_long = 0
        self.saturated = False

    def speaks(self, protocol: CallerProtocol) -> bool:
        """Whether the provider speaks `protocol` natively, as far as the Edge knows now."""
        reported = self.reported_protocols
        if reported is not None:
            return protocol in reported
        return protocol in self.config.native_protocols

    def view(
        self,
        config: ProviderConfig,
        now: float,
        protocol: CallerProtocol,
        *,
        served: str,
        connected: bool,
        applied: Applied,
    ) -> ProviderView:
        """What a decision sees of the provider now (`core.routing.pool`), for a run of a
        model it knows by `served` (`config`: its own, from the snapshot's rotation of the
        model; `connected`, `applied`: of its Node, as the scheduler knows them)."""
        breaker = self.passive.breaker(now=now, probing=self.trial is not None)
        until = self.passive.cooldown_until
        capacity = config.capacity
        holdings = self.holdings
        holds: Holding = "held"
        room = can_load = True
        asleep = False
        if holdings.states is not None:  # its runtime says what it holds (pool Rule 8)
            holds = holdings.holding(served, now)
            if holds == "cold":
                room = holdings.room(now)
                can_load = holdings.can_load(served, now)
                asleep = holdings.asleep(served)
        return ProviderView(
            id=self.id,
            capacity=capacity,
            in_flight=max(self.in_flight, capacity) if self.saturated else self.in_flight,
            priority=config.priority,
            long_context_slots=config.long_context_slots,
            long_in_flight=self.long_in_flight,
            connected=connected,
            enabled=config.enabled,
            health=self.health,
            breaker=breaker,
            cooldown_remaining_s=until - now if breaker == "open" and until is not None else None,
            rest_remaining_s=self.resting(now),
            native=protocol == "chat" or self.speaks(protocol),
            holds=holds,
            room=room,
            can_load=can_load,
            asleep=asleep,
            applied=applied,
        )

    @property
    def protocols(self) -> list[CallerProtocol]:
        """What the provider speaks natively, as far as the Edge knows now."""
        if self.reported_protocols is not None:
            return sorted(self.reported_protocols)
        return sorted(self.config.native_protocols)

    @property
    def in_flight(self) -> int:
        """Every run on the provider: this Edge's and the other Edges'."""
        return self.limiter.borrowed_tokens + self.others

    @property
    def long_in_flight(self) -> int:
        return self.long_limiter.borrowed_tokens + self.others_long

    @property
    def config(self) -> ProviderConfig:
        """The provider's config in the running snapshot, its last one once removed. The
        limiters follow it when a slot is next taken (`fit_limiters`)."""
        if self.removed:
            return self._last_config
        return self._lookups.providers[self.id]

    @property
    def node_id(self) -> str:
        """The Node the running snapshot puts the provider on, its last once removed."""
        if self.removed:
            return self._last_node
        return self._lookups.provider_node[self.id]

    def retire(self) -> None:
        """Gone from config: keep the config and Node of the snapshot it leaves (before
        the lookups adopt the next one)."""
        self._last_config = self.config
        self._last_node = self.node_id
        self.removed = True

    def fit_limiters(self) -> None:
        """Resize the limiters to the config, in place (never replaced). Decisions read
        the config's capacity; only taking a slot needs the limiter's own size."""
        config = self.config
        if self.limiter.total_tokens != config.capacity:
            self.limiter.total_tokens = config.capacity
        long_total = long_capacity(config)
        if self.long_limiter.total_tokens != long_total:
            self.long_limiter.total_tokens = long_total

    @property
    def idle(self) -> bool:
        return self.limiter.borrowed_tokens == 0 and self.long_limiter.borrowed_tokens == 0
