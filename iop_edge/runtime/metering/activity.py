"""Recent traffic, for the live pool page: requests and errors over the last minutes, and
per model its time to first token, output tokens per second and queue depth.

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
4. Per model (`run_finished`): a successful stream's time to first token goes into a
   log-scale histogram of its bucket (`TTFT_BINS` bins, each `TTFT_GROWTH` times the
   last, from `TTFT_MIN_S`), which gives p50 and p95 within half a bin (about 6 %);
   output tokens add up per bucket, reported per second. A bucket holds at most one
   histogram per model: memory stays constant whatever the traffic.
5. Queue depth per model is sampled from the scheduler at most once a second, whenever a
   request finishes or the page asks; each bucket keeps the deepest queue it saw. So a
   queue that builds while nothing finishes still shows as soon as the page looks.
6. A model with nothing in the window is dropped (a model removed by a refresh ages out).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Final

import msgspec

from iop_edge.runtime.metering.metering import RunRecord

__all__ = ["Activity", "ActivityBucket", "ActivityReport", "ModelActivity"]

BUCKET_S: Final = 10
BUCKETS: Final = 30
TTFT_MIN_S: Final = 0.001
TTFT_GROWTH: Final = 1.12
#: 1 ms to ~2 minutes; a slower first token lands in the last bin.
TTFT_BINS: Final = 104
_LOG_GROWTH: Final = math.log(TTFT_GROWTH)
#: How often queue depth is sampled at most (Rule 5).
QUEUE_SAMPLE_S: Final = 1.0


class ActivityBucket(msgspec.Struct, frozen=True, kw_only=True):
    start: float
    """Unix time the bucket starts at."""
    requests: int = 0
    ok: int = 0
    rejected: int = 0
    errors: int = 0


class ModelActivity(msgspec.Struct, frozen=True, kw_only=True):
    """One model over the window: one value per bucket, oldest first (as `buckets`)."""

    model: str
    ttft_p50_s: list[float | None]
    """Median time to first token of the bucket's successful streams (None: none)."""
    ttft_p95_s: list[float | None]
    tokens_per_s: list[float]
    """Output tokens of the runs that ended in the bucket, per second."""
    tokens_per_s_last_minute: float
    """Over the last minute (as `ActivityReport.requests_per_s`)."""
    queue_depth: list[int]
    """The deepest queue sampled in the bucket."""
    streams: list[int]
    """Successful streams timed in the bucket (how much the percentiles rest on)."""


class ActivityReport(msgspec.Struct, frozen=True, kw_only=True):
    bucket_s: int
    now: float
    buckets: list[ActivityBucket]
    requests_per_s: float
    """Over the last minute (the last `60 / bucket_s` buckets, the current one partial)."""
    errors_last_minute: int
    rejected_last_minute: int
    models: list[ModelActivity] = []
    """Per model seen in the window, sorted by id."""


class _ModelBucket:
    __slots__ = ("queue", "tokens", "ttft")

    def __init__(self) -> None:
        self.ttft: dict[int, int] = {}
        """Log-scale bin -> successful streams whose first token came in it (Rule 4)."""
        self.tokens = 0
        self.queue = 0


def _ttft_bin(seconds: float) -> int:
    if seconds <= TTFT_MIN_S:
        return 0
    return min(int(math.log(seconds / TTFT_MIN_S) / _LOG_GROWTH) + 1, TTFT_BINS - 1)


def _bin_value(index: int) -> float:
    """The geometric middle of a bin: its value within a factor of sqrt(growth)."""
    if index == 0:
        return TTFT_MIN_S
    return TTFT_MIN_S * math.pow(TTFT_GROWTH, index - 0.5)


def _percentile(bins: Mapping[int, int], total: int, fraction: float) -> float | None:
    if total == 0:
        return None
    rank = max(1, math.ceil(fraction * total))
    seen = 0
    for index in sorted(bins):
        seen += bins[index]
        if seen >= rank:
            return round(_bin_value(index), 4)
    return None  # unreachable: the bins add up to `total`


