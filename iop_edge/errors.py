"""Errors the OpenAI surface answers with, as one exception type carrying its HTTP shape.

Handlers raise `ApiError`; one error handler turns it into OpenAI's error body with the
right status and headers, so every failure a caller sees has the same shape.
"""

from __future__ import annotations

import msgspec

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
