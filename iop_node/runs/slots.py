"""Run slots of this Node's providers, counted across every Edge link (design §13).

Several Edges may send runs to the same provider (replicas, or an old and a new Edge
during a restart). Each Edge counts what it dispatched itself; only the Node sees them
all, so the Node is where capacity is enforced and where the Edges learn what the others
hold.

Rules:
1. Each provider has one `trio.CapacityLimiter(capacity)`, plus one for long-context
   runs (`long_context_slots`; unlimited when null, so long runs are still counted). They
   belong to the provider id, not to a registry or a link: a refresh resizes them in
   place (a shrink below what is held only stops new runs), so concurrency never doubles
   across a registry swap.
2. A run takes its slot(s) on arrival and never waits: `hold()` raises `Busy` when there
   is none (the Edge fails over or waits in its own queue; a Node has no queue). A long
   run holds one long slot and one regular slot.
3. A `SlotHold` is released exactly once, by whichever comes first: the run ended, its
   Edge cancelled it (the Edge already counts the slot as free and may send the next run
   on it), or its link is gone.
4. Per link the Node keeps how many runs it holds on each provider; a link's *others*
   view of a provider is everyone's count minus its own. Anything that changes a link's
   others view bumps that link's version and wakes whoever waits on it.
5. A provider not in the config has no slots: its runs are not counted (they fail as
   `unknown_provider`). A provider removed from the config keeps its limiters until
   its last run ends.
6. A provider is *under pressure* while at least half its slots are held: then what the
   other links hold decides admission, and links must hear changes promptly; below that
   it only shapes ranking, and reports may be lazy (see `link`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import trio

from schemas.config import ProviderConfig
from schemas.wire import ProviderLoad

__all__ = ["Busy", "ProviderSlots", "SlotHold", "SlotStatistics"]

LinkId = int


class Busy(Exception):
    """Every slot this run needs is taken (Rule 2); the message says which."""


@dataclass(frozen=True, slots=True)
class SlotStatistics:
    """The counts right now, and the most ever held at once, per provider."""

    in_flight: dict[str, int]
    long_in_flight: dict[str, int]
    peak: dict[str, int]
    """The highest `in_flight` seen since the provider was first configured."""
    by_link: dict[LinkId, dict[str, int]]


class _Provider:
    __slots__ = ("capacity", "limiter", "long_limiter", "peak", "removed")

    def __init__(self, config: ProviderConfig) -> None:
        self.limiter = trio.CapacityLimiter(config.capacity)
        self.long_limiter = trio.CapacityLimiter(_long_total(config))
        self.capacity = config.capacity
        self.peak = 0
        self.removed = False

    def configure(self, config: ProviderConfig) -> None:
        self.limiter.total_tokens = config.capacity
        self.long_limiter.total_tokens = _long_total(config)
        self.capacity = config.capacity
        self.removed = False

    @property
    def idle(self) -> bool:
        return self.limiter.borrowed_tokens == 0


def _pressed(state: _Provider) -> bool:
    return 2 * state.limiter.borrowed_tokens >= state.capacity


def _long_total(config: ProviderConfig) -> int | float:
    slots = config.long_context_slots
    return math.inf if slots is None else slots


class SlotHold:
    """One run's slot(s) on one provider; `release()` is idempotent (Rule 3)."""

    __slots__ = ("_owner", "_released", "link", "long", "provider_id")

    def __init__(self, owner: ProviderSlots, link: LinkId, provider_id: str, long: bool) -> None:
        self._owner = owner
        self.link = link
        self.provider_id = provider_id
        self.long = long
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._owner._release(self)


