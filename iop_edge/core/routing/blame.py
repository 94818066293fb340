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
4. An empty or malformed reply (`reply_fault`: a 200 stream with no event, output
   that is not JSON, tool-call arguments that are no JSON object) is `suspect`: a
   runtime may answer one request shape so (llama-cpp-python's function calling with
   `tool_choice: "auto"` streams an empty 200) while it serves every other request. It
   counts against the provider only when other requests to it fail too
   (`ReplyFaults`): the first request's failures count for nothing alone, however
   often it is retried; a second, different request failing too counts both, and each
   further one counts once. Any success of the provider forgets them. A runtime that
   answers everything with nothing still leaves the pool, after as many different
   requests as its cooldown needs failures.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from schemas import wire

__all__ = ["Attempts", "Next", "ReplyFaults", "Verdict", "verdict"]

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
    SUSPECT = "suspect"
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
    if failure.reply_fault:
        return Verdict.SUSPECT
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


#: How many distinct failed requests `ReplyFaults` remembers per provider: past that many,
#: the provider is failing everything and each new one counts.
MAX_REMEMBERED_REQUESTS: Final = 64


class ReplyFaults:
    """Per provider, the distinct requests whose replies were empty or malformed since
    it last succeeded (Rule 4). A request is known by a key its caller's body makes
    (the same body retried is the same request)."""

    def __init__(self) -> None:
        self._failed: dict[str, set[int]] = {}

    def failed(self, provider_id: str, request_key: int) -> int:
        """How many failures `provider_id` answering `request_key` with an empty or
        malformed reply adds toward its cooldown: 0 for a request already counted, or
        for the first request alone; 2 for the second (the first counts now too); 1 for
        each one after."""
        keys = self._failed.setdefault(provider_id, set())
        if request_key in keys:
            return 0
        if len(keys) >= MAX_REMEMBERED_REQUESTS:
            return 1
        keys.add(request_key)
        if len(keys) == 1:
            return 0
        return 2 if len(keys) == 2 else 1

    def succeeded(self, provider_id: str) -> None:
        """`provider_id` answered a request: what failed before was the requests'."""
        self._failed.pop(provider_id, None)
