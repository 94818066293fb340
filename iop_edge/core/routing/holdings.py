"""What one provider's runtime holds in memory, as this Edge knows it (design §18.4).

The Node reports the runtime's models' states at each probe (`status.model_states`); in
between, this Edge's own runs change them: a run sent for a model the runtime does not
hold makes it load that model, and, when the runtime holds all it can, unload another.
Routing on the last report alone would send the next runs of that model elsewhere (a
second load) and runs of the unloaded one back to a runtime that no longer holds it (a
reload): the thrash placement is there to prevent. So the Edge keeps its own account:

1. A runtime that reports no states holds every model it serves (`held`).
2. A reported `loaded` or `loading` model is held; `unloaded` and `sleeping` are cold;
   `failed` is failed (with the runtime's reason); a model the report does not list is
   cold.
3. A run granted for a cold model places a load there: the model counts as held until a
   report says it is loaded or failed, or `load_timeout_s` passes. A report that says it
   is not held settles the load too once a run of that model has ended there since the
   load was placed: the runtime loaded it for that run and has unloaded it since (a pin,
   another Edge's load). A report before that may predate the load itself.
4. A load placed on a runtime with no room unloads one of its models: the least
   recently used one with no run of this Edge in flight and no pin (this Edge's,
   `pinned`, `core.lifecycle` Rule 4, or another Edge's, which the Node reports as
   `ModelState.pinned`), which counts as cold until a report lists it again, or the
   same timeout passes. (The runtime picks its own victim,
   least recently used too; a report corrects any difference.)
5. The runtime has room while it holds fewer models than its `max_loaded` (always, when
   it does not say); it can take a load when it has room or holds a model with nothing
   of this Edge in flight and no pin.
6. A `sleeping` model (vLLM's sleep mode) wakes for the run that finds it asleep (its
   Node wakes the runtime first): it can always be woken, and a wake-up unloads nothing
   (the runtime holds the model already), so it is a load with room, and a cheaper one
   than a cold load (`asleep`).

Pure: no I/O; the caller passes the time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from iop_edge.core.routing.pool import Holding
from schemas.wire import ModelLoadState, ModelState

__all__ = ["Holdings"]

_HELD: frozenset[ModelLoadState] = frozenset({"loaded", "loading"})


class Holdings:
    """One provider's models in its runtime's memory (see the module rules)."""

    __slots__ = (
        "_evicting",
        "_last_used",
        "_placed",
        "_reported",
        "_reported_pins",
        "_running",
        "_served",
        "max_loaded",
        "pinned",
        "states",
    )

    def __init__(self) -> None:
        self.states: list[ModelState] | None = None
        """The Node's last report of each served model's state; None: it reports none."""
        self._reported: dict[str, ModelState] | None = None
        """`states` by name."""
        self.max_loaded: int | None = None
        self._placed: dict[str, float] = {}
        """Served name -> until when a load this Edge placed counts as held (Rule 3)."""
        self._evicting: dict[str, float] = {}
        """Served name -> until when it counts as unloaded for a load placed (Rule 4)."""
        self._last_used: dict[str, float] = {}
        self._running: Counter[str] = Counter()
        self._served: set[str] = set()
        """Placed loads a run of the model has ended on since (Rule 3)."""
        self.pinned: frozenset[str] = frozenset()
        """Served names this Edge pinned here: never unloaded to make room (Rules 4, 5)."""
        self._reported_pins: frozenset[str] = frozenset()
        """Served names the Node reports pinned (by any Edge): the same (Rule 4)."""

    def report(self, states: Sequence[ModelState] | None, max_loaded: int | None) -> None:
        """The Node's report: it settles the loads placed and unloads guessed that it
        speaks of (Rules 3, 4)."""
        self.max_loaded = max_loaded
        self.states = None if states is None else list(states)
        self._reported_pins = (
            frozenset(s.name for s in states if s.pinned) if states else frozenset()
        )
        if states is None:
            self._reported = None
            self._placed.clear()
            self._served.clear()
            self._evicting.clear()
            return
        reported = self._reported = {state.name: state for state in states}
        for name in list(self._placed):
            state = reported.get(name)
            settled = state is not None and (state.state in _HELD or state.state == "failed")
            if settled or name in self._served:
                del self._placed[name]
                self._served.discard(name)
        for name in list(self._evicting):
            state = reported.get(name)
            if state is None or state.state not in _HELD:
                del self._evicting[name]

    def forget(self) -> None:
        """The Node went away: nothing is known until it reports again."""
        self.states = None
        self.max_loaded = None
        self._reported = None
        self._reported_pins = frozenset()
        self._placed.clear()
        self._served.clear()
        self._evicting.clear()

    def holding(self, served: str, now: float) -> Holding:
        """Whether the runtime holds `served` (Rules 1-4)."""
        reported = self._reported
        if reported is None:
            return "held"
        if self._evicting.get(served, -1.0) > now:
            return "cold"
        if self._placed.get(served, -1.0) > now:
            return "held"
        state = reported.get(served)
        if state is None:
            return "cold"
        if state.state in _HELD:
            return "held"
        return "failed" if state.state == "failed" else "cold"

    def loading(self, served: str, now: float) -> bool:
        """Whether the runtime is loading `served` now: a load this Edge placed that no
        report has settled yet, or a report that says `loading`."""
        if self._placed.get(served, -1.0) > now:
            return True
        state = (self._reported or {}).get(served)
        return state is not None and state.state == "loading"

    def reported_loaded(self, served: str) -> bool:
        """Whether the runtime's last report says `served` is loaded."""
        state = (self._reported or {}).get(served)
        return state is not None and state.state == "loaded"

    def failure(self, served: str) -> str | None:
        """The runtime's reason a failed model failed."""
        state = (self._reported or {}).get(served)
        return state.reason if state is not None and state.state == "failed" else None

    def _held(self, now: float) -> list[str]:
        reported = self._reported or {}
        names = {n for n, s in reported.items() if s.state in _HELD} | {
            n for n, until in self._placed.items() if until > now
        }
        return [n for n in names if self._evicting.get(n, -1.0) <= now]

    def room(self, now: float) -> bool:
        """Rule 5: it holds fewer models than it can."""
        return self.max_loaded is None or len(self._held(now)) < self.max_loaded

    def can_load(self, served: str, now: float) -> bool:
        """Rules 5, 6: a run for `served` could make it load (or wake) it now."""
        if self.asleep(served):
            return True
        return self.room(now) or any(self._evictable(n) for n in self._held(now))

    def asleep(self, served: str) -> bool:
        """Rule 6: the runtime's last report says `served` is sleeping."""
        state = (self._reported or {}).get(served)
        return state is not None and state.state == "sleeping"

    def all_pinned(self) -> frozenset[str]:
        """Served names pinned here by this Edge or, as the Node reports, any other."""
        if not self._reported_pins:
            return self.pinned
        return self.pinned | self._reported_pins

    def _evictable(self, served: str) -> bool:
        return (
            not self._running[served]
            and served not in self.pinned
            and served not in self._reported_pins
        )

    def started(self, served: str, now: float, *, load_timeout_s: float) -> None:
        """A run of `served` was granted here (Rules 3, 4)."""
        if self.holding(served, now) == "cold":
            if not self.room(now) and not self.asleep(served):
                idle = [n for n in self._held(now) if self._evictable(n) and n != served]
                if idle:
                    victim = min(idle, key=lambda n: self._last_used.get(n, -1.0))
                    self._evicting[victim] = now + load_timeout_s
            self._placed[served] = now + load_timeout_s
            self._served.discard(served)
            self._evicting.pop(served, None)
        self._running[served] += 1
        self._last_used[served] = now

    def ended(self, served: str) -> None:
        """A run of `served` here ended."""
        if served in self._placed:
            self._served.add(served)  # Rule 3
        running = self._running[served] - 1
        if running > 0:
            self._running[served] = running
        else:
            self._running.pop(served, None)
