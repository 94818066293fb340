"""The access log (design §12): one line per finished inference request.

Fed by the same `RunRecord` metering gets (`Run.end`, exactly once per run) and, for a
request refused before it became a run (bad JSON, bad token, unknown model, body too
large), by a `RefusedRequest` from the HTTP layer; both come through the Edge's books
(`books.RunBooks`). `/v1/models` and the health probes are not inference requests and
are not logged.

Rules:
1. A line carries: time, request id (the `x-request-id` the caller saw), principal_ref,
   model, the caller's protocol (chat, messages, responses), provider, node, status,
   error code, latency, time to first token and tokens; and, when the caller chose the
   request id, IOP's own run id too (`run_id`: the ids in the response body are made
   from it, `chatcmpl-<run id>`, `resp_<run id>`).
   Never a token, never a prompt, never a response: nothing here reads a body.
2. Lines go to the `iop_edge.access` logger at INFO, so `--log-level warning` silences
   them and `--log-format json` makes each one a JSON object whose keys are the fields
   above (typed: numbers stay numbers), alongside every other log line of the process.
3. The readable form is `key=value` pairs (logfmt): a value with a space, a quote or
   an `=` is written as a JSON string; a missing value is `-`. A run's line is written
   from its record directly (`run_line`, the same text as `logfmt(access_fields(...))`),
   and its fields are made only for a line that carries them (a JSON line, a record).
4. A line goes through `logging` unless it would only reach the handler of
   `configure_logging` (`log_lines.sole_handler`, checked per batch, so a change to the
   logging setup counts at once): then it is made without a `LogRecord`, the same line
   `logging` would write (its formatter's `line`), and given to that handler
   (`LineHandler.write_line`). A record, a caller lookup and a flush per request cost
   more than the rest of the request's bookkeeping.
5. Lines come in batches (`write`), each entry with the wall time its request ended (the
   Edge's `books.RunBooks` gathers them: at most `books.HOLD_S` after the request): a
   batch is one write to stderr, in order, each line with its own time (a write into a
   pipe wakes its reader, which costs more than making the line).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from iop_edge.runtime.metering.metering import RunRecord
from schemas.runtime.log_lines import FIELDS, JsonLinesFormatter, sole_handler

__all__ = [
    "ACCESS_LOGGER",
    "AccessLog",
    "Ended",
    "RefusedRequest",
    "access_fields",
    "logfmt",
    "refused_fields",
    "run_line",
]

ACCESS_LOGGER: Final = "iop_edge.access"

_encode = msgspec.json.Encoder().encode
_NEEDS_QUOTES: Final = frozenset(' "=\t\n\\')
_INFO: Final = logging.getLevelName(logging.INFO)


@dataclass(frozen=True, slots=True)
class RefusedRequest:
    """An inference request answered with an error before it became a run."""

    request_id: str
    path: str
    status: int
    code: str | None
    latency_s: float


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def access_fields(record: RunRecord) -> dict[str, Any]:
    """The access log's fields for one finished run (Rule 1)."""
    usage = record.usage
    return {
        "request_id": record.request_id,
        "principal_ref": record.principal_ref,
        "model": record.model,
        "protocol": record.protocol,
        "provider": record.provider or None,
        "node": record.node or None,
        "status": record.status,
        "code": record.code,
        "latency_ms": _ms(record.latency_s),
        "ttft_ms": _ms(record.ttft_s),
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
    } | ({} if record.run_id == record.request_id else {"run_id": record.run_id})


def logfmt(fields: dict[str, Any]) -> str:
    """`key=value key2=value2` (Rule 3)."""
    parts = []
    for key, value in fields.items():
        if value is None:
            text = "-"
        else:
            text = str(value)
            if not text or not _NEEDS_QUOTES.isdisjoint(text):
                text = _encode(text).decode()
        parts.append(f"{key}={text}")
    return " ".join(parts)


def _text(value: str) -> str:
    """A string value as `logfmt` writes it (Rule 3)."""
    return value if value and _NEEDS_QUOTES.isdisjoint(value) else _encode(value).decode()


def run_line(record: RunRecord) -> str:
    """`logfmt(access_fields(record))`, written from the record at once: every finished
    run makes one, and its numbers need no quoting."""
    usage = record.usage
    provider, node, code, ttft_s = record.provider, record.node, record.code, record.ttft_s
    return (
        f"request_id={_text(record.request_id)} principal_ref={_text(record.principal_ref)}"
        f" model={_text(record.model)} protocol={_text(record.protocol)}"
        f" provider={_text(provider) if provider else '-'} node={_text(node) if node else '-'}"
        f" status={record.status} code={'-' if code is None else _text(code)}"
        f" latency_ms={round(record.latency_s * 1000, 2)}"
        f" ttft_ms={'-' if ttft_s is None else round(ttft_s * 1000, 2)}"
        + (
            f" prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}"
            if usage
            else " prompt_tokens=- completion_tokens=-"
        )
        + ("" if record.run_id == record.request_id else f" run_id={_text(record.run_id)}")
    )


#: A request that ended, and the wall time it ended (Rule 5).
Ended = tuple[RunRecord | RefusedRequest, float]


def refused_fields(request: RefusedRequest) -> dict[str, Any]:
    """The access log's fields for a request refused before it became a run."""
    return {
        "request_id": request.request_id,
        "path": request.path,
        "status": request.status,
        "code": request.code,
        "latency_ms": _ms(request.latency_s),
    }


def _message(request: RunRecord | RefusedRequest) -> str:
    if isinstance(request, RunRecord):
        return run_line(request)
    return logfmt(refused_fields(request))


def _fields(request: RunRecord | RefusedRequest) -> dict[str, Any]:
    if isinstance(request, RunRecord):
        return access_fields(request)
    return refused_fields(request)


class AccessLog:
    """Writes the access log lines (see the module docstring)."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._log = logger or logging.getLogger(ACCESS_LOGGER)

    def write(self, ended: Sequence[Ended]) -> None:
        """The lines of the requests that `ended`, in order, each timed as given (Rules 4
        and 5)."""
        log = self._log
        if not ended or not log.isEnabledFor(logging.INFO):
            return
        route = sole_handler(log, logging.INFO)
        if route is None:
            for request, _ in ended:
                log.info("%s", _message(request), extra={FIELDS: _fields(request)})
            return
        handler, formatter = route
        carry = type(formatter) is JsonLinesFormatter
        name, terminator = log.name, handler.terminator
        handler.write_line(
            "".join(
                formatter.line(
                    name, _INFO, at, _message(request), _fields(request) if carry else None
                )
                + terminator
                for request, at in ended
            )
        )
