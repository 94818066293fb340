"""Blame and retry: what a failed attempt says about its provider, and what the request
does next (design §4 item 10). Pure: the dispatcher (`runtime.runs.dispatch`) asks, acts on
the answer, and keeps the slots, sessions and metrics to itself.

Rules:
1. A failure is a `Verdict` on its provider (`verdict`): `capacity` (an upstream 429/503
   that says so: a load signal, never a health failure); `health` (the provider's fault
   at once: transport errors, timeouts, a broken stream, a bad chunk or response, a
   misconfigured provider); `pending` (an upstream 5xx error answer: llama.cpp answers a
   request it cannot parse with 500, so the fault is the provider's or the request's,
   decided by what happens next); `none` (the request's: an upstream 4xx refusal,
   `upstream_rejected`; or nobody's: the node was lost, the caller left, the run was
   cut).
2. After each failed attempt `Attempts.after` says what the request does: `requeue` (a
   `busy` answer: the provider is full after all, and the request waits for a slot
   again, at most `max_busy` times), `failover` (another provider, when the failure is
   retryable and failovers are left), or `give_up`.
3. A pending 5xx is settled by the request's fate: when a second provider fails it with
   the same status, the request is at fault (`Attempts.request_fault`), nobody is blamed
   and the caller gets the upstream's status and message; when an attempt succeeds, the
   providers that answered 5xx are blamed (`Attempts.blamed`); with no other provider to
   try it counts against nobody. So no caller can take a model offline for the others by
   sending it bad requests.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from schemas import wire

__all__ = ["Attempts", "Next", "Verdict", "verdict"]

#: Failure codes that are the provider's fault (Rule 1), an upstream 5xx aside (pending).
_HEALTH_FAILURES: Final = frozenset(
    {
        wire.FailureCode.UPSTREAM_UNREACHABLE,
        wire.FailureCode.UPSTREAM_TIMEOUT,
        wire.FailureCode.UPSTREAM_ERROR,
        wire.FailureCode.UPSTREAM_STREAM_ERROR,
        wire.FailureCode.UPSTREAM_MISCONFIGURED,
        wire.FailureCode.BAD_CHUNK,
        wire.FailureCode.BAD_RESPONSE,
    }
)


class Verdict(StrEnum):
    """What one failure says about its provider (Rule 1)."""

    CAPACITY = "capacity"
    HEALTH = "health"
    PENDING = "pending"
    NONE = "none"


class Next(StrEnum):
    """What a request does after a failed attempt (Rule 2)."""

    REQUEUE = "requeue"
    FAILOVER = "failover"
    GIVE_UP = "give_up"


def verdict(failure: wire.RunFailed) -> Verdict:
    """What `failure` says about the provider that failed (Rule 1)."""
    if failure.capacity:
        return Verdict.CAPACITY
    if failure.code not in _HEALTH_FAILURES:
        return Verdict.NONE
    if failure.code == wire.FailureCode.UPSTREAM_ERROR and (failure.status or 0) >= 500:
        return Verdict.PENDING
    return Verdict.HEALTH


class Attempts:
    """One request's failed attempts so far, and what they decide (Rules 2 and 3)."""

    def __init__(self, *, retries: int, max_busy: int) -> None:
        """`retries`: how many other providers the request may fail over to;
        `max_busy`: how many `busy` answers it may wait through."""
        self._retries = retries
        self._max_busy = max_busy
        self._busy = 0
        self._failovers = 0
        self._tried: set[str] = set()
        self._pending: list[tuple[str, int | None]] = []
        self.request_fault = False
        """Two providers failed the request with the same upstream 5xx (Rule 3)."""

    @property
    def tried(self) -> frozenset[str]:
        """The providers the request failed on (a `busy` answer aside): not asked again."""
        return frozenset(self._tried)

    def after(self, failure: wire.RunFailed, provider_id: str) -> Next:
        """What the request does after `provider_id` failed it with `failure` (Rule 2)."""
        if failure.code == wire.FailureCode.BUSY and self._busy < self._max_busy:
            self._busy += 1
            return Next.REQUEUE
        self._tried.add(provider_id)
        if verdict(failure) == Verdict.PENDING:
            if any(status == failure.status for _, status in self._pending):
                self.request_fault = True
                return Next.GIVE_UP
            self._pending.append((provider_id, failure.status))
        if not failure.retryable or self._failovers >= self._retries:
            return Next.GIVE_UP
        self._failovers += 1
        return Next.FAILOVER

    def blamed(self) -> list[str]:
        """Once an attempt succeeded: the providers whose 5xx answers were their own
        fault after all (Rule 3)."""
        return [provider_id for provider_id, _ in self._pending]
