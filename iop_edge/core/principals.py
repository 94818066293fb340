"""Who may use what of a shared pool (design §15): the pure policy behind `principals:`.

No I/O, no awaits, no clock of its own: every function takes the time it needs, so the
rules below are tested synchronously and the runtime (`runtime.runs.limits`, the
scheduler's fair queue) only keeps the state they act on.

Rules:

1. A principal's limits are its own `principals[]` entry, else the `"*"` entry, else
   none. `"*"` gives *each* principal it covers its own limits: two unlisted principals
   never share a budget.
2. `models` is an allow-list of glob patterns (`fnmatch`, case-sensitive, `*` crosses
   `/` and `:`). A model it does not match does not exist for the principal.
3. A per-minute limit is a token bucket holding at most a minute's allowance and filling
   at that rate: a burst of a minute's worth passes at once, then requests pass as fast
   as the bucket refills. `remaining` is what the bucket holds now, `reset` the time
   until it is full again (OpenAI's meaning of `x-ratelimit-reset-*`).
4. A bucket may go below zero: a run that used more tokens than its reservation leaves a
   debt that later requests wait out. A request that costs more than a full bucket is
   charged a full bucket at admission (it can pass once the bucket is full, never
   sooner) and settled from its real usage, so no request is refused forever.
5. A limit changed live keeps what was used of it (`Bucket.resize`).
6. Several Edges: a per-minute or concurrency limit is split evenly between the live
   replicas (each holds `limit / replicas`, a concurrency share at least 1); a daily
   budget is not split, as every replica reads the same ledger.
7. A day is a UTC day: a budget resets at 00:00 UTC.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from fnmatch import translate
from typing import Final

from schemas.config import EVERY_OTHER_PRINCIPAL, EdgeConfig, PrincipalLimits

__all__ = [
    "ANONYMOUS_PRINCIPAL",
    "NO_LIMITS",
    "SECONDS_PER_DAY",
    "Bucket",
    "PrincipalPolicies",
    "allows_model",
    "concurrency_share",
    "describe_limits",
    "format_reset",
    "minute_share",
    "next_utc_day",
    "utc_day_start",
]

#: Who a caller is when the Edge has no principal tokens configured (an open API).
ANONYMOUS_PRINCIPAL: Final = "anonymous"
#: The limits of a principal that no `principals[]` entry covers.
NO_LIMITS: Final = PrincipalLimits(ref=EVERY_OTHER_PRINCIPAL)
SECONDS_PER_DAY: Final = 86_400.0


class PrincipalPolicies:
    """Every principal's limits, as the running config sets them (Rule 1).

    Built once per config snapshot: 10,000 entries cost one dict."""

    __slots__ = ("_by_ref", "_default", "configured")

    def __init__(self, entries: list[PrincipalLimits]) -> None:
        self._by_ref = {entry.ref: entry for entry in entries}
        self._default = self._by_ref.pop(EVERY_OTHER_PRINCIPAL, NO_LIMITS)
        self.configured = bool(entries)
        """Whether any limit exists at all (lets the hot path skip everything)."""

    @classmethod
    def from_config(cls, config: EdgeConfig) -> PrincipalPolicies:
        return cls(config.principals)

    def of(self, principal_ref: str) -> PrincipalLimits:
        """The limits that apply to `principal_ref` (Rule 1)."""
        return self._by_ref.get(principal_ref, self._default)

    def named(self) -> dict[str, PrincipalLimits]:
        """The entries listed by name (not `"*"`)."""
        return dict(self._by_ref)

    def entry_of(self, principal_ref: str) -> str | None:
        """The `ref` of the entry whose limits apply (the name or `"*"`); None: no entry."""
        if principal_ref in self._by_ref:
            return principal_ref
        return None if self._default is NO_LIMITS else EVERY_OTHER_PRINCIPAL

    def allows(self, principal_ref: str, model_id: str) -> bool:
        """Whether `principal_ref` may use `model_id` (Rule 2)."""
        return allows_model(self.of(principal_ref), model_id)


def allows_model(limits: PrincipalLimits, model_id: str) -> bool:
    """Whether the allow-list of `limits` admits `model_id` (Rule 2)."""
    if limits.models is None:
        return True
    return _allow_list(tuple(limits.models)).match(model_id) is not None


@functools.lru_cache(maxsize=4096)
def _allow_list(patterns: tuple[str, ...]) -> re.Pattern[str]:
    """One compiled alternation per distinct allow-list (configs repeat them a lot)."""
    return re.compile("|".join(f"(?:{translate(pattern)})" for pattern in patterns))


def describe_limits(limits: PrincipalLimits) -> str:
    """One line an operator reads: `models m-*, max_concurrent 4, 60 requests/min`."""
    parts = []
    if limits.models is not None:
        parts.append("models " + ", ".join(limits.models))
    if limits.max_concurrent is not None:
        parts.append(f"max_concurrent {limits.max_concurrent}")
    if limits.requests_per_minute is not None:
        parts.append(f"{limits.requests_per_minute} requests/min")
    if limits.tokens_per_minute is not None:
        parts.append(f"{limits.tokens_per_minute} tokens/min")
    if limits.tokens_per_day is not None:
        parts.append(f"{limits.tokens_per_day} tokens/day (UTC)")
    if limits.weight != 1:
        parts.append(f"weight {limits.weight:g}")
    return ", ".join(parts) or "no limits"


def minute_share(limit: int, replicas: int) -> float:
    """This replica's share of a per-minute limit (Rule 6)."""
    return limit / max(1, replicas)


