"""Errors the caller surface answers with, as one exception type carrying its HTTP shape.

Handlers raise `ApiError`; the reply writes it in the caller's protocol (its
`CallerProtocol.error_body`: OpenAI's body, or Anthropic's for Messages) with the
right status and headers, so every failure a caller sees has the shape its client expects.
The runtime reports refusals and failures in its own terms; `admission_error` and
`run_failure_error` are where those become HTTP statuses.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Final

import msgspec

from iop_edge.core.caller_text import (
    upstream_identifier,
    with_request_id,
    without_credentials,
    without_topology,
)
from iop_edge.runtime.runs.admission_errors import (
    RETRY_AFTER_BUSY_S,
    AdmissionError,
    ConcurrencyLimited,
    QueueFull,
    QueueTimeout,
    UnknownModel,
)
from iop_edge.runtime.runs.limits import LimitExceeded, RateLimits
from iop_edge.runtime.runs.provider_state import MAX_REST_S
from schemas import wire
from schemas.protocols import anthropic_error_body, openai_error_body

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        allow: str | None = None,
        rate_limits: RateLimits | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.allow = allow
        self.close_connection = False
        """Answered before the request's body was read: the connection cannot carry another
        request, so the reply says `Connection: close` (else a client that reuses it races
        the server's close and sees "server disconnected")."""
        """For a 405: the methods the path does accept (the `Allow` header)."""
        self.rate_limits = rate_limits
        """For a request over a principal's limit: where it stands (the reply writes them
        as the caller's protocol's rate-limit headers)."""

    def body(self) -> bytes:
        """The error in OpenAI's shape (chat completions', Responses')."""
        return openai_error_body(self.message, type=self.type, code=self.code, param=self.param)

    def anthropic_body(self, request_id: str | None = None) -> bytes:
        """The error in Anthropic's shape (Messages'); `request_id`: the caller's request,
        which it names."""
        return anthropic_error_body(
            self.status, self.message, code=self.code, request_id=request_id
        )

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.retry_after_s is not None:
            # Rounded up: a client that waits as told is not refused again.
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.allow is not None:
            headers["Allow"] = self.allow
        if self.close_connection:
            headers["Connection"] = "close"
        return headers


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def invalid_request(error: msgspec.ValidationError) -> ApiError:
    """A body that does not fit the view of it the Edge reads: 400 naming the field in
    `param` (a wrong field's path, or a missing one's)."""
    text = str(error)
    return bad_request(f"Invalid request: {text}", param=decoder_param(text))


def decoder_param(text: str) -> str | None:
    """The field a msgspec error names (`... - at `$.input[0].type``, or a missing
    field), as a `param`: `input[0].type`; None when it names none."""
    at = re.search(r"at `\$\.?([^`]*)`", text)
    missing = re.search(r"missing required field `([^`]*)`", text)
    param = (at.group(1) or None) if at else None
    if missing is not None:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    return param


#: How much of a caller's own value an error message repeats.
MAX_ECHOED_CHARS: Final = 256


def echoed(value: str) -> str:
    """A caller's value as an error message repeats it: cut after `MAX_ECHOED_CHARS` (a
    model name of megabytes must not make an error body of megabytes)."""
    return value if len(value) <= MAX_ECHOED_CHARS else f"{value[:MAX_ECHOED_CHARS]}..."


def method_not_allowed(method: str, path: str, allow: str | None) -> ApiError:
    return ApiError(
        405, f"Method {method} not allowed on {path}", code="method_not_allowed", allow=allow
    )


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model '{echoed(model)}' does not exist",
        type="not_found_error",
        code="model_not_found",
        param="model",
    )


#: How long a caller refused for an unwritable usage ledger is asked to wait.
RETRY_AFTER_METERING_S = 5.0


def metering_unavailable(reason: str) -> ApiError:
    """A run refused because its usage could not be recorded (`Metering.refusal`)."""
    return ApiError(
        503,
        f"The IOP Edge cannot meter new runs now: {reason}",
        type="service_unavailable_error",
        code="metering_unavailable",
        retry_after_s=RETRY_AFTER_METERING_S,
    )


#: Refusals that ask the caller to come back later (`Retry-After`, 1 s unless the refusal
#: says): the status, error type and code each is answered with.
#: The status and error type of a refusal that may succeed later, by its kind (its
#: `code` is its own); any other is `NoProvider`'s.
_COME_BACK_LATER: Final[tuple[tuple[type[AdmissionError], tuple[int, str]], ...]] = (
    (ConcurrencyLimited, (429, "rate_limit_error")),
    (QueueFull, (429, "rate_limit_error")),
    (QueueTimeout, (503, "service_unavailable_error")),
)
#: Any other refusal: no provider can take the run now.
_NO_PROVIDER: Final = (503, "service_unavailable_error")


