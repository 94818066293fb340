"""How the Edge and the Node write their log lines: readable text, or JSON lines.

Both processes log through Python's `logging` and take the same two flags,
`--log-level` and `--log-format text|json`, so this is shared like the wire is.

- `text` (the default): `TIME LEVEL logger: message`, for a terminal or journald.
- `json`: one JSON object per line, for a log shipper: `time` (ISO 8601 UTC with
  milliseconds), `level`, `logger`, `message`, every field the record carries in its
  `fields` extra (the access log puts its columns there, so they arrive typed, not
  parsed out of a message), and `exception` with the traceback when there is one.

A process that writes a line per request (the Edge's access log) may skip `logging`'s
record machinery when the line would only reach the handler `configure_logging` made
(`sole_handler`): both formatters write the same line from its parts (`line`) as from a
record (`format`), and that handler (`LineHandler`) writes such lines, several in one
write when the caller gathered them, in order with the process's other lines.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final, Literal, TextIO, get_args

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


class _IsoTimes:
    """`iso_time`, remembering the text of the last second it wrote: log lines come many
    to a second, and formatting a date costs more than the rest of a JSON line."""

    __slots__ = ("_second",)

    def __init__(self) -> None:
        self._second: tuple[int, str] = (-1, "")
        """The second, and its text up to the milliseconds (one tuple: a thread never
        sees half an update)."""

    def __call__(self, unix_s: float) -> str:
        # Split as `datetime.fromtimestamp` splits it: whole seconds, and microseconds
        # rounded half to even (a fraction that rounds up to a second carries).
        second = int(unix_s)
        micros = round((unix_s - second) * 1e6)
        if micros >= 1_000_000:
            second, micros = second + 1, micros - 1_000_000
        elif micros < 0:
            second, micros = second - 1, micros + 1_000_000
        cached, prefix = self._second
        if second != cached:
            prefix = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S.")
            self._second = (second, prefix)
        return f"{prefix}{micros // 1000:03d}Z"


class TextLinesFormatter(logging.Formatter):
    """`TEXT_FORMAT`, for a record (`format`) or for a line known without one (`line`)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second: tuple[int, str] = (-1, "")
        """The last second `line` wrote, and its text (`formatTime` without the ms)."""

    def line(
        self,
        logger: str,
        level: str,
        created: float,
        message: str,
        fields: Mapping[str, Any] | None = None,
    ) -> str:
        """What `format` writes for a record of `logger` at `level` (its name) created at
        `created` with this message and no exception; `fields` are not shown in text."""
        second = int(created)
        cached, stamp = self._second
        if second != cached:
            stamp = time.strftime(self.default_time_format, self.converter(created))
            self._second = (second, stamp)
        msec_format = self.default_msec_format
        if msec_format:
            stamp = msec_format % (stamp, int((created - second) * 1000))
        return f"{stamp} {level:<7} {logger}: {message}"


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._iso_time = _IsoTimes()

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, FIELDS, None)
        exception = self.formatException(record.exc_info) if record.exc_info else None
        return self.line(
            record.name,
            record.levelname,
            record.created,
            record.getMessage(),
            fields if isinstance(fields, Mapping) else None,
            exception=exception,
        )

    def line(
        self,
        logger: str,
        level: str,
        created: float,
        message: str,
        fields: Mapping[str, Any] | None = None,
        *,
        exception: str | None = None,
    ) -> str:
        """The line of a record of `logger` at `level` (its name) created at `created`,
        with this message, these fields and this formatted exception."""
        line: dict[str, Any] = {
            "time": self._iso_time(created),
            "level": level.lower(),
            "logger": logger,
            "message": message,
        }
        if fields is not None:
            for key, value in fields.items():
                line.setdefault(str(key), value)
        if exception is not None:
            line["exception"] = exception
        return _encode(line).decode()


#: The formatters that can write a line without a `LogRecord` (`sole_handler`).
LineFormatter = TextLinesFormatter | JsonLinesFormatter


class LineHandler(logging.StreamHandler[TextIO]):
    """The handler `configure_logging` installs: a `StreamHandler` (each record written to
    its stream and flushed) that also takes lines made without a record (`write_line`)."""

    def write_line(self, lines: str) -> None:
        """Write `lines` (one or several, terminators included) in one write and flush;
        a failed write is reported as `StreamHandler.emit` reports one, and the lines
        are dropped."""
        self.acquire()
        try:
            self.stream.write(lines)
            self.flush()
        except RecursionError:
            raise
        except Exception:
            record = logging.makeLogRecord(
                {"msg": "%d log line(s) could not be written", "args": (lines.count("\n") or 1,)}
            )
            self.handleError(record)
        finally:
            self.release()


def sole_handler(logger: logging.Logger, level: int) -> tuple[LineHandler, LineFormatter] | None:
    """The one handler a record of `logger` at `level` would reach, with its formatter,
    when it is a `LineHandler` formatted by one of this module's formatters (what
    `configure_logging` sets up) and no filter is on the way; None otherwise (another
    handler, a filter, a handler of someone else's: logging must decide).

    Then `handler.write_line(formatter.line(...) + handler.terminator)` writes what
    `logger.log` would, without a `LogRecord`: a caller that writes many lines (the
    access log) checks this per line, so a change to the logging setup (a test's
    capture handler, a filter) takes effect at once."""
    if logger.disabled or logger.filters or not logger.isEnabledFor(level):
        return None
    found: logging.Handler | None = None
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if level >= handler.level:
                if found is not None:
                    return None
                found = handler
        current = current.parent if current.propagate else None
    if type(found) is not LineHandler or found.filters:
        return None
    formatter = found.formatter
    if type(formatter) is TextLinesFormatter or type(formatter) is JsonLinesFormatter:
        return found, formatter
    return None


def configure_logging(
    level: str, log_format: LogFormat = "text", quiet: Mapping[str, int] | None = None
) -> None:
    """Send every log record to stderr at `level` in `log_format`.

    `quiet` maps chatty libraries' loggers to the least severe level of theirs to show.
    Like `logging.basicConfig`, it adds no handler when the root logger already has one
    (a test harness, or a program embedding IOP, owns logging then); levels still apply.
    """
    root_level: int = getattr(logging, level.upper())
    handler = LineHandler(sys.stderr)
    formatter: LineFormatter = (
        JsonLinesFormatter() if log_format == "json" else TextLinesFormatter()
    )
    handler.setFormatter(formatter)
    logging.basicConfig(level=root_level, handlers=[handler])
    for name, floor in (quiet or {}).items():
        logging.getLogger(name).setLevel(max(floor, root_level))
