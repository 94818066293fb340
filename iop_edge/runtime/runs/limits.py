"""Per-principal rate limits and daily budgets at admission (design §15).

`PrincipalLimiter.admit()` is asked once per request, before it queues: it answers with a
`Ticket` (the request is within every limit of its principal, and what it reserved is
charged) or raises `LimitExceeded` naming the limit, with the `Retry-After` and
`x-ratelimit-*` values the caller gets. `settle()` closes the ticket when the run ends,
with the tokens the run was metered for. The policy (buckets, shares, days) is the pure
`core.principals`; this module keeps the state it acts on.

    AdmissionError (scheduler)
    └── LimitExceeded       .limit, .code, .rate_limits             -> 429
          requests_per_minute  rate_limit_requests
          tokens_per_minute    rate_limit_tokens
          tokens_per_day       budget_exceeded

Rules:

1. A request is checked against every limit of its principal before it takes from any:
   a refused request costs nothing. Checked in the order budget, requests, tokens; the
   first one exceeded is the one named.
2. `requests_per_minute` charges 1 per admitted request, once however many providers it
   is tried on, and gives it back when the request ends in a server error (5xx) before
   the caller got any of a reply: a provider's or the gateway's failure, which the
   caller may retry, costs the caller nothing. `tokens_per_minute` charges an
   estimate at admission (the prompt's estimate plus the request's output bound, or
   `DEFAULT_OUTPUT_ESTIMATE` when it sets none) and settles to the metered usage when
   the run ends: the difference is given back or charged.
3. `tokens_per_day` counts the day's metered tokens: what the usage ledger held when the
   Edge last read it, plus this Edge's runs that ended since, plus what runs in flight
   reserved. A request is refused once that reaches the budget; its `Retry-After` is
   the time to 00:00 UTC. The ledger is read at start (before the Edge serves), at each
   new UTC day, and every `BUDGET_SYNC_S` while other replicas share it, so a restart
   does not reset a budget and replicas see each other's usage within that time.
4. A re-read may count a run that ended during it twice until the next read (never
   zero times): budgets err on the side of the pool.
5. A limit changed by a refresh applies to the next request; the state kept for it (a
   bucket's level, the day's count) is kept, so a refresh hands out no fresh minute.
6. Responses say where the caller stands (`RateLimits`, which the HTTP layer writes as
   the caller protocol's rate-limit headers) for the request and token limits that are
   set. The token figures describe `tokens_per_minute` when it is set, else the daily
   budget.
7. Replicas sharing a PostgreSQL ledger also reserve each request's estimate against one
   counter per principal per day in it (`shared_budgets`), after the checks above: a
   request is refused once what every replica's runs used and reserved that day reaches
   the budget. The counter is one row, updated atomically, so a burst spread over any
   number of replicas overshoots by at most the request that crossed the line, as one
   Edge alone does, never by a budget per replica. The run's usage settles its
   reservation when it ends. A refused reservation costs nothing (Rule 1); a ledger
   that does not answer leaves Rule 3's view alone in force.
8. A restart carries the per-minute buckets over: the old Edge hands its successor what
   each principal had used of them when its drain began (`windows`), and the successor
   charges that to its own (`carry_over`), so a restart hands out no fresh minute.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol

import trio

from iop_edge.core.principals import (
    Bucket,
    PrincipalPolicies,
    concurrency_share,
    minute_share,
    next_utc_day,
    utc_day_start,
)
from iop_edge.runtime.metering.usage_ledger.shared_budgets import SharedBudgets
from iop_edge.runtime.metering.usage_ledger.usage import UsageLedger
from iop_edge.runtime.runs.admission_errors import AdmissionError
from iop_edge.runtime.runs.observation import PrincipalLoad
from schemas.config import PrincipalLimits
from schemas.principals import PrincipalsReport, PrincipalStanding

__all__ = [
    "BUDGET_SYNC_S",
    "DEFAULT_OUTPUT_ESTIMATE",
    "NO_RATE_LIMITS",
    "LedgerTotals",
    "LimitExceeded",
    "PrincipalLimiter",
    "RateLimits",
    "Ticket",
    "UsageTotals",
    "output_bound",
]

log = logging.getLogger(__name__)

#: Output tokens reserved for a request that sets no bound of its own (Rule 2).
DEFAULT_OUTPUT_ESTIMATE: Final = 1024
#: The longest `Retry-After` a per-minute limit gives (a zero limit never admits: the
#: caller is told to come back in a minute, when the operator may have changed it).
MAX_RETRY_AFTER_S: Final = 60.0
#: How often the day's usage is read again while other replicas share the ledger (Rule 3).
BUDGET_SYNC_S: Final = 5.0
#: How long a read of the ledger waits for this Edge's own records to be written first.
FLUSH_WAIT_S: Final = 2.0

#: limit -> (error code, OpenAI error type)
_CODES: Final[dict[str, tuple[str, str]]] = {
    "requests_per_minute": ("rate_limit_requests", "rate_limit_error"),
    "tokens_per_minute": ("rate_limit_tokens", "rate_limit_error"),
    "tokens_per_day": ("budget_exceeded", "insufficient_quota"),
}


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Where a principal stands against its request and token limits (Rule 6)."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None

    def __bool__(self) -> bool:
        return self.limit_requests is not None or self.limit_tokens is not None


NO_RATE_LIMITS: Final = RateLimits()


class LimitExceeded(AdmissionError):
    """A request over one of its principal's limits (429, Rule 1)."""

    def __init__(
        self, reason: str, *, limit: str, retry_after_s: float, rate_limits: RateLimits
    ) -> None:
        super().__init__(reason, retry_after_s=retry_after_s)
        self.limit = limit
        self.code, self.type = _CODES[limit]
        self.rate_limits = rate_limits


