"""The access log's line formats and the shared log-line formatter (design §12)."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from iop_edge.runtime.metering.access_log import (
    ACCESS_LOGGER,
    AccessLog,
    RefusedRequest,
    access_fields,
    logfmt,
    run_line,
)
from iop_edge.runtime.metering.activity import Activity
from iop_edge.runtime.metering.metering import RunRecord
from schemas import wire
from schemas.runtime.log_lines import (
    FIELDS,
    JsonLinesFormatter,
    LineHandler,
    TextLinesFormatter,
    iso_time,
    sole_handler,
)


def _record(**changes: object) -> RunRecord:
    values: dict[str, object] = {
        "run_id": "req_0123",
        "request_id": "caller-id-7",
        "model": "qwen3.6:35b",
        "principal_ref": "team-search",
        "token_ref": "chat-app",
        "alias": None,
        "provider": "gpu1-vllm",
        "node": "gpu1",
        "status": 200,
        "code": None,
        "usage": wire.Usage(prompt_tokens=12, completion_tokens=30, total_tokens=42),
        "usage_source": "provider",
        "latency_s": 0.25,
        "ttft_s": 0.0412,
        "queued_s": 0.0,
    }
    values.update(changes)
    return RunRecord(**values)  # type: ignore[arg-type]


def _write(access: AccessLog, *requests: RunRecord | RefusedRequest) -> None:
    """`requests`' lines, in one batch, each ended now."""
    access.write([(request, time.time()) for request in requests])


def test_fields_name_everything_the_spec_asks_for() -> None:
    assert access_fields(_record()) == {
        "request_id": "caller-id-7",
        "principal_ref": "team-search",
        "model": "qwen3.6:35b",
        "protocol": "chat",
        "provider": "gpu1-vllm",
        "node": "gpu1",
        "status": 200,
        "code": None,
        "latency_ms": 250.0,
        "ttft_ms": 41.2,
        "prompt_tokens": 12,
        "completion_tokens": 30,
        "run_id": "req_0123",  # the caller chose its request id: IOP's is named too
    }
    assert "run_id" not in access_fields(_record(request_id="req_0123"))


def test_a_run_that_never_reached_a_provider() -> None:
    fields = access_fields(
        _record(provider="", node="", status=429, code="queue_full", usage=None, ttft_s=None)
    )
    assert (fields["provider"], fields["node"], fields["ttft_ms"]) == (None, None, None)
    assert fields["prompt_tokens"] is None and fields["code"] == "queue_full"


def test_logfmt_is_readable_and_unambiguous() -> None:
    line = logfmt({"a": "plain", "b": None, "c": 'has "quotes" and spaces', "d": 3, "e": ""})
    assert line == 'a=plain b=- c="has \\"quotes\\" and spaces" d=3 e=""'
    assert logfmt({"x": "k=v"}) == 'x="k=v"'


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"provider": "", "node": "", "status": 429, "code": "queue_full", "usage": None},
        {"ttft_s": None, "latency_s": 1.23456789, "code": "bad request", "status": 400},
        {"model": 'a "quoted" model', "principal_ref": "k=v", "request_id": ""},
        {"node": "tab\there", "provider": "back\\slash", "latency_s": 0.0, "ttft_s": 1e-9},
        {"protocol": "messages", "latency_s": 12345.678, "usage": wire.Usage()},
        {"request_id": "req_0123"},
    ],
)
def test_a_runs_line_is_logfmt_of_its_fields(changes: dict[str, object]) -> None:
    record = _record(**changes)
    assert run_line(record) == logfmt(access_fields(record))


def test_text_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="iop_edge.access")
    _write(AccessLog(), _record())
    [record] = caplog.records
    assert record.name == "iop_edge.access" and record.levelno == logging.INFO
    assert record.getMessage() == (
        "request_id=caller-id-7 principal_ref=team-search model=qwen3.6:35b protocol=chat "
        "provider=gpu1-vllm node=gpu1 status=200 code=- latency_ms=250.0 ttft_ms=41.2 "
        "prompt_tokens=12 completion_tokens=30 run_id=req_0123"
    )