def concurrency_share(limit: int, replicas: int) -> int:
    """This replica's share of a concurrency limit (Rule 6): at least one run each."""
    return max(1, limit // max(1, replicas))


@dataclass(slots=True)
class Bucket:
    """A token bucket (Rule 3): `capacity` units, refilled at `capacity` per minute.

    `level` is what it held at `stamp`; `level_at` brings it forward. Changing the
    capacity (a refresh, a replica joining or leaving) keeps what was *used*: a limit
    raised from 10 to 20 after 8 requests leaves 12, lowered to 5 it leaves a debt of
    3. A live change never hands out a fresh minute, nor forgets one."""

    capacity: float
    level: float
    stamp: float

    @classmethod
    def full(cls, capacity: float, now: float) -> Bucket:
        return cls(capacity=capacity, level=capacity, stamp=now)

    @property
    def rate(self) -> float:
        """Units per second."""
        return self.capacity / 60.0

    def level_at(self, now: float) -> float:
        elapsed = max(0.0, now - self.stamp)
        return min(self.capacity, self.level + elapsed * self.rate)

    def advance(self, now: float) -> None:
        self.level = self.level_at(now)
        self.stamp = max(self.stamp, now)

    def resize(self, capacity: float, now: float) -> None:
        self.advance(now)
        self.level += capacity - self.capacity
        self.capacity = capacity

    def cost(self, amount: float) -> float:
        """What admitting `amount` takes from the bucket (Rule 4: at most a full one)."""
        return min(amount, self.capacity)

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds `cost(amount)`; 0 when it does now, infinite
        for a zero limit (nothing ever passes)."""
        if self.capacity <= 0:
            return math.inf
        missing = self.cost(amount) - self.level_at(now)
        if missing <= 0:
            return 0.0
        return math.inf if self.rate <= 0 else missing / self.rate

    def take(self, amount: float, now: float) -> None:
        """Charge `amount` (after `wait_for` said 0, or to settle: may go negative)."""
        self.advance(now)
        self.level -= amount

    def give_back(self, amount: float, now: float) -> None:
        """Refund part of a reservation that was not used (never above full)."""
        self.advance(now)
        self.level = min(self.capacity, self.level + amount)

    def until_full(self, now: float) -> float:
        level = self.level_at(now)
        if level >= self.capacity:
            return 0.0
        return math.inf if self.rate <= 0 else (self.capacity - level) / self.rate


def utc_day_start(wall: float) -> float:
    """The Unix time of 00:00 UTC of the day `wall` falls in (Rule 7)."""
    return wall - wall % SECONDS_PER_DAY


def next_utc_day(wall: float) -> float:
    """The Unix time of the next 00:00 UTC after `wall`."""
    return utc_day_start(wall) + SECONDS_PER_DAY


def format_reset(seconds: float) -> str:
    """A duration as OpenAI writes `x-ratelimit-reset-*`: `0s`, `250ms`, `6.5s`, `1m30s`,
    `2h0m0s` (Go's duration notation)."""
    if not math.isfinite(seconds):
        seconds = SECONDS_PER_DAY
    seconds = max(0.0, seconds)
    if seconds == 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    whole_minutes, rest = divmod(seconds, 60.0)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    if whole_minutes < 1:
        return rest_text
    hours, minutes = divmod(int(whole_minutes), 60)
    if hours:
        return f"{hours}h{minutes}m{rest_text}"
    return f"{minutes}m{rest_text}"