@dataclass(slots=True)
class Ticket:
    """One admitted request's hold on its principal's limits, until `settle`."""

    principal: str
    reserved: int
    """Tokens charged to `tokens_per_minute` at admission (0 when it is not set)."""
    budget_reserved: int
    """Tokens counted against the day's budget while the run is in flight."""
    rate_limits: RateLimits
    settled: bool = False
    shared_day: int | None = None
    """The UTC day its `budget_reserved` is reserved for in the shared ledger (Rule 7)."""


def output_bound(fields: Sequence[str] | None, body: Mapping[str, Any]) -> int | None:
    """The output tokens a request allows itself (Rule 2): the first of `fields` (its
    protocol's, `http.protocols.caller_protocol.CallerProtocol.output_fields`) the body sets; 0 for
    one that generates nothing (`fields` None: embeddings, token counts), None when it
    sets no bound."""
    if fields is None:
        return 0
    for name in fields:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


class UsageTotals(Protocol):
    """What the limiter reads from the usage ledger (`UsageLedger`)."""

    async def day_totals(self, since: float) -> dict[str, int]:
        """Tokens (prompt + completion) metered per principal since `since`."""
        ...


class LedgerTotals:
    """`UsageTotals` from the Edge's usage ledger: this Edge's records written first (so
    none is missed), then one grouped query."""

    def __init__(self, ledger: UsageLedger) -> None:
        self._ledger = ledger

    async def day_totals(self, since: float) -> dict[str, int]:
        with trio.move_on_after(FLUSH_WAIT_S):
            await self._ledger.wait_flushed()
        report = await self._ledger.aggregate(since=since, until=None, group_by=["principal_ref"])
        return {
            row.principal_ref: row.prompt_tokens + row.completion_tokens
            for row in report.rows
            if row.principal_ref is not None
        }


class _State:
    """One principal's per-minute buckets and today's tokens."""

    __slots__ = ("rejected", "requests", "reserved", "tokens")

    def __init__(self) -> None:
        self.requests: Bucket | None = None
        self.tokens: Bucket | None = None
        self.reserved = 0
        """Tokens runs in flight reserved against the day's budget."""
        self.rejected: dict[str, int] = {}


