"""Recent traffic, for the live pool page: requests and errors over the last minutes.

Prometheus (`GET /metrics`) has the totals for dashboards; a browser page wants a small
JSON answer to "how busy is it right now". `Activity` keeps counts per `bucket_s`
seconds for the last `buckets` buckets: constant memory, O(1) per request.

Rules:
1. Every finished inference request counts once, in the bucket of the time it finished
   (the access log's feed: runs and refused requests alike).
2. Status classes: `ok` (< 400), `rejected` (4xx: the caller's request, auth, a full
   queue, a caller who left) and `errors` (5xx: the gateway or its providers failed).
3. Buckets older than the window are dropped; empty buckets are reported as zeros, so
   the answer always has `buckets` entries, oldest first, ending with the current one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

import msgspec

__all__ = ["Activity", "ActivityBucket", "ActivityReport"]

BUCKET_S: Final = 10
BUCKETS: Final = 30


class ActivityBucket(msgspec.Struct, frozen=True, kw_only=True):
    start: float
    """Unix time the bucket starts at."""
    requests: int = 0
    ok: int = 0
    rejected: int = 0
    errors: int = 0


class ActivityReport(msgspec.Struct, frozen=True, kw_only=True):
    bucket_s: int
    now: float
    buckets: list[ActivityBucket]
    requests_per_s: float
    """Over the last minute (the last `60 / bucket_s` buckets, the current one partial)."""
    errors_last_minute: int
    rejected_last_minute: int


class Activity:
    """Counts finished requests per time bucket (see the module docstring)."""

    def __init__(
        self,
        *,
        bucket_s: int = BUCKET_S,
        buckets: int = BUCKETS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._bucket_s = bucket_s
        self._size = buckets
        self._clock = clock
        # bucket index (unix time // bucket_s) -> [requests, ok, rejected, errors]
        self._counts: dict[int, list[int]] = {}

    def record(self, status: int) -> None:
        index = int(self._clock() // self._bucket_s)
        counts = self._counts.get(index)
        if counts is None:
            counts = self._counts[index] = [0, 0, 0, 0]
            for old in [i for i in self._counts if i <= index - self._size]:
                del self._counts[old]
        counts[0] += 1
        counts[1 if status < 400 else 2 if status < 500 else 3] += 1

    def report(self) -> ActivityReport:
        now = self._clock()
        current = int(now // self._bucket_s)
        buckets = []
        for index in range(current - self._size + 1, current + 1):
            requests, ok, rejected, errors = self._counts.get(index, (0, 0, 0, 0))
            buckets.append(
                ActivityBucket(
                    start=float(index * self._bucket_s),
                    requests=requests,
                    ok=ok,
                    rejected=rejected,
                    errors=errors,
                )
            )
        minute = buckets[-max(1, 60 // self._bucket_s) :]
        elapsed = (len(minute) - 1) * self._bucket_s + (now - minute[-1].start)
        return ActivityReport(
            bucket_s=self._bucket_s,
            now=now,
            buckets=buckets,
            requests_per_s=round(sum(b.requests for b in minute) / max(elapsed, 1.0), 3),
            errors_last_minute=sum(b.errors for b in minute),
            rejected_last_minute=sum(b.rejected for b in minute),
        )
