"""When a model has been idle long enough to unload (design §18.4, `models[].lifecycle`).

The Edge sends each Node the idle rules of the models its providers serve
(`NodeConfig.idle`: provider, served name, `idle_unload_s`). The Node keeps the clock:
it is the one place that sees every Edge's runs on a provider and the runtime's own word
on what it holds, so several Edges sharing the Node agree without talking.

Rules:

1. A model's clock runs only while its runtime holds it (`loaded`, per the last probe,
   or since a run of it started there: a runtime that reports states loads a model for
   its run) and no run of it is in flight on that provider, from any Edge.
2. The clock starts when the last run ends, or, for a model no run has used since it
   was loaded, when a probe first reports it held (a preload, another tool's load).
3. A model that no longer has a rule, or is reported not held, forgets its clock; held
   again, it starts afresh (Rule 2).
4. A model some Edge link has pinned (`model_command` `pin`) is never due; the link's
   pins end with it (an operator's pin lasts until unpinned or its Edge goes away).
5. A model is due when its clock has run `idle_unload_s`; once the unload is asked for
   it is not due again until a probe reports it held again, or the unload failed (its
   clock then starts over).
6. Room for a pin's sake. A runtime that loads a model for a run unloads one of its own
   choosing when it holds all it can (`max_loaded`), and it knows nothing of pins: its
   least recently used model may be the pinned one. So before a run for a model the
   runtime does not hold, on a provider with a pinned model that holds all it can, the
   Node names the model to unload first (`victim`): the one idle longest that is neither
   pinned nor in use. With none, the runtime chooses (and the Edge loads a pin it
   dropped again).
7. The Node's own word is newer than a probe begun before the runtime did what it
   says. A run that starts loads its model: held from then on, and the runtime held it
   while the run ran, so a probe begun before the run ended does not say otherwise. Rule
   6's choice is gone from the instant it is chosen, and a probe begun before its unload
   returned (`unloaded`) says what the runtime held before. Such a probe changes
   neither model's standing; a probe begun later does (a load that failed, an unload
   that did not happen).

Pure: no I/O; the caller passes the time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from schemas.config import IdleRule

__all__ = ["IdleClock", "ModelKey"]

ModelKey = tuple[str, str]
"""(provider id, served model name)."""


class IdleClock:
    """The idle clocks of one Node's models (see the module rules)."""

    def __init__(self) -> None:
        self._rules: dict[ModelKey, float] = {}
        self._since: dict[ModelKey, float] = {}
        """Held models with nothing in flight: since when (Rules 1, 2)."""
        self._held: set[ModelKey] = set()
        self._max_loaded: dict[str, int] = {}
        self._stating: set[str] = set()
        """Providers whose runtime reports its models' states."""
        self._asked: set[ModelKey] = set()
        """Unloads asked for and not yet confirmed by a probe (Rule 5)."""
        self._running: Counter[ModelKey] = Counter()
        self._pins: dict[ModelKey, set[int]] = {}
        self._told: dict[ModelKey, float] = {}
        """When the Node last changed a model's standing itself, as far as a probe can
        tell: a run's start and end, Rule 6's choice and its unload's return (Rule 7)."""
        self._unloading: set[ModelKey] = set()
        """Rule 6's choices whose unload has not returned: no probe says otherwise."""

    def configure(self, rules: Iterable[IdleRule]) -> None:
        """The running config's rules; clocks of models that keep a rule go on (Rule 3)."""
        self._rules = {(rule.provider_id, rule.model): rule.idle_unload_s for rule in rules}

    def rule(self, key: ModelKey) -> float:
        """The model's `idle_unload_s` (inf: it has no rule)."""
        return self._rules.get(key, math.inf)

    def observe(
        self,
        provider_id: str,
        held: Iterable[str],
        now: float,
        *,
        max_loaded: int | None = None,
        probed_at: float | None = None,
    ) -> None:
        """A probe of `provider_id`, begun at `probed_at` (default `now`), says its
        runtime holds `held`, of `max_loaded` at most (Rules 2, 3, 5, 6, 7)."""
        began = now if probed_at is None else probed_at
        self._stating.add(provider_id)
        if max_loaded is None:
            self._max_loaded.pop(provider_id, None)
        else:
            self._max_loaded[provider_id] = max_loaded
        keys = {(provider_id, model) for model in held}
        gone = [
            key
            for key in self._held
            if key[0] == provider_id
            and key not in keys
            and not self._running[key]  # a model with a run in flight is held (Rule 1)
            and not self._newer(key, began)
        ]
        for key in gone:
            self._held.discard(key)
            self._since.pop(key, None)
            self._asked.discard(key)
        for key in keys - self._held:
            if self._newer(key, began):
                continue
            self._held.add(key)
            self._asked.discard(key)
            if not self._running[key]:
                self._since[key] = now

    def _newer(self, key: ModelKey, probed_at: float) -> bool:
        """Rule 7: the Node changed the model's standing since the probe began."""
        return key in self._unloading or self._told.get(key, -math.inf) >= probed_at

    def started(self, key: ModelKey, now: float = -math.inf) -> str | None:
        """A run of the model began at `now` (Rule 1); the model to unload before it
        runs, if Rule 6 names one (it counts as gone from then on, Rule 7)."""
        victim = self.victim(key)
        if victim is not None:
            dropped = (key[0], victim)
            self._held.discard(dropped)
            self._since.pop(dropped, None)
            self._told[dropped] = now
            self._unloading.add(dropped)
        self._running[key] += 1
        self._since.pop(key, None)
        if key[0] in self._stating:
            self._held.add(key)
            self._told[key] = now
        return victim

    def ended(self, key: ModelKey, now: float) -> None:
        """A run of the model ended (Rules 2, 7)."""
        if key in self._held:
            self._told[key] = now
        left = self._running[key] - 1
        if left > 0:
            self._running[key] = left
            return
        del self._running[key]
        if key in self._held:
            self._since[key] = now

    def unloaded(self, key: ModelKey, now: float) -> None:
        """Rule 6's unload of `key` returned (done or not): a probe begun from now on
        says what the runtime holds (Rule 7). Once per choice; later calls do nothing."""
        if key in self._unloading:
            self._unloading.discard(key)
            self._told[key] = now

    def unload_failed(self, key: ModelKey, now: float) -> None:
        """The unload asked for did not happen: the clock starts over (Rule 5)."""
        self._asked.discard(key)
        if key in self._held and not self._running[key]:
            self._since[key] = now

    def pin(self, key: ModelKey, link: int) -> bool:
        """`link` pins `key`; whether `key` was pinned by no link before."""
        unpinned = key not in self._pins
        self._pins.setdefault(key, set()).add(link)
        return unpinned

    def unpin(self, key: ModelKey, link: int) -> bool:
        """`link` lets go of `key`; whether that was `key`'s last pin."""
        links = self._pins.get(key)
        if links is None:
            return False
        links.discard(link)
        if links:
            return False
        del self._pins[key]
        return True

    def drop_link(self, link: int) -> bool:
        """Rule 4: a link's pins end with it; whether a model is no longer pinned."""
        unpinned = [key for key in list(self._pins) if self.unpin(key, link)]
        return bool(unpinned)

    def pinned(self, key: ModelKey) -> bool:
        return key in self._pins

    def pins(self) -> frozenset[ModelKey]:
        """Every pinned model, whichever link pinned it."""
        return frozenset(self._pins)

    def victim(self, key: ModelKey) -> str | None:
        """Rule 6: the model to unload before a run of `key` loads it, or None."""
        provider_id = key[0]
        if key in self._held or not any(pin[0] == provider_id for pin in self._pins):
            return None
        limit = self._max_loaded.get(provider_id)
        held = [k for k in self._held if k[0] == provider_id]
        if limit is None or len(held) < limit:
            return None
        idle = [k for k in held if not self._running[k] and k not in self._pins]
        return min(idle, key=lambda k: self._since.get(k, math.inf))[1] if idle else None

    def _deadline(self, key: ModelKey) -> float:
        idle_s = self._rules.get(key)
        since = self._since.get(key)
        if idle_s is None or since is None or key in self._pins or key in self._asked:
            return math.inf
        return since + idle_s

    def next_due(self) -> float:
        """When the next model falls due (inf: none will, as things stand)."""
        return min((self._deadline(key) for key in self._since), default=math.inf)

    def due(self, now: float) -> list[ModelKey]:
        """The models to unload now; each counts as asked for (Rule 5)."""
        keys = sorted(key for key in self._since if self._deadline(key) <= now)
        self._asked.update(keys)
        return keys