def test_json_line_has_typed_fields(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="iop_edge.access")
    _write(AccessLog(), _record(status=502, code="upstream_error"))
    _write(
        AccessLog(),
        RefusedRequest(
            request_id="r2",
            path="/v1/chat/completions",
            status=401,
            code="invalid_api_key",
            latency_s=0.001,
        ),
    )
    run_line, refused_line = (json.loads(JsonLinesFormatter().format(r)) for r in caplog.records)
    assert run_line["level"] == "info" and run_line["logger"] == "iop_edge.access"
    assert run_line["time"].endswith("Z") and "T" in run_line["time"]
    assert (run_line["status"], run_line["code"], run_line["latency_ms"]) == (
        502,
        "upstream_error",
        250.0,
    )
    assert run_line["request_id"] == "caller-id-7" and run_line["prompt_tokens"] == 12
    assert refused_line == {
        "time": refused_line["time"],
        "level": "info",
        "logger": "iop_edge.access",
        "message": refused_line["message"],
        "request_id": "r2",
        "path": "/v1/chat/completions",
        "status": 401,
        "code": "invalid_api_key",
        "latency_ms": 1.0,
    }


def test_access_log_is_silent_above_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="iop_edge.access")
    _write(AccessLog(), _record())
    assert caplog.records == []


def test_json_formatter_for_any_record() -> None:
    record = logging.LogRecord(
        "iop_edge.hub", logging.WARNING, __file__, 1, "node %s", ("n1",), None
    )
    record.created = 0.0
    setattr(record, FIELDS, {"message": "cannot override", "node": "n1"})
    line = json.loads(JsonLinesFormatter().format(record))
    assert line == {
        "time": "1970-01-01T00:00:00.000Z",
        "level": "warning",
        "logger": "iop_edge.hub",
        "message": "node n1",
        "node": "n1",
    }
    assert iso_time(1.5) == "1970-01-01T00:00:01.500Z"


def test_activity_buckets_and_rates() -> None:
    now = [1000.0]
    activity = Activity(bucket_s=10, buckets=6, clock=lambda: now[0])
    for status in (200, 200, 429, 502):
        activity.record(status)
    now[0] = 1015.0
    activity.record(200)
    report = activity.report()
    assert [b.start for b in report.buckets] == [960.0, 970.0, 980.0, 990.0, 1000.0, 1010.0]
    assert [(b.requests, b.ok, b.rejected, b.errors) for b in report.buckets[-2:]] == [
        (4, 2, 1, 1),
        (1, 1, 0, 0),
    ]
    assert report.errors_last_minute == 1 and report.rejected_last_minute == 1
    assert report.requests_per_s == round(5 / 55, 3)  # 5 buckets full + 5 s of the current
    now[0] = 1100.0  # the window moved past every bucket
    activity.record(200)
    assert sum(b.requests for b in activity.report().buckets) == 1


# --- the direct route: the line `logging` would write, written without a record ---------


@pytest.fixture
def isolated() -> Iterator[logging.Logger]:
    """A logger of its own (not propagating), whose handlers each test sets (pytest adds
    its capture handler to the non-propagating loggers it finds); reset afterwards."""
    logger = logging.getLogger("iop_test.access")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    yield logger
    logger.handlers.clear()
    logger.filters.clear()
    logger.propagate = True


def _handler(
    formatter: logging.Formatter,
    cls: type[logging.StreamHandler] = LineHandler,  # type: ignore[type-arg]
) -> tuple[logging.StreamHandler, io.StringIO]:  # type: ignore[type-arg]
    stream = io.StringIO()
    handler = cls(stream)
    handler.setFormatter(formatter)
    return handler, stream


