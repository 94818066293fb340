"""How an HTTP upstream's failures become `AdapterError`s (the table in
`adapters.openai_compat`'s docstring): an error status, a transport error, a stream cut
short, and whether a native endpoint's error means its route is missing."""

from __future__ import annotations

import math
import ssl
import time
from collections.abc import Iterable
from email.utils import parsedate_to_datetime
from typing import Final

import httpcore2
import httpx2

from iop_node.adapters.base import AdapterError
from iop_node.adapters.sse import SSEError
from iop_node.adapters.upstream_errors import error_message, read_error_facts
from schemas.wire import FailureCode, Operation

__all__ = [
    "DETAIL_LIMIT",
    "clip",
    "describe_transport_error",
    "missing_route",
    "no_endpoint",
    "retry_after",
    "status_failure",
    "stream_cut",
]

#: Longest one-line detail of a probe or transport failure (a status detail, a log line).
DETAIL_LIMIT: Final = 500


def clip(text: str) -> str:
    """One line of at most `DETAIL_LIMIT` characters (a status detail, a log line)."""
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_LIMIT else text[: DETAIL_LIMIT - 3] + "..."


def retry_after(headers: Iterable[tuple[bytes, bytes]], *, now: float) -> float | None:
    """How many seconds a 429/503 upstream asked to be left alone: OpenAI's
    `retry-after-ms` when present, else `Retry-After` (seconds, or an HTTP date, `now`
    being the Unix time); None when it did not say, or said something unreadable."""
    said: dict[bytes, bytes] = {}
    for name, value in headers:
        lowered = name.lower()
        if lowered in (b"retry-after-ms", b"retry-after"):
            said.setdefault(lowered, value)
    millis = said.get(b"retry-after-ms")
    if millis is not None and (thousandths := _number(millis)) is not None:
        return thousandths / 1000
    given = said.get(b"retry-after")
    if given is None:
        return None
    seconds = _number(given)
    if seconds is not None:
        return seconds
    try:
        when = parsedate_to_datetime(given.decode("latin-1"))
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110's IMF-fixdate is GMT
        return None
    return max(0.0, when.timestamp() - now)


def _number(value: bytes) -> float | None:
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def status_failure(
    status: int,
    body: bytes,
    operation: Operation | None = None,
    *,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> AdapterError:
    """Map a non-2xx upstream response onto an `AdapterError` (table in the module doc);
    a refusal keeps the upstream's error code and the field it names (`upstream_errors`),
    a 429/503 how long its `headers` asked to be left alone (`retry_after`)."""
    detail = error_message(body)
    suffix = f": {detail}" if detail else ""
    if status in (429, 503):
        return AdapterError(
            FailureCode.UPSTREAM_BUSY,
            f"upstream busy ({status}){suffix}",
            retryable=True,
            capacity=True,
            status=status,
            retry_after_s=retry_after(headers, now=time.time()),
        )
    if status in (401, 403, 404):
        return AdapterError(
            FailureCode.UPSTREAM_MISCONFIGURED,
            f"upstream refused this provider ({status}){suffix}",
            retryable=True,
            status=status,
        )
    if status == 408:
        return AdapterError(
            FailureCode.UPSTREAM_TIMEOUT,
            f"upstream timed out ({status}){suffix}",
            retryable=True,
            status=status,
        )
    if 400 <= status < 500:
        facts = read_error_facts(body, operation)
        return AdapterError(
            FailureCode.UPSTREAM_REJECTED,
            detail or f"upstream rejected the request ({status})",
            status=status,
            upstream_code=facts.code,
            param=facts.param,
        )
    # The upstream's own words: the Edge decides whom a 5xx blames (the provider, or the
    # request when another provider fails it the same way) and words the reply itself.
    return AdapterError(
        FailureCode.UPSTREAM_ERROR,
        detail or f"upstream returned {status}",
        retryable=True,
        status=status,
    )


def describe_transport_error(exc: Exception) -> str:
    """A short, secret-free description of a transport (or event-stream) failure."""
    match exc:
        case httpx2.ConnectTimeout() | httpcore2.ConnectTimeout():
            what = "connect timed out"
        case httpx2.ConnectError() | httpcore2.ConnectError():
            what = "cannot connect"
        case httpx2.TimeoutException() | httpcore2.TimeoutException():
            what = "timed out"
        case httpx2.RemoteProtocolError() | httpcore2.RemoteProtocolError():
            what = "protocol error"
        case SSEError():
            what = "bad event stream"
        case _:
            what = "connection failed"
    detail = _said(exc)
    return clip(f"{what}: {detail}") if detail else what


#: How deep `_said` looks under an exception for its cause's words.
_CAUSES_READ: Final = 4


def _said(exc: BaseException) -> str:
    """What `exc` says, else what the first cause under it that says something does: a
    connect error wraps a TLS handshake's failure without a word of its own."""
    cause: BaseException | None = exc
    for _ in range(_CAUSES_READ):
        if cause is None:
            break
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"TLS certificate not trusted: {cause.verify_message}"
        if isinstance(cause, ssl.SSLError) and cause.reason:
            return f"TLS: {cause.reason}"
        if text := str(cause).strip():
            return text
        cause = cause.__cause__ or cause.__context__
    return ""


def stream_cut(emitted: int, message: str, *, reply_fault: bool = False) -> AdapterError:
    """A stream that cannot go on after `emitted` chunks; `reply_fault` when what the
    upstream said is empty or malformed (`wire.RunFailed.reply_fault`), not an error it
    reported."""
    if emitted:
        return AdapterError(
            FailureCode.UPSTREAM_STREAM_ERROR,
            f"{message} (after {emitted} chunks)",
            reply_fault=reply_fault,
        )
    return AdapterError(
        FailureCode.UPSTREAM_ERROR, message, retryable=True, reply_fault=reply_fault
    )


def missing_route(status: int, body: bytes, model: str) -> bool:
    """Whether a native endpoint's error answer means the route does not exist: a 405, or
    a 404 that is not about the model (a server without the route says "Not Found"; one
    with it says which model it does not know, and that is no lesson about the protocol)."""
    if status == 405:
        return True
    if status != 404:
        return False
    message = error_message(body) or ""
    return not model or model not in message


def no_endpoint(path: str, status: int) -> AdapterError:
    """A runtime without the endpoint `path` of a run's operation (a chat-only server
    asked for embeddings, answering `status`): another provider of the model may have
    it, and a caller asking for it is told so; no fault of the provider's, which serves
    everything else."""
    return AdapterError(
        FailureCode.UNSUPPORTED_OPERATION,
        f"the model's runtime has no {path} endpoint (it answered {status})",
        retryable=True,
        status=status,
    )