class PrincipalLimiter:
    """Every principal's rate limits and budget (see the module rules).

    `policies` returns the running snapshot's limits (a refresh swaps them); `clock` runs
    the per-minute buckets (Trio's clock); `wall` is the Unix time budgets' days follow.
    """

    def __init__(
        self,
        policies: Callable[[], PrincipalPolicies],
        *,
        clock: Callable[[], float] = trio.current_time,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._policies = policies
        self._clock = clock
        self._wall = wall
        self._states: dict[str, _State] = {}
        self.replicas = 1
        """Live Edge replicas the per-minute limits are split between."""
        self._day = utc_day_start(wall())
        self._ledger_today: dict[str, int] = {}
        """Tokens per principal the ledger held for today when last read."""
        self._local_today: dict[str, int] = {}
        """Tokens of this Edge's runs that ended since the ledger was last read."""
        self.shared_budgets: SharedBudgets | None = None
        """Budgets reserved in a ledger replicas share (Rule 7); None: this Edge's view."""

    # --- admission ------------------------------------------------------------------

    def admit(self, principal: str, *, prompt_tokens: int, max_output: int | None) -> Ticket:
        """Admit one request of `principal` or raise `LimitExceeded` (Rules 1-3)."""
        limits = self._policies().of(principal)
        if (
            limits.requests_per_minute is None
            and limits.tokens_per_minute is None
            and limits.tokens_per_day is None
        ):
            return Ticket(principal, 0, 0, NO_RATE_LIMITS)
        now = self._clock()
        self._roll_day()
        state = self._states.get(principal)
        if state is None:
            state = self._states[principal] = _State()
        self._shape(state, limits, now)
        estimate = prompt_tokens + (DEFAULT_OUTPUT_ESTIMATE if max_output is None else max_output)
        refusal = self._refusal(principal, state, limits, estimate, now)
        if refusal is not None:
            state.rejected[refusal.limit] = state.rejected.get(refusal.limit, 0) + 1
            raise refusal
        reserved = 0
        if state.requests is not None:
            state.requests.take(1, now)
        if state.tokens is not None:
            reserved = math.ceil(state.tokens.cost(estimate))
            state.tokens.take(reserved, now)
        budget_reserved = estimate if limits.tokens_per_day is not None else 0
        state.reserved += budget_reserved
        return Ticket(
            principal, reserved, budget_reserved, self._standing(principal, state, limits, now)
        )

    def refused(self, principal: str, limit: str) -> None:
        """Count a refusal for `limit` that was decided elsewhere (`max_concurrent`, by the
        scheduler once the run's wait ended), as `admit` counts its own."""
        state = self._states.get(principal)
        if state is None:
            state = self._states[principal] = _State()
        state.rejected[limit] = state.rejected.get(limit, 0) + 1

    async def reserve_shared(self, ticket: Ticket) -> None:
        """Reserve `ticket`'s budget share in the shared ledger (Rule 7), or undo the
        ticket and raise `LimitExceeded` when the budget is spent across the replicas."""
        shared = self.shared_budgets
        if shared is None or not ticket.budget_reserved:
            return
        principal = ticket.principal
        budget = self._policies().of(principal).tokens_per_day
        if budget is None:
            return
        day = int(self._day)
        reserved = await shared.reserve(principal, day, ticket.budget_reserved, budget)
        if reserved is None:
            return  # the ledger does not answer: this Edge's view alone (Rule 3)
        if reserved:
            ticket.shared_day = day
            return
        state = self._states.get(principal) or _State()
        self._undo(ticket, state)
        state.rejected["tokens_per_day"] = state.rejected.get("tokens_per_day", 0) + 1
        limits = self._policies().of(principal)
        raise self._over_budget(principal, state, limits, self._clock(), spent=True)

    def _undo(self, ticket: Ticket, state: _State) -> None:
        """A ticket refused after all: what it took is given back (Rule 1)."""
        ticket.settled = True
        now = self._clock()
        state.reserved = max(0, state.reserved - ticket.budget_reserved)
        if state.requests is not None:
            state.requests.give_back(1, now)
        if state.tokens is not None and ticket.reserved:
            state.tokens.give_back(ticket.reserved, now)

    def _over_budget(
        self,
        principal: str,
        state: _State,
        limits: PrincipalLimits,
        now: float,
        *,
        spent: bool = False,
    ) -> LimitExceeded:
        wall = self._wall()
        standing = self._standing(principal, state, limits, now)
        if spent:  # the replicas together spent it: none left, whatever this Edge saw
            standing = replace(standing, remaining_tokens=0)
        return LimitExceeded(
            f"{principal!r} has used its budget of {limits.tokens_per_day} tokens "
            "for today (UTC); it renews at 00:00 UTC",
            limit="tokens_per_day",
            retry_after_s=next_utc_day(wall) - wall,
            rate_limits=standing,
        )

    def _refusal(
        self, principal: str, state: _State, limits: PrincipalLimits, estimate: int, now: float
    ) -> LimitExceeded | None:
        if limits.tokens_per_day is not None:
            used = self.tokens_today(principal) + state.reserved
            if used >= limits.tokens_per_day:
                return self._over_budget(principal, state, limits, now)
        if state.requests is not None:
            wait = state.requests.wait_for(1, now)
            if wait > 0:
                return LimitExceeded(
                    f"{principal!r} is over its limit of {limits.requests_per_minute} "
                    "requests per minute",
                    limit="requests_per_minute",
                    retry_after_s=min(wait, MAX_RETRY_AFTER_S),
                    rate_limits=self._standing(principal, state, limits, now),
                )
        if state.tokens is not None:
            wait = state.tokens.wait_for(estimate, now)
            if wait > 0:
                return LimitExceeded(
                    f"{principal!r} is over its limit of {limits.tokens_per_minute} tokens "
                    f"per minute (this request may use about {estimate})",
                    limit="tokens_per_minute",
                    retry_after_s=min(wait, MAX_RETRY_AFTER_S),
                    rate_limits=self._standing(principal, state, limits, now),
                )
        return None

    def settle(self, ticket: Ticket, used_tokens: int, *, refund_request: bool = False) -> None:
        """The ticket's run ended having used `used_tokens` (Rule 2); once only.
        `refund_request`: it failed upstream before the caller got anything, so its
        request is given back to `requests_per_minute`."""
        if ticket.settled:
            return
        ticket.settled = True
        principal = ticket.principal
        if used_tokens:
            self._local_today[principal] = self._local_today.get(principal, 0) + used_tokens
        if ticket.shared_day is not None and self.shared_budgets is not None:
            self.shared_budgets.settle(
                principal, ticket.shared_day, ticket.budget_reserved, used_tokens
            )
        state = self._states.get(principal)
        if state is None:
            return
        state.reserved = max(0, state.reserved - ticket.budget_reserved)
        now = self._clock()
        if refund_request and state.requests is not None:
            state.requests.give_back(1, now)
        if state.tokens is not None and ticket.reserved:
            difference = used_tokens - ticket.reserved
            if difference > 0:
                state.tokens.take(difference, now)
            else:
                state.tokens.give_back(-difference, now)

    def _shape(self, state: _State, limits: PrincipalLimits, now: float) -> None:
        """Fit the buckets to the limits and replica count in force now (Rule 5)."""
        state.requests = _fitted(state.requests, limits.requests_per_minute, self.replicas, now)
        state.tokens = _fitted(state.tokens, limits.tokens_per_minute, self.replicas, now)

    def _standing(
        self, principal: str, state: _State, limits: PrincipalLimits, now: float
    ) -> RateLimits:
        requests, tokens = state.requests, state.tokens
        limit_tokens = remaining_tokens = None
        reset_tokens = None
        if tokens is not None:
            limit_tokens = math.floor(tokens.capacity)
            remaining_tokens = max(0, math.floor(tokens.level_at(now)))
            reset_tokens = tokens.until_full(now)
        elif limits.tokens_per_day is not None:
            limit_tokens = limits.tokens_per_day
            used = self.tokens_today(principal) + state.reserved
            remaining_tokens = max(0, limits.tokens_per_day - used)
            wall = self._wall()
            reset_tokens = next_utc_day(wall) - wall
        return RateLimits(
            limit_requests=None if requests is None else math.floor(requests.capacity),
            remaining_requests=None
            if requests is None
            else max(0, math.floor(requests.level_at(now))),
            reset_requests_s=None if requests is None else requests.until_full(now),
            limit_tokens=limit_tokens,
            remaining_tokens=remaining_tokens,
            reset_tokens_s=reset_tokens,
        )

    # --- restarts -------------------------------------------------------------------

    def windows(self) -> dict[str, tuple[float, float]]:
        """Per principal, what its per-minute buckets have used now (requests, tokens):
        what a restarting Edge hands its successor (Rule 8)."""
        now = self._clock()
        used: dict[str, tuple[float, float]] = {}
        for principal, state in self._states.items():
            requests = _used(state.requests, now)
            tokens = _used(state.tokens, now)
            if requests > 0 or tokens > 0:
                used[principal] = (requests, tokens)
        return used

    def carry_over(self, windows: Mapping[str, tuple[float, float]]) -> None:
        """Charge what the Edge this one replaces had used of each principal's per-minute
        limits (Rule 8); the buckets refill from there as usual."""
        now = self._clock()
        for principal, (requests, tokens) in windows.items():
            limits = self._policies().of(principal)
            if limits.requests_per_minute is None and limits.tokens_per_minute is None:
                continue
            state = self._states.get(principal)
            if state is None:
                state = self._states[principal] = _State()
            self._shape(state, limits, now)
            if state.requests is not None and requests > 0:
                state.requests.take(requests, now)
            if state.tokens is not None and tokens > 0:
                state.tokens.take(tokens, now)

    # --- budgets --------------------------------------------------------------------

    def tokens_today(self, principal: str) -> int:
        """Tokens metered today for `principal` (Rule 3), runs in flight not included."""
        self._roll_day()
        return self._ledger_today.get(principal, 0) + self._local_today.get(principal, 0)

    def _roll_day(self) -> None:
        """A new UTC day began: yesterday's counts no longer apply (Rule 3)."""
        day = utc_day_start(self._wall())
        if day != self._day:
            self._day = day
            self._ledger_today = {}
            self._local_today = {}

    async def read_ledger(self, ledger: UsageTotals) -> None:
        """Read today's usage per principal from the ledger (Rules 3-4)."""
        self._roll_day()
        day = self._day
        counted = dict(self._local_today)
        totals = await ledger.day_totals(day)
        if day != self._day:
            return  # the day ended during the read: the next read is for the new one
        self._ledger_today = totals
        for principal, tokens in counted.items():
            left = self._local_today.get(principal, 0) - tokens
            if left > 0:
                self._local_today[principal] = left
            else:
                self._local_today.pop(principal, None)

    async def run(
        self,
        ledger: UsageTotals,
        *,
        shared: Callable[[], bool],
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Keep the day's usage current (Rule 3). Owned by the Edge's nursery; reads the
        ledger once before it reports started, so the Edge serves no request before it
        knows today's usage. A ledger it cannot read does not stop the Edge: it says so
        and tries again every `BUDGET_SYNC_S` (budgets meanwhile count this Edge's runs)."""
        read = await self._try_read(ledger)
        task_status.started()
        while True:
            wall = self._wall()
            wait = next_utc_day(wall) - wall
            if shared() or not read:
                wait = min(wait, BUDGET_SYNC_S)
            await trio.sleep(wait)
            read = await self._try_read(ledger)

    async def _try_read(self, ledger: UsageTotals) -> bool:
        try:
            await self.read_ledger(ledger)
        except Exception as exc:  # an unreachable ledger must not take the Edge down
            log.error(
                "principal budgets: cannot read today's usage from the ledger (%s); "
                "retrying in %gs",
                exc,
                BUDGET_SYNC_S,
            )
            return False
        return True

    # --- observation ----------------------------------------------------------------

    def report(
        self, load: dict[str, PrincipalLoad], principals: Iterable[str] = ()
    ) -> PrincipalsReport:
        """Each principal that has limits, traffic or usage today, against its limits."""
        self._roll_day()
        policies = self._policies()
        names = set(principals) | set(load) | set(self._states)
        names |= set(self._ledger_today) | set(self._local_today)
        names |= set(policies.named())
        now = self._clock()
        standings = [
            self._standing_record(principal, policies, load.get(principal), now)
            for principal in sorted(names)
        ]
        return PrincipalsReport(replicas=self.replicas, day_start=self._day, principals=standings)

    def _standing_record(
        self, principal: str, policies: PrincipalPolicies, load: PrincipalLoad | None, now: float
    ) -> PrincipalStanding:
        limits = policies.of(principal)
        state = self._states.get(principal) or _State()
        self._shape(state, limits, now)
        standing = self._standing(principal, state, limits, now)
        today = self.tokens_today(principal)
        budget = limits.tokens_per_day
        return PrincipalStanding(
            principal_ref=principal,
            limited_by=policies.entry_of(principal),
            models=limits.models,
            weight=limits.weight,
            in_flight=load.in_flight if load else 0,
            queued=load.queued if load else 0,
            max_concurrent=None
            if limits.max_concurrent is None
            else concurrency_share(limits.max_concurrent, self.replicas),
            requests_per_minute=limits.requests_per_minute,
            requests_remaining=standing.remaining_requests,
            tokens_per_minute=limits.tokens_per_minute,
            tokens_remaining=None if state.tokens is None else standing.remaining_tokens,
            tokens_per_day=budget,
            tokens_today=today,
            budget_remaining=None if budget is None else max(0, budget - today - state.reserved),
            rejected=dict(state.rejected),
        )


def _used(bucket: Bucket | None, now: float) -> float:
    """What `bucket` has used of its minute now (more than its capacity: a debt)."""
    return 0.0 if bucket is None else bucket.capacity - bucket.level_at(now)


def _fitted(bucket: Bucket | None, limit: int | None, replicas: int, now: float) -> Bucket | None:
    """`bucket` sized to this replica's share of `limit` (a new full one if there was
    none; None when the limit is not set)."""
    if limit is None:
        return None
    capacity = minute_share(limit, replicas)
    if bucket is None:
        return Bucket.full(capacity, now)
    if bucket.capacity != capacity:
        bucket.resize(capacity, now)
    return bucket
