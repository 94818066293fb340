"""Anthropic's beta extras taken out of a native Messages run, and the answers that say a
runtime refuses them (`iop_node.protocols.anthropic_betas`)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from iop_node.protocols.anthropic_betas import refuses_betas, without_betas
from schemas.wire import Run

TTL = {"type": "ephemeral", "ttl": "1h"}
BODY: dict[str, Any] = {
    "model": "m",
    "max_tokens": 8,
    "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
    "system": [{"type": "text", "text": "Be brief.", "cache_control": TTL}],
    "messages": [
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "ttl", "cache_control": TTL}],
                }
            ],
        }
    ],
    "tools": [{"name": "Bash", "input_schema": {"type": "object"}, "cache_control": TTL}],
}
HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "context-management-2025-06-27"}


def _run(body: dict[str, Any], headers: dict[str, str]) -> Run:
    return Run(
        run_id="r",
        provider_id="p",
        target="m",
        operation="messages",
        body=msgspec.json.encode(body),
        caller_headers=headers,
    )


def test_every_extra_goes_and_everything_else_stays() -> None:
    stripped = without_betas(_run(BODY, HEADERS))
    assert stripped is not None
    assert stripped.caller_headers == {"anthropic-version": "2023-06-01"}
    body = json.loads(stripped.body)
    assert "context_management" not in body
    marker = {"type": "ephemeral"}
    assert body["system"][0]["cache_control"] == marker
    assert body["messages"][0]["content"][0]["content"][0] == {
        "type": "text",
        "text": "ttl",
        "cache_control": marker,
    }
    assert body["tools"][0]["cache_control"] == marker
    assert {k: v for k, v in body.items() if k not in ("system", "messages", "tools")} == {
        "model": "m",
        "max_tokens": 8,
    }


def test_a_run_without_extras_is_left_alone() -> None:
    plain = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "ttl"}]}
    assert without_betas(_run(plain, {"anthropic-version": "2023-06-01"})) is None
    only_header = without_betas(_run(plain, {"Anthropic-Beta": "x"}))
    assert only_header is not None and only_header.caller_headers == {}
    assert json.loads(only_header.body) == plain


@pytest.mark.parametrize(
    ("status", "message", "refused"),
    [
        (400, "context_management: Extra inputs are not permitted", True),
        (422, "[{'type': 'extra_forbidden', 'loc': ('body', 'context_management')}]", True),
        (400, "Unrecognized request argument supplied: context_management", True),
        (400, "system.0.cache_control.ttl: unknown field", True),
        (400, "Unexpected value for the anthropic-beta header", True),
        (400, "max_tokens: must be at most 4096", False),
        (400, "the request throttled", False),
        (500, "Extra inputs are not permitted", False),
        (None, "Extra inputs are not permitted", False),
    ],
)
def test_what_says_a_runtime_refuses_them(status: int | None, message: str, refused: bool) -> None:
    assert refuses_betas(status, message) is refused
