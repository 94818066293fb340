"""The Edge's heartbeat grid: one timer for every Node session's liveness (session Rule 5).

Every session is looked at once per `interval_s`, at one of the instants of a grid
shared by all sessions (`schemas.heartbeat`: an instant every `HEARTBEAT_STEP_S`); a
look pings the peer only when nothing arrived from it since about the previous look (a
Node pings the Edge every interval on its own, and its runs' events are proof of life
too). One task, the grid's, keeps the time: it wakes at the beats of the slots that hold
sessions, and looks at each such slot's sessions in one pass; a slot nobody joined costs
no wake-up (an Edge with a handful of Nodes wakes a handful of times an interval, not at
every beat), and with no session at all the grid sleeps until one joins. A session's own
heartbeat task waits without a timer until a look finds its peer silent.

Why one timer: a thousand sessions each sleeping until their next look cost the idle
Edge a timer per session per interval (a cancel scope, a deadline, and the `Cancelled`
that ends each sleep) just to find, nearly every time, a peer that had pinged the Edge
a moment ago. The grid's look is an attribute read per session.

What an idle fleet costs the Edge is then the Nodes' own pings: each is a read, a pong
and a few scheduling passes, about a hundred microseconds of the event loop. Ten
thousand Nodes pinging every 5 s would be 2,000 pings a second, a quarter of a core
spent on nothing. So the interval an Edge announces grows with its fleet
(`fleet_interval`): an idle fleet sends at most `PINGS_PER_S` pings a second, whatever
its size. The cost is a slower verdict on a Node that went silent (one interval, then
the grid's timeout); a Node's runs and status messages count as proof of life as before.
"""

from __future__ import annotations

import math
from typing import Final, Protocol

import trio

from schemas.heartbeat import heartbeat_slots

__all__ = ["PINGS_PER_S", "HeartbeatGrid", "Watched", "fleet_interval"]

#: The most heartbeat pings an idle fleet sends the Edge a second (`fleet_interval`).
PINGS_PER_S: Final = 500


def fleet_interval(interval_s: float, nodes: int) -> float:
    """The heartbeat interval for a fleet of `nodes` Nodes: `interval_s`, or longer so
    that the fleet pings at most `PINGS_PER_S` times a second (module docstring)."""
    return max(interval_s, nodes / PINGS_PER_S)


class Watched(Protocol):
    def look(self, now: float, quiet_s: float) -> None:
        """Ping the peer if nothing arrived from it in the last `quiet_s` seconds."""


class HeartbeatGrid:
    """The looks of every session joined (see the module docstring); `run` keeps the time.

    A session joins at the slot of the first beat a whole interval after it joined, so
    its first ping (if it ever needs one) comes an interval after the session began; a
    look at that slot sooner than that finds it heard from (its `hello`) and does
    nothing."""

    def __init__(self, interval_s: float, timeout_s: float) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        """A ping unanswered for this long ends the session (its own task enforces it)."""
        self._count = heartbeat_slots(interval_s)
        self._step = interval_s / self._count
        self._slots: list[set[Watched]] = [set() for _ in range(self._count)]
        self._slot_of: dict[Watched, int] = {}
        self._sleep = trio.CancelScope()
        """The grid's wait for its next beat: a session joining at an earlier beat
        brings it forward (`join`)."""

    @property
    def quiet_s(self) -> float:
        """Silence that makes a look ping: "since about the previous look". The answer to
        the previous ping arrives just after that look and does not count."""
        return self.interval_s - self._step

    def join(self, session: Watched) -> None:
        beat = math.ceil((trio.current_time() + self.interval_s) / self._step)
        slot = beat % self._count
        self._slots[slot].add(session)
        self._slot_of[session] = slot
        at = beat * self._step
        self._sleep.deadline = min(self._sleep.deadline, at)

    def leave(self, session: Watched) -> None:
        slot = self._slot_of.pop(session, None)
        if slot is not None:
            self._slots[slot].discard(session)

    async def run(self) -> None:
        """Look at each slot's sessions at its beats, forever. A late wake-up (a busy
        Edge) looks at every slot it passed, in order, once."""
        beat = math.ceil(trio.current_time() / self._step)
        while True:
            self._sleep = trio.CancelScope(deadline=self._next_beat(beat) * self._step)
            with self._sleep:
                await trio.sleep_forever()
            now = trio.current_time()
            quiet_s = self.quiet_s
            # Every slot once at most, however long the grid slept (no session joined).
            beat = max(beat, math.floor(now / self._step) - self._count + 1)
            while beat * self._step <= now:
                slot = self._slots[beat % self._count]
                if slot:
                    _look(tuple(slot), now, quiet_s)
                beat += 1

    def _next_beat(self, beat: int) -> float:
        """The first beat from `beat` on whose slot holds a session; infinity when no
        slot does (`join` brings the wait forward)."""
        slots, count = self._slots, self._count
        for ahead in range(count):
            if slots[(beat + ahead) % count]:
                return beat + ahead
        return math.inf


def _look(sessions: tuple[Watched, ...], now: float, quiet_s: float) -> None:
    """One slot's looks, in a frame of their own: the loop above, which waits between
    beats, keeps no reference to a session (one that ended is freed at once)."""
    for session in sessions:
        session.look(now, quiet_s)