def _at(monkeypatch: pytest.MonkeyPatch, moment: float) -> None:
    """Freeze the clock both routes read (`LogRecord` and the access log)."""
    monkeypatch.setattr(time, "time", lambda: moment)
    monkeypatch.setattr(time, "time_ns", lambda: int(moment * 1e9))


@pytest.mark.parametrize("formatter_class", [TextLinesFormatter, JsonLinesFormatter])
def test_the_direct_route_writes_what_logging_writes(
    isolated: logging.Logger,
    monkeypatch: pytest.MonkeyPatch,
    formatter_class: type[TextLinesFormatter | JsonLinesFormatter],
) -> None:
    direct, direct_stream = _handler(formatter_class())
    # Any other handler, a plain `StreamHandler` too, is left to `logging`.
    through_logging, logging_stream = _handler(formatter_class(), logging.StreamHandler)
    refused = RefusedRequest(
        request_id="r 2", path="/v1/messages", status=401, code="invalid_api_key", latency_s=0.001
    )
    for handler in (direct, through_logging):
        isolated.handlers[:] = [handler]
        assert (sole_handler(isolated, logging.INFO) is not None) == (handler is direct)
        for moment in (1_764_000_000.0, 1_764_000_000.9996, 1_764_000_001.0004):
            _at(monkeypatch, moment)
            _write(AccessLog(isolated), _record(model='a "quoted" model'))
            _write(AccessLog(isolated), refused)
    lines = direct_stream.getvalue().splitlines()
    assert lines == logging_stream.getvalue().splitlines() and len(lines) == 6
    assert "iop_test.access" in lines[0] and "request_id=caller-id-7" in lines[0]


def test_the_direct_route_keeps_levels_filters_and_other_handlers(
    isolated: logging.Logger,
) -> None:
    handler, stream = _handler(TextLinesFormatter())
    isolated.handlers[:] = [handler]
    assert sole_handler(isolated, logging.INFO) == (handler, handler.formatter)
    isolated.setLevel(logging.WARNING)  # --log-level warning
    _write(AccessLog(isolated), _record())
    assert sole_handler(isolated, logging.INFO) is None and stream.getvalue() == ""
    isolated.setLevel(logging.INFO)
    handler.setLevel(logging.WARNING)  # the one handler takes warnings only: no line
    assert sole_handler(isolated, logging.INFO) is None
    _write(AccessLog(isolated), _record())
    assert stream.getvalue() == ""
    handler.setLevel(logging.NOTSET)
    isolated.addFilter(lambda record: "team-search" not in record.getMessage())
    assert sole_handler(isolated, logging.INFO) is None  # a filter decides: logging's route
    _write(AccessLog(isolated), _record())
    assert stream.getvalue() == ""
    isolated.filters.clear()
    second, second_stream = _handler(JsonLinesFormatter())
    isolated.addHandler(second)  # two destinations: logging's route, both get the line
    assert sole_handler(isolated, logging.INFO) is None
    _write(AccessLog(isolated), _record())
    assert "request_id=caller-id-7" in stream.getvalue()
    assert json.loads(second_stream.getvalue())["request_id"] == "caller-id-7"
    plain, _ = _handler(logging.Formatter("%(message)s"))
    isolated.handlers[:] = [plain]  # a formatter of someone else's: logging's route
    assert sole_handler(isolated, logging.INFO) is None


