"""Reconnect backoff for the Node's link to the Edge: a pure state machine, no I/O.

The link reports what happened to each connection attempt; this module answers how long
to wait before the next one, or that it is time to give up. It never sleeps and never
reads a clock, so every rule below is tested synchronously with a seeded `random.Random`.

Rules:

1. Every failed attempt (connect refused, handshake timeout, a session that died young)
   raises the *ceiling* of the next delay exponentially:
   ``ceiling(n) = min(cap_s, base_s * factor**n)`` where ``n`` counts the failures since
   the last reset (the first failure waits under ``base_s``).
2. The delay itself is drawn with *full jitter*: ``uniform(0, ceiling)``. Many Nodes
   losing the same Edge at once thus spread their reconnects instead of stampeding it
   the moment it comes back.
3. A session that stayed up at least ``stable_after_s`` was healthy: when it ends the
   failure count resets, whatever it had grown to before that session (a Node started
   before its Edge has a large count by the time it connects).
4. After a healthy session ends the Edge is most likely restarting: the next
   ``fast_retries`` attempts keep the ceiling at ``base_s`` before rule 1's growth
   resumes, so a Node is back within about a second of its Edge instead of sleeping
   through the exponential steps the restart's downtime would otherwise have grown.
5. A *permanent* rejection (the Edge saw us and refused: bad token, unknown node id,
   protocol version, or another Node with our id took over the session) cannot fix
   itself quickly. It waits ``uniform(reject_delay_s / 2, reject_delay_s)``, and after
   ``max_rejections`` of them with no healthy session in between the answer is None:
   give up, so an operator hears about a wrong token or a duplicate node id from an exit
   code instead of a log that grows forever. A session that ended healthy resets the
   count, and so does a rejected session that had served ``forget_rejections_after_s``
   (two Nodes sharing an id knock each other off within seconds; a Node replaced once a
   week is not fighting anyone).
6. An Edge that says it goes away (`goaway`: it restarts or stops) is about to be
   back, or its successor already is: the failure count resets and the fast retries of
   rule 4 are armed at once, as after a healthy session, however short the one it ends.
7. Nothing else affects the delay; short of rule 5, a Node reconnects forever.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """The knobs of the rules above; tests inject tiny values to reconnect fast."""

    base_s: float = 0.5
    factor: float = 2.0
    cap_s: float = 30.0
    stable_after_s: float = 2.0
    fast_retries: int = 10
    reject_delay_s: float = 5.0
    max_rejections: int = 3
    forget_rejections_after_s: float = 600.0

    def __post_init__(self) -> None:
        if not (self.base_s > 0 and self.cap_s >= self.base_s and self.factor >= 1):
            raise ValueError(f"invalid backoff policy: {self!r}")
        if self.stable_after_s < 0 or self.fast_retries < 0:
            raise ValueError(f"invalid backoff policy: {self!r}")
        if self.reject_delay_s < 0 or self.max_rejections < 1:
            raise ValueError(f"invalid backoff policy: {self!r}")


@dataclass(frozen=True, slots=True)
class BackoffStatistics:
    """A backoff's state (for tests and diagnostics)."""

    failures: int
    """Consecutive failures since the last reset (rule 1's ``n``)."""


class Backoff:
    """Counts consecutive failures and turns them into jittered delays (module rules)."""

    def __init__(self, policy: BackoffPolicy | None = None, rng: random.Random | None = None):
        self.policy = policy or BackoffPolicy()
        self._rng = rng or random.Random()
        self._failures = 0
        self._fast_left = 0
        self._rejections = 0

    def statistics(self) -> BackoffStatistics:
        return BackoffStatistics(failures=self._failures)

    @property
    def rejections(self) -> int:
        """Permanent rejections since the last healthy session (rule 5)."""
        return self._rejections

    def ceiling(self) -> float:
        """The upper bound of the next delay after a plain failure (rules 1 and 4)."""
        policy = self.policy
        if self._fast_left > 0:
            return policy.base_s
        # Past the steps to the cap the cap always wins; checking first avoids overflow.
        if self._failures >= self._steps_to_cap():
            return policy.cap_s
        return min(policy.cap_s, policy.base_s * policy.factor**self._failures)

    def after_failure(self) -> float:
        """An attempt failed: return the delay before the next one (rules 1, 2 and 4)."""
        delay = self._rng.uniform(0.0, self.ceiling())
        if self._fast_left > 0:
            self._fast_left -= 1
        else:
            self._failures += 1
        return delay

    def after_session(self, uptime_s: float) -> float:
        """A welcomed session ended after `uptime_s` (rules 3 and 4)."""
        if uptime_s >= self.policy.stable_after_s:
            self.reset()
            self._fast_left = self.policy.fast_retries
        return self.after_failure()

    def after_goaway(self) -> None:
        """The Edge said it goes away (rule 6): the next attempts are fast ones."""
        self.reset()
        self._fast_left = self.policy.fast_retries

    def after_reject(self, uptime_s: float = 0.0) -> float | None:
        """The Edge refused us for good (`uptime_s`: how long the session it ended had
        served, 0 for a refused handshake): the delay before trying again, or None once
        `max_rejections` permanent rejections came in a row (rule 5)."""
        policy = self.policy
        if uptime_s >= policy.forget_rejections_after_s:
            self._rejections = 0
        self._rejections += 1
        self._fast_left = 0
        if self._rejections >= policy.max_rejections:
            return None
        return self._rng.uniform(policy.reject_delay_s / 2, policy.reject_delay_s)

    def reset(self) -> None:
        self._failures = 0
        self._fast_left = 0
        self._rejections = 0

    def _steps_to_cap(self) -> float:
        """How many failures it takes for rule 1's ceiling to reach the cap."""
        policy = self.policy
        if policy.factor == 1:
            return math.inf if policy.cap_s > policy.base_s else 0.0
        return math.log(policy.cap_s / policy.base_s, policy.factor)
