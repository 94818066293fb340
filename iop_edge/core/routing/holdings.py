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
   report says it is loaded or failed, or `load_timeout_s` passes.
4. A load placed on a runtime with no room unloads one of its models: the least
   recently used one with no run of this Edge in flight, which counts as cold until a
   report lists it again, or the same timeout passes. (The runtime picks its own victim,
   least recently used too; a report corrects any difference.)
5. The runtime has room while it holds fewer models than its `max_loaded` (always, when
   it does not say); it can take a load when it has room or holds a model with nothing
   of this Edge in flight (a sleeping runtime wakes only on command: it cannot).

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
        "_running",
        "max_loaded",
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

    def report(self, states: Sequence[ModelState] | None, max_loaded: int | None) -> None:
        """The Node's report: it settles the loads placed and unloads guessed that it
        speaks of (Rules 3, 4)."""
        self.max_loaded = max_loaded
        self.states = None if states is None else list(states)
        if states is None:
            self._reported = None
            self._placed.clear()
            self._evicting.clear()
            return
        reported = self._reported = {state.name: state for state in states}
        for name in list(self._placed):
            state = reported.get(name)
            if state is not None and (state.state in _HELD or state.state == "failed"):
                del self._placed[name]
        for name in list(self._evicting):
            state = reported.get(name)
            if state is None or state.state not in _HELD:
                del self._evicting[name]

    def forget(self) -> None:
        """The Node went away: nothing is known until it reports again."""
        self.states = None
        self.max_loaded = None
        self._reported = None
        self._placed.clear()
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
        """Rule 5: a run for `served` could make it load it now."""
        state = (self._reported or {}).get(served)
        if state is not None and state.state == "sleeping":
            return False
        return self.room(now) or any(not self._running[n] for n in self._held(now))

    def started(self, served: str, now: float, *, load_timeout_s: float) -> None:
        """A run of `served` was granted here (Rules 3, 4)."""
        if self.holding(served, now) == "cold":
            if not self.room(now):
                idle = [n for n in self._held(now) if not self._running[n] and n != served]
                if idle:
                    victim = min(idle, key=lambda n: self._last_used.get(n, -1.0))
                    self._evicting[victim] = now + load_timeout_s
            self._placed[served] = now + load_timeout_s
            self._evicting.pop(served, None)
        self._running[served] += 1
        self._last_used[served] = now

    def ended(self, served: str) -> None:
        """A run of `served` here ended."""
        running = self._running[served] - 1
        if running > 0:
            self._running[served] = running
        else:
            self._running.pop(served, None)