def test_a_failed_write_is_reported_as_logging_reports_it(
    isolated: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

    handler = LineHandler(Broken())
    handler.setFormatter(TextLinesFormatter())
    isolated.handlers[:] = [handler]
    reported: list[logging.LogRecord] = []
    monkeypatch.setattr(handler, "handleError", reported.append)
    _write(AccessLog(isolated), _record())
    [record] = reported
    assert record.getMessage() == "1 log line(s) could not be written"


def test_a_batch_is_one_write_in_order_each_line_with_its_own_time(
    isolated: logging.Logger,
) -> None:
    """Rule 5: the lines of a batch go out in one write, in the batch's order, each
    timed when its request ended, not when the batch was written."""
    writes: list[str] = []

    class Recording(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    handler = LineHandler(Recording())
    handler.setFormatter(JsonLinesFormatter())
    isolated.handlers[:] = [handler]
    refused = RefusedRequest("b", "/v1/messages", 401, "invalid_api_key", 0.001)
    AccessLog(isolated).write(
        [
            (_record(request_id="a"), 1_764_000_000.0),
            (refused, 1_764_000_001.5),
            (_record(request_id="c"), 1_764_000_002.25),
        ]
    )
    [batch] = writes
    lines = [json.loads(line) for line in batch.splitlines()]
    assert [line["request_id"] for line in lines] == ["a", "b", "c"]
    assert [line["time"] for line in lines] == [
        iso_time(1_764_000_000.0),
        iso_time(1_764_000_001.5),
        iso_time(1_764_000_002.25),
    ]
    AccessLog(isolated).write([])
    assert len(writes) == 1  # nothing ended: nothing written


def test_a_json_line_is_timed_as_iso_time_says() -> None:
    """The formatter remembers the text of the last second; its lines still round as
    `datetime` does, at the edges of a second too."""
    formatter = JsonLinesFormatter()
    boundaries = [0.0, 0.0005, 1.9999995, 1.9999994, 59.9999996, 1_764_000_000.9999999]
    spread = [1_764_000_000 + n / 7919 for n in range(20_000)]
    for moment in boundaries + spread:
        line = json.loads(formatter.line("l", "INFO", moment, "m"))
        assert line["time"] == iso_time(moment), moment


_PROCESS = """
import logging, sys, time
from iop_edge.main import setup_logging
from iop_edge.runtime.metering.access_log import AccessLog, RefusedRequest
from tests.unit.test_access_log import _record

setup_logging(sys.argv[1], sys.argv[2])
logging.getLogger("iop_edge.edge").warning("before")
refused = RefusedRequest("r2", "/v1/responses", 401, "invalid_api_key", 0.001)
AccessLog().write([(_record(), time.time()), (refused, time.time())])
logging.getLogger("iop_edge.edge").warning("after")
"""


@pytest.mark.parametrize("log_format", ["text", "json"])
@pytest.mark.parametrize("level", ["info", "warning"])
def test_an_edge_process_writes_its_access_lines_to_stderr_in_order(
    log_format: str, level: str
) -> None:
    """As `iop-edge serve --log-level LEVEL --log-format FORMAT` sets logging up: the
    access lines come on stderr (at info, none at warning), in their place among the
    other lines, in the process's format."""
    done = subprocess.run(
        [sys.executable, "-c", _PROCESS, level, log_format],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    if log_format == "json":
        parsed = [json.loads(line) for line in lines]
        messages = [line["message"] if line["logger"] != ACCESS_LOGGER else line for line in parsed]
    else:
        messages = [line.split(": ", 1)[1] if ACCESS_LOGGER not in line else line for line in lines]
    if level == "warning":
        assert messages == ["before", "after"]
        return
    before, run, refused, after = messages
    assert (before, after) == ("before", "after")
    if log_format == "json":
        assert isinstance(run, dict) and isinstance(refused, dict)
        assert (run["level"], run["request_id"], run["status"], run["ttft_ms"]) == (
            "info",
            "caller-id-7",
            200,
            41.2,
        )
        assert refused["path"] == "/v1/responses" and refused["code"] == "invalid_api_key"
    else:
        assert isinstance(run, str) and isinstance(refused, str)
        assert f" INFO    {ACCESS_LOGGER}: request_id=caller-id-7 principal_ref=team-search " in run
        assert run.endswith("prompt_tokens=12 completion_tokens=30 run_id=req_0123")
        assert refused.endswith(
            "request_id=r2 path=/v1/responses status=401 code=invalid_api_key latency_ms=1.0"
        )
