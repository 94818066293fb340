"""Errors the OpenAI surface answers with, as one exception type carrying its HTTP shape.

Handlers raise `ApiError`; one error handler turns it into OpenAI's error body with the
right status and headers, so every failure a caller sees has the same shape. The runtime
reports refusals and failures in its own terms; `admission_error` and `run_failure_error`
are where those become HTTP statuses.
"""

from __future__ import annotations

import msgspec

from iop_edge.runtime.scheduler import (
    RETRY_AFTER_BUSY_S,
    AdmissionError,
    QueueFull,
    QueueTimeout,
    UnknownModel,
)
from schemas import wire
from schemas.openai import ErrorBody, ErrorDetail

_encoder = msgspec.json.Encoder()


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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.allow = allow
        """For a 405: the methods the path does accept (the `Allow` header)."""

    def body(self) -> bytes:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return _encoder.encode(ErrorBody(error=detail))

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        if self.allow is not None:
            headers["Allow"] = self.allow
        return headers


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def method_not_allowed(method: str, path: str, allow: str | None) -> ApiError:
    return ApiError(
        405, f"Method {method} not allowed on {path}", code="method_not_allowed", allow=allow
    )


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model '{model}' does not exist",
        type="not_found_error",
        code="model_not_found",
        param="model",
    )


def admission_error(exc: AdmissionError) -> ApiError:
    """The scheduler's refusals as OpenAI-shaped HTTP errors."""
    if isinstance(exc, QueueFull):
        return ApiError(
            429,
            exc.reason,
            type="rate_limit_error",
            code="queue_full",
            retry_after_s=exc.retry_after_s or 1.0,
        )
    if isinstance(exc, QueueTimeout):
        return ApiError(
            503,
            exc.reason,
            type="service_unavailable_error",
            code="queue_timeout",
            retry_after_s=exc.retry_after_s or 1.0,
        )
    if isinstance(exc, UnknownModel):
        return ApiError(
            404, exc.reason, type="not_found_error", code="model_not_found", param="model"
        )
    return ApiError(
        503,
        exc.reason,
        type="service_unavailable_error",
        code="no_provider",
        retry_after_s=exc.retry_after_s or 1.0,
    )


def run_failure_error(failure: wire.RunFailed, provider_id: str) -> ApiError:
    """What the caller gets for a run that failed on `provider_id`."""
    code = str(failure.code)
    if failure.code == wire.FailureCode.UPSTREAM_REJECTED and failure.status in (400, 413, 422):
        return ApiError(failure.status, failure.message, code=code)
    if failure.code == wire.FailureCode.REQUEST_TOO_LARGE:
        return ApiError(413, f"Request too large to dispatch: {failure.message}", code=code)
    if failure.code == wire.FailureCode.SHUTTING_DOWN:
        return ApiError(
            503,
            failure.message,
            type="service_unavailable_error",
            code=code,
            retry_after_s=RETRY_AFTER_BUSY_S,
        )
    if failure.capacity:
        # Upstream 429/503 on every provider tried: busy, not broken, so the caller gets
        # a retryable 503 with Retry-After rather than a 502 failure.
        return ApiError(
            503,
            f"provider '{provider_id}' is at capacity: {failure.message}",
            type="service_unavailable_error",
            code=code,
            retry_after_s=RETRY_AFTER_BUSY_S,
        )
    return ApiError(
        502,
        f"provider '{provider_id}' failed: {failure.message}",
        type="api_error",
        code=code,
    )
