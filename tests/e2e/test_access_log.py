"""The access log through a real Edge and Node: one line per finished request (design §12)."""

from __future__ import annotations

import json
import logging

import pytest

from schemas.runtime.log_lines import JsonLinesFormatter
from tests.e2e.stack import Stack

SECRET_PROMPT = "the-prompt-must-not-be-logged"


def _access_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "iop_edge.access"]


async def test_one_line_per_request_with_the_callers_request_id(
    stack_one: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iop_edge.access")
    async with stack_one.client(api_key="sk-caller-secret") as client:
        await client.chat.completions.create(
            model="m",
            max_tokens=3,
            messages=[{"role": "user", "content": SECRET_PROMPT}],
            extra_headers={"x-request-id": "caller-trace-42"},
        )
        stream = await client.chat.completions.create(
            model="m", max_tokens=2, stream=True, messages=[{"role": "user", "content": "x"}]
        )
        async for _ in stream:
            pass
    async with stack_one.http() as http:
        missing = await http.post(
            "/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": SECRET_PROMPT}]},
            headers={"x-request-id": "caller-trace-43"},
        )
    assert missing.status_code == 404
    stack_one.edge.books.settle()  # the lines are written in batches, in order

    first, second, refused = _access_records(caplog)
    line = json.loads(JsonLinesFormatter().format(first))
    assert line["request_id"] == "caller-trace-42"
    assert (line["model"], line["provider"], line["node"], line["status"]) == (
        "m",
        "sim-1",
        "node-1",
        200,
    )
    assert line["completion_tokens"] == 3 and line["prompt_tokens"] > 0
    assert line["latency_ms"] >= line["ttft_ms"] > 0
    assert first.getMessage().startswith("request_id=caller-trace-42 principal_ref=anonymous")
    streamed = json.loads(JsonLinesFormatter().format(second))
    assert streamed["request_id"].startswith("req_") and streamed["completion_tokens"] == 2
    assert "request_id=caller-trace-43" in refused.getMessage()
    assert "status=404 code=model_not_found" in refused.getMessage()
    everything = caplog.text + "".join(JsonLinesFormatter().format(r) for r in caplog.records)
    assert SECRET_PROMPT not in everything and "sk-caller-secret" not in everything
