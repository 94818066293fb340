"""The Node's idle unloads and pins (design §18.4): `idle_clock` decides, this acts.

The host tells the keeper what it sees (the running config's idle rules, every probe's
model states, each run's start and end, each link's pins) and runs `run()` in its
nursery. When a model falls due, the keeper asks its runtime to unload it through the
host's `ModelControl` (so it waits its turn behind, or joins, the Edges' own commands)
and has the provider probed, so every Edge hears the new state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping

import msgspec
import trio

from iop_node.adapters.base import Adapter
from iop_node.idle_clock import IdleClock, ModelKey
from iop_node.runs.model_control import ModelControl
from schemas.config import IdleRule
from schemas.wire import ProviderStatus, Run

__all__ = ["IdleKeeper"]

log = logging.getLogger(__name__)

AdapterOf = Callable[[str], Adapter | None]
Probe = Callable[[Adapter], Awaitable[None]]


class IdleKeeper:
    """Unloads the models that fell idle on one Node's providers (see the module doc)."""

    def __init__(self, control: ModelControl, adapter_of: AdapterOf, probe: Probe) -> None:
        self.clock = IdleClock()
        self._control = control
        self._adapter_of = adapter_of
        self._probe = probe
        self._changed = trio.Event()
        self._until = math.inf
        """When the running loop wakes next by itself (the next model due)."""

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def configure(self, rules: Iterable[IdleRule]) -> None:
        self.clock.configure(rules)
        self._wake()

    def observe(self, statuses: Iterable[ProviderStatus], probed_at: Mapping[str, float]) -> None:
        """A probe's report: which models each runtime holds (providers whose runtime
        reports no states are left alone: nothing can be unloaded there), each by when
        its probe began (`idle_clock` Rule 7)."""
        now = trio.current_time()
        for status in statuses:
            if status.model_states is not None:
                held = [state.name for state in status.model_states if state.state == "loaded"]
                self.clock.observe(
                    status.id,
                    held,
                    now,
                    max_loaded=status.max_loaded,
                    probed_at=probed_at.get(status.id, now),
                )
        self._wake()

    def started(self, key: ModelKey) -> str | None:
        """A run began; the model to unload before it runs (`make_room`), if any."""
        return self.clock.started(key, trio.current_time())

    def spared(self, key: ModelKey) -> None:
        """The run `started` named `key` to unload for did not start, so nothing unloads
        it: as after an unload that returned, the next probe says where it stands."""
        self.clock.unloaded(key, trio.current_time())

    def ended(self, key: ModelKey) -> None:
        """A run ended: its model's clock may start; the loop is woken only when that
        brings the next unload forward (most runs end on models with no rule)."""
        now = trio.current_time()
        self.clock.ended(key, now)
        if now + self.clock.rule(key) < self._until:
            self._wake()

    def pin(self, key: ModelKey, link: int) -> bool:
        """`link` pins `key`; whether the Node's pins changed (the Edges must hear)."""
        return self.clock.pin(key, link)

    def unpin(self, key: ModelKey, link: int) -> bool:
        """`link` lets go of `key`; whether the Node's pins changed."""
        changed = self.clock.unpin(key, link)
        self._wake()
        return changed

    def drop_link(self, link: int) -> bool:
        """`link` ended, and its pins with it; whether the Node's pins changed."""
        changed = self.clock.drop_link(link)
        self._wake()
        return changed

    def mark_pins(self, statuses: list[ProviderStatus]) -> list[ProviderStatus]:
        """`statuses` with each pinned model's state marked `pinned` (every Edge's
        placement keeps any Edge's pin); the same list when nothing is pinned."""
        pins = self.clock.pins()
        if not pins:
            return statuses
        marked = []
        for status in statuses:
            states = status.model_states
            if states is None or not any((status.id, s.name) in pins for s in states):
                marked.append(status)
                continue
            states = [
                msgspec.structs.replace(s, pinned=(status.id, s.name) in pins) for s in states
            ]
            marked.append(msgspec.structs.replace(status, model_states=states))
        return marked

    async def make_room(self, victim: str, run: Run, adapter: Adapter) -> None:
        """Before a run: unload `victim`, the model `idle_clock` Rule 6 named when the run
        started (the run then loads its own model into the room, and the pin stays)."""
        log.info(
            "provider %s: unloading %s to make room for %s (a pinned model stays)",
            run.provider_id,
            victim,
            run.target,
        )
        key = (run.provider_id, victim)

        async def returned() -> None:  # before the probe: it tells what the unload did
            self.clock.unloaded(key, trio.current_time())
            await self._probe(adapter)

        try:
            error = await self._control.run(adapter, "unload", victim, after=returned)
        finally:  # joined another command's unload, or cancelled: it returned all the same
            self.clock.unloaded(key, trio.current_time())
        if error is not None:
            log.warning("provider %s: unload of %s failed: %s", run.provider_id, victim, error)

    async def run(self) -> None:
        """Unload each model as it falls due, for as long as the Node runs."""
        async with trio.open_nursery() as nursery:
            while True:
                changed = self._changed
                self._until = self.clock.next_due()
                with trio.move_on_at(self._until):
                    await changed.wait()
                for key in self.clock.due(trio.current_time()):
                    nursery.start_soon(self._unload, key, name=f"idle unload {key[1]}")

    async def _unload(self, key: ModelKey) -> None:
        provider_id, model = key
        adapter = self._adapter_of(provider_id)
        if adapter is None:
            return
        log.info(
            "provider %s: unloading %s, idle for %gs", provider_id, model, self.clock.rule(key)
        )
        error = await self._control.run(
            adapter, "unload", model, after=lambda: self._probe(adapter)
        )
        if error is not None:
            log.warning("provider %s: idle unload of %s failed: %s", provider_id, model, error)
            self.clock.unload_failed(key, trio.current_time())
            self._wake()
