"""What a run is asked (`RunPlan`) and how it ended (`Outcome`, `RunFailure`): the records
the HTTP layer and the dispatcher (`dispatch`) pass between them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Final

from iop_edge.core.routing.affinity import Affinity
from iop_edge.runtime.metering.tracing import RequestTrace
from schemas import wire
from schemas.hosted_tools import HostedTools
from schemas.protocols import CallerProtocol

__all__ = [
    "CALLER_GONE",
    "INTERNAL_ERROR",
    "SHUTTING_DOWN",
    "Outcome",
    "RunFailure",
    "RunPlan",
    "RunTimings",
    "run_failed",
]


@dataclass(slots=True)
class RunPlan:
    """A validated caller request, ready to dispatch."""

    run_id: str
    model_id: str
    operation: wire.Operation
    body: dict[str, Any]
    stream: bool
    long: bool
    caller_wants_usage: bool
    prompt_tokens: int = 0
    """The request's input tokens by the Edge's estimator (`schemas.tokens`)."""
    principal_ref: str = "anonymous"
    token_ref: str = "anonymous"
    principal_alias: str | None = None
    received_at: float = field(default_factory=time.perf_counter)
    request_id: str = ""
    """The `x-request-id` the caller sees; "" means the run id."""
    protocol: CallerProtocol = "chat"
    """The caller's protocol's name (design §14): providers that speak it natively rank
    first."""
    max_output: int | None = None
    """The output tokens the request allows itself (`limits.output_bound`, by its
    protocol's fields); None: it sets no bound."""
    caller_headers: dict[str, str] = field(default_factory=dict)
    """Protocol headers a native upstream must see as the caller sent them."""
    affinity: Affinity | None = None
    """Where the run would rather go: its session, chain or prompt (`core.routing.affinity`)."""
    keep_output: bool = False
    """The Edge stores the run's result: the Node returns the final response object in
    `run_done.response`, a stream's too."""
    hosted_tools: HostedTools = "drop"
    """The model's `generation.hosted_tools`: what a translated run does with tools only
    a vendor's service runs."""
    previous_response_id: str = ""
    """The stored Responses conversation the run continues (`wire.Run`)."""
    trace: RequestTrace | None = None
    """The request's span when the Edge traces (`metering.tracing`): the run adds its
    admission, failed attempts and failovers, and its record when it ends."""
    traceparent: str = ""
    tracestate: str = ""
    """The W3C trace context the Node continues (`run.traceparent`): the request's span
    when traced, else the caller's own context as it came."""


@dataclass(slots=True)
class RunTimings:
    queued_s: float = 0.0
    """Seconds spent waiting for slots (all attempts)."""
    upstream_s: float = 0.0
    """Seconds from sending each attempt to its first event (all attempts, Rule 1)."""
    first_event_at: float | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """How the caller's exchange ended: the status it was answered with and why."""

    status: int
    code: str | None = None


#: The caller left before the run ended (nginx's 499 "client closed request").
CALLER_GONE: Final = Outcome(499, "client_closed")
#: A bug of the Edge's ended the exchange.
INTERNAL_ERROR: Final = Outcome(500, "internal_error")
#: The Edge stopped before the run ended (Rule 7).
SHUTTING_DOWN: Final = Outcome(503, str(wire.FailureCode.SHUTTING_DOWN))


class RunFailure(Exception):
    """Every allowed attempt failed before the first byte; `failure` is the last reason.

    `request_fault`: two providers failed the request with the same upstream 5xx, so the
    request itself is at fault (Rule 3)."""

    def __init__(
        self, failure: wire.RunFailed, provider_id: str, *, request_fault: bool = False
    ) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.provider_id = provider_id
        self.request_fault = request_fault


def run_failed(
    run_id: str, code: wire.FailureCode, message: str, *, retryable: bool = False
) -> wire.RunFailed:
    """A run's failure as the Edge words it itself."""
    return wire.RunFailed(run_id=run_id, code=code, message=message, retryable=retryable)
