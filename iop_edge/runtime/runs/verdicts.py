"""What each run's end says about its provider, recorded with the scheduler (design §4
items 9-10; the rules are `core.routing.blame`'s).

The dispatcher hands every terminal event here: a success, or a failure with the
caller's body it failed. A capacity signal and a provider's own failure go to the
scheduler at once; a pending 5xx waits for the request's fate (`Attempts`); an empty or
malformed reply counts only once other requests to the provider fail too
(`ReplyFaults`, blame Rule 4), so one caller's request shape, however often retried,
never cools a provider down for everyone.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from iop_edge.core.routing.blame import ReplyFaults, Verdict, verdict
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas import wire

__all__ = ["ProviderVerdicts"]

_encode: Final = msgspec.json.Encoder().encode


class ProviderVerdicts:
    """The providers' verdicts of one dispatcher (module docstring)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._reply_faults = ReplyFaults()

    def failure(self, provider_id: str, failure: wire.RunFailed, request: dict[str, Any]) -> None:
        """`provider_id` failed the request whose body (as sent) is `request`."""
        match verdict(failure):
            case Verdict.CAPACITY:
                self._scheduler.record_capacity_signal(provider_id, failure.retry_after_s)
            case Verdict.HEALTH:
                self._scheduler.record_failure(provider_id)
            case Verdict.SUSPECT:
                key = hash(_encode(request))  # the same body retried: the same request
                for _ in range(self._reply_faults.failed(provider_id, key)):
                    self._scheduler.record_failure(provider_id)
            case Verdict.PENDING | Verdict.NONE:
                pass

    def success(self, provider_id: str) -> None:
        """`provider_id` answered a request."""
        self._reply_faults.succeeded(provider_id)
        self._scheduler.record_success(provider_id)
