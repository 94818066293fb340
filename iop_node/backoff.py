"""Reconnect backoff for the Node's link to the Edge: a pure state machine, no I/O.

The link reports what happened to each connection attempt; this module answers how long
to wait before the next one. It never sleeps and never reads a clock, so every rule below
is tested synchronously with a seeded `random.Random`.

Rules:

1. Every failed attempt (connect refused, handshake timeout, a session that died young)
   raises the *ceiling* of the next delay exponentially:
   ``ceiling(n) = min(cap_s, base_s * factor**n)`` where ``n`` counts the failures since
   the last reset (the first failure waits under ``base_s``).
2. The delay itself is drawn with *full jitter*: ``uniform(0, ceiling)``. Many Nodes
   losing the same Edge at once thus spread their reconnects instead of stampeding it
   the moment it comes back.
3. A session that stayed up at least ``stable_after_s`` proves the Edge is healthy
   again: the failure count resets, so a Node that loses a long-lived connection comes
   back quickly (``uniform(0, base_s)``).
4. A `reject` in the handshake means the Edge saw us and refused (bad token, unknown
   node id, protocol version): retrying soon cannot help and only floods the Edge's log.
   The failure count jumps to the cap and the delay is drawn from
   ``uniform(cap_s / 2, cap_s)``, so a rejected Node is never retried fast, yet still
   retries forever (an operator may fix the Edge config at any time).
5. Nothing else affects the delay; there is no give-up: a Node reconnects forever.
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
    stable_after_s: float = 10.0

    def __post_init__(self) -> None:
        if not (self.base_s > 0 and self.cap_s >= self.base_s and self.factor >= 1):
            raise ValueError(f"invalid backoff policy: {self!r}")
        if self.stable_after_s < 0:
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

    def statistics(self) -> BackoffStatistics:
        return BackoffStatistics(failures=self._failures)

    def ceiling(self) -> float:
        """The upper bound of the next delay after a plain failure (rule 1)."""
        policy = self.policy
        # Past the steps to the cap the cap always wins; checking first avoids overflow.
        if self._failures >= self._steps_to_cap():
            return policy.cap_s
        return min(policy.cap_s, policy.base_s * policy.factor**self._failures)

    def after_failure(self) -> float:
        """An attempt failed: return the delay before the next one (rules 1-2)."""
        delay = self._rng.uniform(0.0, self.ceiling())
        self._failures += 1
        return delay

    def after_session(self, uptime_s: float) -> float:
        """A connected session ended after `uptime_s`: reset if it was stable (rule 3)."""
        if uptime_s >= self.policy.stable_after_s:
            self.reset()
        return self.after_failure()

    def after_reject(self) -> float:
        """The Edge rejected the handshake: wait near the cap (rule 4)."""
        cap = self.policy.cap_s
        steps = self._steps_to_cap()
        if math.isfinite(steps):
            self._failures = max(self._failures, math.ceil(steps))
        return self._rng.uniform(cap / 2, cap)

    def reset(self) -> None:
        self._failures = 0

    def _steps_to_cap(self) -> float:
        """How many failures it takes for rule 1's ceiling to reach the cap."""
        policy = self.policy
        if policy.factor == 1:
            return math.inf if policy.cap_s > policy.base_s else 0.0
        return math.log(policy.cap_s / policy.base_s, policy.factor)
