"""The access log's line formats and the shared log-line formatter (design §12)."""

from __future__ import annotations

import json
import logging

import pytest

from iop_edge.runtime.metering.access_log import AccessLog, RefusedRequest, access_fields, logfmt
from iop_edge.runtime.metering.activity import Activity
from iop_edge.runtime.metering.metering import RunRecord
from schemas import wire
from schemas.log_lines import FIELDS, JsonLinesFormatter, iso_time


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
    }


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


def test_text_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="iop_edge.access")
    AccessLog().run_finished(_record())
    [record] = caplog.records
    assert record.name == "iop_edge.access" and record.levelno == logging.INFO
    assert record.getMessage() == (
        "request_id=caller-id-7 principal_ref=team-search model=qwen3.6:35b protocol=chat "
        "provider=gpu1-vllm node=gpu1 status=200 code=- latency_ms=250.0 ttft_ms=41.2 "
        "prompt_tokens=12 completion_tokens=30"
    )


def test_json_line_has_typed_fields(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="iop_edge.access")
    AccessLog().run_finished(_record(status=502, code="upstream_error"))
    AccessLog().refused(
        RefusedRequest(
            request_id="r2",
            path="/v1/chat/completions",
            status=401,
            code="invalid_api_key",
            latency_s=0.001,
        )
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
    AccessLog().run_finished(_record())
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