class Activity:
    """Counts finished requests per time bucket (see the module docstring)."""

    def __init__(
        self,
        *,
        bucket_s: int = BUCKET_S,
        buckets: int = BUCKETS,
        clock: Callable[[], float] = time.time,
        queue_depth: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """`queue_depth`: each model's waiting requests now (Rule 5)."""
        self._bucket_s = bucket_s
        self._size = buckets
        self._clock = clock
        # bucket index (unix time // bucket_s) -> [requests, ok, rejected, errors]
        self._counts: dict[int, list[int]] = {}
        # model -> bucket index -> its per-model bucket (Rule 4)
        self._models: dict[str, dict[int, _ModelBucket]] = {}
        self._queue_depth = queue_depth
        self._sampled_at = -math.inf

    def record(self, status: int, *, at: float | None = None) -> None:
        """A request ended with `status` (at the wall time `at`, default now)."""
        self._count(status, at)

    def run_finished(self, record: RunRecord, *, at: float | None = None) -> None:
        """A run ended (at the wall time `at`, default now): counted as any request
        (`record`), and in its model's series."""
        index = self._count(record.status, at)
        usage = record.usage
        timed = record.stream and record.status < 400 and record.ttft_s is not None
        if not timed and (usage is None or usage.completion_tokens == 0):
            return
        bucket = self._model_bucket(record.model, index)
        if usage is not None:
            bucket.tokens += usage.completion_tokens
        if timed:
            assert record.ttft_s is not None
            ttft_bin = _ttft_bin(record.ttft_s)
            bucket.ttft[ttft_bin] = bucket.ttft.get(ttft_bin, 0) + 1

    def _count(self, status: int, at: float | None = None) -> int:
        """Count one request finished at `at` (default now; Rules 1-2); returns the index
        of its bucket."""
        now = self._clock() if at is None else at
        index = int(now // self._bucket_s)
        counts = self._counts.get(index)
        if counts is None:
            counts = self._counts[index] = [0, 0, 0, 0]
            self._expire(index)
        counts[0] += 1
        counts[1 if status < 400 else 2 if status < 500 else 3] += 1
        if now - self._sampled_at >= QUEUE_SAMPLE_S:
            self._sample_queues(now)
        return index

    def report(self) -> ActivityReport:
        now = self._clock()
        current = int(now // self._bucket_s)
        self._expire(current)
        if now - self._sampled_at >= QUEUE_SAMPLE_S:
            self._sample_queues(now)
        indexes = range(current - self._size + 1, current + 1)
        buckets = []
        for index in indexes:
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
            models=[
                self._model_report(model, self._models[model], indexes, now)
                for model in sorted(self._models)
            ],
        )

    # --- per model --------------------------------------------------------------------

    def _model_bucket(self, model: str, index: int) -> _ModelBucket:
        series = self._models.get(model)
        if series is None:
            series = self._models[model] = {}
        bucket = series.get(index)
        if bucket is None:
            bucket = series[index] = _ModelBucket()
        return bucket

    def _sample_queues(self, now: float) -> None:
        """Rule 5: keep the deepest queue each model had in this bucket."""
        self._sampled_at = now
        if self._queue_depth is None:
            return
        index = int(now // self._bucket_s)
        for model, depth in self._queue_depth().items():
            if depth > 0 or model in self._models:
                bucket = self._model_bucket(model, index)
                bucket.queue = max(bucket.queue, depth)

    def _model_report(
        self, model: str, series: dict[int, _ModelBucket], indexes: range, now: float
    ) -> ModelActivity:
        p50: list[float | None] = []
        p95: list[float | None] = []
        tokens: list[float] = []
        queue: list[int] = []
        streams: list[int] = []
        current = indexes[-1]
        minute = indexes[-max(1, 60 // self._bucket_s) :]
        minute_tokens = sum(series[i].tokens for i in minute if i in series)
        minute_s = (len(minute) - 1) * self._bucket_s + (now - current * self._bucket_s)
        for index in indexes:
            bucket = series.get(index)
            if bucket is None:
                p50.append(None)
                p95.append(None)
                tokens.append(0.0)
                queue.append(0)
                streams.append(0)
                continue
            timed = sum(bucket.ttft.values())
            p50.append(_percentile(bucket.ttft, timed, 0.50))
            p95.append(_percentile(bucket.ttft, timed, 0.95))
            # The current bucket is partial: its rate is over the seconds it has had.
            span = self._bucket_s if index < current else max(now - index * self._bucket_s, 1.0)
            tokens.append(round(bucket.tokens / span, 2))
            queue.append(bucket.queue)
            streams.append(timed)
        return ModelActivity(
            model=model,
            ttft_p50_s=p50,
            ttft_p95_s=p95,
            tokens_per_s=tokens,
            tokens_per_s_last_minute=round(minute_tokens / max(minute_s, 1.0), 2),
            queue_depth=queue,
            streams=streams,
        )

    def _expire(self, current: int) -> None:
        """Rules 3 and 6: drop what left the window."""
        oldest = current - self._size + 1
        for old in [i for i in self._counts if i < oldest]:
            del self._counts[old]
        for model in list(self._models):
            series = self._models[model]
            for old in [i for i in series if i < oldest]:
                del series[old]
            if not series:
                del self._models[model]