def admission_error(exc: AdmissionError, *, request_id: str = "") -> ApiError:
    """The scheduler's and the rate limiter's refusals as HTTP errors; a 503 ends with the
    request id (`core.caller_text` Rule 3)."""
    if isinstance(exc, LimitExceeded):
        return ApiError(
            429,
            exc.reason,
            type=exc.type,
            code=exc.code,
            retry_after_s=exc.retry_after_s,
            rate_limits=exc.rate_limits,
        )
    if isinstance(exc, UnknownModel):
        return ApiError(
            404, exc.reason, type="not_found_error", code="model_not_found", param="model"
        )
    status, type_ = next(
        (answer for kind, answer in _COME_BACK_LATER if isinstance(exc, kind)), _NO_PROVIDER
    )
    message = with_request_id(exc.reason, request_id) if status == 503 else exc.reason
    return ApiError(
        status, message, type=type_, code=exc.code, retry_after_s=exc.retry_after_s or 1.0
    )


#: Failures that are the request's, not the provider's: with a 4xx status from the
#: upstream (or the adapter standing in for one) the caller gets that status and message.
_REQUEST_FAILURES = frozenset(
    {
        wire.FailureCode.UPSTREAM_REJECTED,
        wire.FailureCode.INVALID_REQUEST,
        wire.FailureCode.UNSUPPORTED_OPERATION,
    }
)


def run_failure_error(
    failure: wire.RunFailed, provider_id: str, *, request_id: str, request_fault: bool = False
) -> ApiError:
    """What the caller gets for a run that failed on `provider_id` (design §4 item 10, §8).

    - The upstream refused the request (a 4xx other than 401/403/404/408/429, which the
      Node reports as the provider's problem): its status, message, error code and the
      field it named (`context_length_exceeded`, `messages`), as calling the upstream
      directly would give; `upstream_rejected` when it gave no code.
    - `request_fault`: two providers answered the request with the same 5xx, so it is the
      request's fault: again the upstream's status and message.
    - A runtime without the operation's endpoint (the Node's `unsupported_operation`
      with the runtime's 404/405) on every provider tried: 400, the model does not
      serve it.
    - An upstream 429/503 on every provider tried: a retryable 503 (busy, not broken),
      with the upstream's `Retry-After` when it gave one (at most `MAX_REST_S`).
    - Anything else: 502, saying what went wrong.

    No message names the provider, its Node or an address (`core.caller_text`): the Edge
    logs them here, under `request_id`, which every message but a refusal ends with.
    """
    log.log(
        logging.INFO if failure.code in _REQUEST_FAILURES else logging.WARNING,
        "request %s failed on provider %s: %s: %s",
        request_id,
        provider_id,
        failure.code,
        without_credentials(failure.message),
    )
    code = str(failure.code)
    said = without_topology(failure.message, (provider_id,))
    if failure.code == wire.FailureCode.REQUEST_TOO_LARGE:
        return ApiError(413, f"Request too large to dispatch: {said}", code=code)
    if failure.code == wire.FailureCode.SHUTTING_DOWN:
        return ApiError(
            503,
            with_request_id(said, request_id),
            type="service_unavailable_error",
            code=code,
            retry_after_s=RETRY_AFTER_BUSY_S,
        )
    status = failure.status
    if failure.code == wire.FailureCode.UNSUPPORTED_OPERATION and status is not None:
        # Every provider tried has a runtime without the endpoint: not for this model.
        return ApiError(400, said, code=code, param="model")
    if status is not None and (
        request_fault or (failure.code in _REQUEST_FAILURES and 400 <= status < 500)
    ):
        return ApiError(
            status,
            said,
            code=upstream_identifier(failure.upstream_code, (provider_id,))
            or ("upstream_rejected" if request_fault else code),
            param=upstream_identifier(failure.param, (provider_id,)),
        )
    if failure.capacity:
        # Upstream 429/503 on every provider tried: busy, not broken, so the caller gets
        # a retryable 503 with Retry-After (the upstream's own, when it gave one) rather
        # than a 502 failure.
        return ApiError(
            503,
            with_request_id(f"the model's providers are at capacity: {said}", request_id),
            type="service_unavailable_error",
            code=code,
            retry_after_s=min(failure.retry_after_s or RETRY_AFTER_BUSY_S, MAX_REST_S),
        )
    detail = said
    if failure.code == wire.FailureCode.UPSTREAM_ERROR and status is not None:
        returned = f"upstream returned {status}"
        detail = detail if detail.startswith(returned) else f"{returned}: {detail}"
    lead = _FAILED.get(
        failure.code,
        "the upstream failed" if code.startswith("upstream_") else "the run failed",
    )
    return ApiError(
        502,
        with_request_id(f"{lead}: {detail}", request_id),
        type="api_error",
        code=code,
    )


#: How a 502 begins, by what failed.
_FAILED: Final[dict[wire.FailureCode, str]] = {
    wire.FailureCode.BAD_RESPONSE: "the provider returned a bad response",
    wire.FailureCode.BAD_CHUNK: "the provider returned a bad stream",
    wire.FailureCode.NODE_LOST: "the model's host was lost",
}