class ProviderSlots:
    """The Node's run slots per provider, and who holds them (see the module rules)."""

    def __init__(self) -> None:
        self._providers: dict[str, _Provider] = {}
        self._held: dict[LinkId, Counter[tuple[str, bool]]] = {}
        self._versions: dict[LinkId, int] = {}
        self._changed: dict[LinkId, trio.Event] = {}
        self._pressure = trio.Event()

    # --- config ------------------------------------------------------------------------

    def configure(self, providers: Iterable[ProviderConfig]) -> None:
        """Adopt the running config's providers: resize in place, add, retire (Rule 1)."""
        configured = set()
        for config in providers:
            configured.add(config.id)
            state = self._providers.get(config.id)
            if state is None:
                self._providers[config.id] = _Provider(config)
            else:
                state.configure(config)
        for provider_id, state in list(self._providers.items()):
            if provider_id not in configured:
                state.removed = True
                if state.idle:
                    del self._providers[provider_id]
        self._touch_all()

    # --- links -------------------------------------------------------------------------

    def add_link(self, link: LinkId) -> None:
        self._held[link] = Counter()
        self._versions[link] = 0
        self._changed[link] = trio.Event()

    def remove_link(self, link: LinkId) -> None:
        """Forget a link; its holds must have been released first."""
        held = self._held.pop(link, None)
        assert held is None or not +held, f"link {link} still holds {+held}"
        self._versions.pop(link, None)
        event = self._changed.pop(link, None)
        if event is not None:
            event.set()

    # --- runs --------------------------------------------------------------------------

    def hold(self, link: LinkId, provider_id: str, *, long: bool) -> SlotHold | None:
        """Take a slot for a run of `link` now, or raise `Busy` (Rule 2). None when the
        provider has no slots here (Rule 5): the run goes on, uncounted."""
        state = self._providers.get(provider_id)
        if state is None or state.removed:
            return None
        hold = SlotHold(self, link, provider_id, long)
        try:
            state.limiter.acquire_on_behalf_of_nowait(hold)
        except trio.WouldBlock:
            raise Busy(
                f"provider {provider_id!r} is busy: all {state.capacity} of its slots on this "
                "node are taken"
            ) from None
        if long:
            try:
                state.long_limiter.acquire_on_behalf_of_nowait(hold)
            except trio.WouldBlock:
                state.limiter.release_on_behalf_of(hold)
                raise Busy(
                    f"provider {provider_id!r} is busy: all its long-context slots on this "
                    "node are taken"
                ) from None
        state.peak = max(state.peak, state.limiter.borrowed_tokens)
        if _pressed(state):
            self._pressure.set()
            self._pressure = trio.Event()
        self._held[link][provider_id, long] += 1
        self._touch_others(link)
        return hold

    def _release(self, hold: SlotHold) -> None:
        state = self._providers[hold.provider_id]
        state.limiter.release_on_behalf_of(hold)
        if hold.long:
            state.long_limiter.release_on_behalf_of(hold)
        if state.removed and state.idle:
            del self._providers[hold.provider_id]
        held = self._held.get(hold.link)
        if held is not None:
            held[hold.provider_id, hold.long] -= 1
        self._touch_others(hold.link)

    # --- what each link hears ----------------------------------------------------------

    def others(self, link: LinkId) -> list[ProviderLoad]:
        """Per provider, the runs every other link holds (Rule 4), sorted by id."""
        own = self._held.get(link, Counter())
        loads = []
        for provider_id in sorted(self._providers):
            state = self._providers[provider_id]
            mine = own[provider_id, False] + own[provider_id, True]
            long_mine = own[provider_id, True]
            loads.append(
                ProviderLoad(
                    id=provider_id,
                    in_flight=state.limiter.borrowed_tokens - mine,
                    long_in_flight=state.long_limiter.borrowed_tokens - long_mine,
                )
            )
        return loads

    def under_pressure(self) -> bool:
        """Whether some provider has at least half its slots held (Rule 6)."""
        return any(_pressed(state) for state in self._providers.values())

    async def wait_pressure(self) -> None:
        """Return at the next run that leaves its provider under pressure (Rule 6)."""
        await self._pressure.wait()

    def held_by(self, link: LinkId) -> int:
        return sum((self._held.get(link) or Counter()).values())

    def version(self, link: LinkId) -> int:
        """Bumped whenever `others(link)` may have changed."""
        return self._versions.get(link, 0)

    async def wait_changed(self, link: LinkId, version: int) -> None:
        """Return once `version(link)` differs from `version` (or the link is gone)."""
        while link in self._versions and self._versions[link] == version:
            await self._changed[link].wait()

    def _touch_others(self, link: LinkId) -> None:
        for other in self._versions:
            if other != link:
                self._touch(other)

    def _touch_all(self) -> None:
        for link in self._versions:
            self._touch(link)

    def _touch(self, link: LinkId) -> None:
        self._versions[link] += 1
        self._changed[link].set()
        self._changed[link] = trio.Event()  # one-shot: replace, never clear

    # --- observation -------------------------------------------------------------------

    def statistics(self) -> SlotStatistics:
        by_link: dict[LinkId, dict[str, int]] = {}
        for link, held in self._held.items():
            counts: Counter[str] = Counter()
            for (provider_id, _), count in held.items():
                counts[provider_id] += count
            by_link[link] = dict(+counts)
        return SlotStatistics(
            in_flight={pid: s.limiter.borrowed_tokens for pid, s in self._providers.items()},
            long_in_flight={
                pid: s.long_limiter.borrowed_tokens for pid, s in self._providers.items()
            },
            peak={pid: s.peak for pid, s in self._providers.items()},
            by_link=by_link,
        )
