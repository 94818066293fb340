"""Hostile callers: bodies built to crash decoders, requests built to occupy a provider
forever or to outgrow the wire, refresh bodies built to dodge the audit log."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from iop_edge.http.chat import MAX_CHOICES
from iop_edge.http.runs import MAX_JSON_DEPTH
from iop_edge.runtime.refresh.audit import AUDIT_FILE_NAME
from schemas.config import DEFAULT_MAX_TOKENS_LIMIT
from tests.e2e.stack import Stack

MESSAGES = [{"role": "user", "content": "hi"}]


def _nested(levels: int) -> bytes:
    inner = "[" * levels + "]" * levels
    return ('{"model":"m","messages":[{"role":"user","content":"x"}],"x":' + inner + "}").encode()


async def test_json_nested_too_deep_is_a_400_whatever_the_depth(stack_one: Stack) -> None:
    async with stack_one.http() as http:
        for levels in (MAX_JSON_DEPTH, 1_000, 100_000):
            response = await http.post(
                "/v1/chat/completions",
                content=_nested(levels),
                headers={"content-type": "application/json"},
            )
            assert response.status_code == 400, (levels, response.text)
            error = response.json()["error"]
            assert error["code"] == "invalid_json" and "nests deeper" in error["message"]
        ok = await http.post("/v1/chat/completions", content=_nested(MAX_JSON_DEPTH - 3))
        assert ok.status_code == 200, ok.text


async def test_generation_is_bounded_for_a_model_that_sets_no_limit(stack_one: Stack) -> None:
    async with stack_one.http() as http:
        for key in ("max_tokens", "max_completion_tokens"):
            body = {"model": "m", "messages": MESSAGES, key: 10**9}
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["code"] == "max_tokens_exceeded" and error["param"] == key
            assert str(DEFAULT_MAX_TOKENS_LIMIT) in error["message"]
        body = {"model": "m", "prompt": "x", "max_tokens": DEFAULT_MAX_TOKENS_LIMIT + 1}
        assert (await http.post("/v1/completions", json=body)).status_code == 400
        many = {"model": "m", "messages": MESSAGES, "n": MAX_CHOICES + 1}
        response = await http.post("/v1/chat/completions", json=many)
        assert response.status_code == 400 and response.json()["error"]["param"] == "n"


async def test_a_request_that_outgrows_the_wire_is_a_413_and_costs_no_node(
    stack_one: Stack,
) -> None:
    """Re-encoding can grow a body (1e15 is written out as 1000000000000000.0): a run
    message past the wire's limit is refused at the Edge, never sent to a Node."""
    numbers = b",".join([b"1e15"] * 4_500_000)  # 22 MB in, ~85 MB once re-encoded
    body = b'{"model":"m","messages":[{"role":"user","content":"x"}],"x":[' + numbers + b"]}"
    async with stack_one.http() as http:
        response = await http.post("/v1/chat/completions", content=body)
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "request_too_large"
        after = await http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
        assert after.status_code == 200
    assert stack_one.edge.connected_nodes() == {"node-1"}


async def test_unreadable_refresh_bodies_are_400s_in_the_audit_log(
    stack_one: Stack, tmp_path: Path
) -> None:
    deep = b"[" * 5000 + b"]" * 5000
    deep_mode = b'{"mode":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"
    # A large body is decoded off the event loop: its errors read the same.
    padding = b'{"config_yaml":"' + b"x" * 300_000 + b'",'
    large_deep = padding + b'"mode":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"
    large_broken = padding + b'"mode":"apply"'
    bodies = (
        deep,
        deep_mode,
        b"{not json",
        b'{"mode":"sideways"}',
        large_deep,
        large_broken,
        b'{"mode":"apply","x":1}',
    )
    async with stack_one.admin() as admin:
        for body in bodies:
            response = await admin.post("/refresh", content=body)
            assert response.status_code == 400, response.text
            assert "invalid refresh request" in response.json()["error"]["message"]
    lines = (tmp_path / AUDIT_FILE_NAME).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["verdict"] for r in records] == ["invalid"] * len(bodies)
    assert all(r["mode"] is None and r["outcome"] == "rejected" for r in records)
    assert "unknown field `x`" in msgspec.json.decode(lines[-1])["errors"][0]["message"]
