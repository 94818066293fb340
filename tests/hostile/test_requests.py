"""Hostile callers: bodies built to crash decoders, requests built to occupy a provider
forever or to outgrow the wire, refresh bodies built to dodge the audit log."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import msgspec

from iop_edge.core.generation_defaults import MAX_CHOICES
from iop_edge.http.request_body import MAX_JSON_DEPTH
from iop_edge.runtime.refresh.audit import AUDIT_FILE_NAME
from schemas.config import DEFAULT_MAX_TOKENS_LIMIT
from tests.e2e.stack import Stack

MESSAGES = [{"role": "user", "content": "hi"}]


def _nested(levels: int) -> bytes:
    inner = "[" * levels + "]" * levels
    return ('{"model":"m","messages":[{"role":"user","content":"x"}],"x":' + inner + "}").encode()


async def test_json_nested_too_deep_is_a_400_whatever_the_depth(stack_one: Stack) -> None:
    async with stack_one.http() as http:
        for path in ("/v1/chat/completions", "/v1/responses/input_tokens"):
            for levels in (MAX_JSON_DEPTH, 1_000, 100_000):
                response = await http.post(
                    path, content=_nested(levels), headers={"content-type": "application/json"}
                )
                assert response.status_code == 400, (path, levels, response.text)
                error = response.json()["error"]
                assert error["code"] == "invalid_json" and "nests deeper" in error["message"]
        ok = await http.post("/v1/chat/completions", content=_nested(MAX_JSON_DEPTH - 3))
        assert ok.status_code == 200, ok.text


async def test_a_compressed_body_is_a_415_naming_its_encoding(stack_one: Stack) -> None:
    body = gzip.compress(json.dumps({"model": "m", "messages": MESSAGES}).encode())
    async with stack_one.http() as http:
        response = await http.post(
            "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_content_encoding" and "'gzip'" in error["message"]
    assert response.headers["connection"] == "close"  # its body was never read


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


async def test_unreadable_model_commands_are_400s(stack_one: Stack) -> None:
    deep = b'{"model":"m","x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    async with stack_one.admin() as admin:
        for path in ("/models/load", "/models/unload", "/models/pin", "/models/unpin"):
            for body in (deep, b"{not json"):
                response = await admin.post(path, content=body)
                assert response.status_code == 400, (path, response.text)
                assert "invalid" in response.json()["error"]["message"]


async def test_responses_input_with_malformed_call_arguments_is_a_400_naming_them(
    stack_one: Stack,
) -> None:
    """A replayed `function_call` whose `arguments` are no JSON object would reach the
    runtime as a call no model made: refused, naming the field, whatever the shape."""
    history = [
        {"role": "user", "content": "read a.txt"},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    async with stack_one.http() as http:
        for arguments in ('{"path": ', '["a.txt"]', "path=a.txt", "null"):
            bad = {**history[1], "call_id": "c2", "arguments": arguments}
            body = {"model": "m", "input": [*history, bad], "tools": [_READ_TOOL]}
            response = await http.post("/v1/responses", json=body)
            assert response.status_code == 400, (arguments, response.text)
            error = response.json()["error"]
            assert error["param"] == "input[3].arguments", error
            assert "JSON object" in error["message"]
        body = {"model": "m", "input": history, "tools": [_READ_TOOL]}
        assert (await http.post("/v1/responses", json=body)).status_code == 200


_READ_TOOL = {"type": "function", "name": "read", "parameters": {"type": "object"}}


_USER = [{"role": "user", "content": "hi"}]
#: Every 400 docs/http-api.md promises for the caller protocols: (path, body, param).
_DOCUMENTED_400S = [
    ("/v1/messages", {"model": "m", "max_tokens": 10**9, "messages": _USER}, "max_tokens"),
    ("/v1/messages", {"model": "m", "max_tokens": "ten", "messages": _USER}, "max_tokens"),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": "hi"}, "messages"),
    (
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "nobody", "content": "x"}],
                }
            ],
        },
        "messages[0].content[0].tool_use_id",
    ),
    (
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 5,
            "messages": _USER,
            # a tool the caller's client runs, which only a vendor's models know (a
            # hosted one, such as web_search, is left out instead: http-api.md)
            "tools": [{"type": "bash_20250124", "name": "bash"}],
        },
        "tools[0].type",
    ),
    (
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                *_USER,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": "a"}],
                },
            ],
        },
        "messages[1].content[0].input",
    ),
    (
        "/v1/responses",
        {"model": "m", "input": "hi", "max_output_tokens": 10**9},
        "max_output_tokens",
    ),
    ("/v1/responses", {"model": "m", "input": 5}, "input"),
    (
        "/v1/responses",
        {
            "model": "m",
            "input": [{"type": "function_call_output", "call_id": "nobody", "output": "x"}],
        },
        "input[0].call_id",
    ),
    (
        "/v1/responses",
        {"model": "m", "input": "hi", "tools": [{"type": "local_shell"}]},
        "tools[0].type",
    ),
]


async def test_every_documented_400_of_the_caller_protocols_is_one(stack_one: Stack) -> None:
    async with stack_one.http() as http:
        for path, body, param in _DOCUMENTED_400S:
            response = await http.post(path, json=body)
            assert response.status_code == 400, (path, body, response.text)
            if path == "/v1/responses":
                assert response.json()["error"]["param"] == param, (body, response.text)
            else:  # Anthropic's shape has no `param`: the message names the field
                assert param in response.json()["error"]["message"], (body, response.text)
