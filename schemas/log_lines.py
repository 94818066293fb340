"""How the Edge and the Node write their log lines: readable text, or JSON lines.

Both processes log through Python's `logging` and take the same two flags,
`--log-level` and `--log-format text|json`, so this is shared like the wire is.

- `text` (the default): `TIME LEVEL logger: message`, for a terminal or journald.
- `json`: one JSON object per line, for a log shipper: `time` (ISO 8601 UTC with
  milliseconds), `level`, `logger`, `message`, every field the record carries in its
  `fields` extra (the access log puts its columns there, so they arrive typed, not
  parsed out of a message), and `exception` with the traceback when there is one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final, Literal, get_args

import msgspec

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final[tuple[str, ...]] = get_args(LogFormat)
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
#: The attribute of a `LogRecord` (set with `extra={FIELDS: {...}}`) whose items a JSON
#: line carries as its own keys.
FIELDS: Final = "fields"

_encode = msgspec.json.Encoder().encode


def iso_time(unix_s: float) -> str:
    """`2026-12-02T17:42:03.123Z`: UTC, milliseconds, sortable as text."""
    moment = datetime.fromtimestamp(unix_s, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": iso_time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, Mapping):
            for key, value in fields.items():
                line.setdefault(str(key), value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return _encode(line).decode()


def configure_logging(
    level: str, log_format: LogFormat = "text", quiet: Mapping[str, int] | None = None
) -> None:
    """Send every log record to stderr at `level` in `log_format`.

    `quiet` maps chatty libraries' loggers to the least severe level of theirs to show.
    Like `logging.basicConfig`, it adds no handler when the root logger already has one
    (a test harness, or a program embedding IOP, owns logging then); levels still apply.
    """
    root_level: int = getattr(logging, level.upper())
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonLinesFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    logging.basicConfig(level=root_level, handlers=[handler])
    for name, floor in (quiet or {}).items():
        logging.getLogger(name).setLevel(max(floor, root_level))
