"""Why a request was not admitted: the scheduler's refusals (design §4).

`Scheduler.acquire()` raises one of these when it cannot give a run a `Lease`; the HTTP
layer maps each to a status code, `reason` to the caller's error message,
`retry_after_s` to `Retry-After` and `code` to the error's code (which a trace's
`iop.not_admitted` names too). They live apart from the scheduler because the layers
above it (limits, dispatch, the HTTP errors) name them without needing the pool::

    AdmissionError        .reason (str), .retry_after_s (float | None)
    ├── UnknownModel      M is not a catalog model id               -> 404
    ├── NoProvider        no provider could serve M now; waiting
    │                     would not help (disconnected, disabled,
    │                     unavailable, cooling down, rate-limited,
    │                     all tried)                                -> 503
    ├── QueueFull         M's queue already holds max_queue waiters -> 429
    └── QueueTimeout      no slot within queue_timeout              -> 503
        ├── ConcurrencyLimited  ... while the principal was at its
        │                 `max_concurrent` (its own limit held it)  -> 429
        └── ModelLoading  ... while a runtime was loading M (the wait
                          was queue_timeout + its load_timeout_s)   -> 503
"""

from __future__ import annotations

#: Retry-After suggested when a model is merely busy (queue full, queue timeout).
RETRY_AFTER_BUSY_S = 1.0
#: Retry-After suggested when a model is still loading: loads take seconds to minutes.
RETRY_AFTER_LOADING_S = 10.0


class AdmissionError(Exception):
    """A request was not admitted; `reason` is safe to show the caller, `code` is the
    caller's error code for it."""

    code: str = "no_provider"

    def __init__(self, reason: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class UnknownModel(AdmissionError):
    """The model id is not in the catalog (ids are never executed implicitly)."""

    code = "model_not_found"


class NoProvider(AdmissionError):
    """No provider of the model could serve the request now, so it is not queued."""


class QueueFull(AdmissionError):
    """The model's queue already holds `max_queue` waiters."""

    code = "queue_full"


class QueueTimeout(AdmissionError):
    """The request waited `queue_timeout` without a slot coming free."""

    code = "queue_timeout"


class ModelLoading(QueueTimeout):
    """The request waited `queue_timeout` plus the provider's `load_timeout_s` because a
    runtime was loading its model (design §18.4), and no runtime has reported it loaded."""

    code = "model_loading"


class ConcurrencyLimited(QueueTimeout):
    """The request waited `queue_timeout` while its principal held its `max_concurrent`
    runs: its own limit kept it waiting, not the pool."""

    code = "concurrency_limit"
