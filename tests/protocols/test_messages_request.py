"""Anthropic Messages requests as chat completions requests.

`fixtures/claude_code_*.json` are requests Claude Code sent (its long prompt and tool
descriptions redacted to their length; structure, tools and schemas as sent): they must
translate without error, with nothing the runtime needs left behind."""

from __future__ import annotations

import json
from typing import Any

import pytest

from iop_node.protocols import TranslationError, messages_request_to_chat

from .translate import fixture, refusal, translated


def _chat(body: dict[str, Any]) -> dict[str, Any]:
    return translated(messages_request_to_chat, body)


def _request(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "served", "max_tokens": 100, "messages": list(messages), **fields}


def _error(body: dict[str, Any] | bytes) -> TranslationError:
    return refusal(messages_request_to_chat, body)


def test_claude_code_first_turn() -> None:
    request = fixture("claude_code_first_turn.json")
    chat = _chat(request)
    assert chat["model"] == "served-model"
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["max_tokens"] == 64000
    # The system blocks (cache_control and all) are one system message, in order.
    system = chat["messages"][0]
    assert system["role"] == "system"
    assert system["content"] == "\n".join(block["text"] for block in request["system"])
    # The mid-conversation system message stays where Claude Code put it.
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "system"]
    assert chat["messages"][2]["content"] == request["messages"][1]["content"]
    # Every tool is a function tool whose parameters are its input_schema, as sent.
    assert [t["function"]["name"] for t in chat["tools"]] == [t["name"] for t in request["tools"]]
    for tool, original in zip(chat["tools"], request["tools"], strict=True):
        assert tool["type"] == "function"
        assert tool["function"]["parameters"] == original["input_schema"]
        assert tool["function"]["description"] == original["description"]
    # What a chat runtime has no use for is not sent on.
    for dropped in ("thinking", "context_management", "metadata", "output_config", "system"):
        assert dropped not in chat


def test_claude_code_tool_result_turn() -> None:
    request = fixture("claude_code_tool_result.json")
    chat = _chat(request)
    assistant, tool = chat["messages"][-2:]
    turn = request["messages"][-2]["content"]
    thinking = next(b for b in turn if b["type"] == "thinking")
    text = next(b for b in turn if b["type"] == "text")
    call = next(b for b in turn if b["type"] == "tool_use")
    assert assistant["role"] == "assistant"
    assert assistant["content"] == text["text"]
    assert assistant["reasoning_content"] == thinking["thinking"]
    [tool_call] = assistant["tool_calls"]
    assert tool_call["id"] == call["id"] and tool_call["type"] == "function"
    assert tool_call["function"]["name"] == call["name"]
    assert json.loads(tool_call["function"]["arguments"]) == call["input"]
    assert tool == {"role": "tool", "content": "LOOP", "tool_call_id": call["id"]}


def test_text_only_content_is_a_string_and_images_are_parts() -> None:
    chat = _chat(
        _request(
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": "ok"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                    },
                    {
                        "type": "image",
                        "source": {"type": "url", "url": "https://example.com/x.jpg"},
                    },
                ],
            },
        )
    )
    assert chat["messages"][0] == {"role": "user", "content": "a\nb"}
    assert chat["messages"][2]["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/x.jpg"}},
    ]


def _called(*ids: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": call, "name": "read", "input": {"path": call}}
            for call in ids
        ],
    }


def test_tool_results_come_first_then_the_rest_of_the_turn() -> None:
    chat = _chat(
        _request(
            {"role": "user", "content": "read two files"},
            _called("t1", "t2"),
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "not found"},
                            {"type": "image", "source": {"type": "url", "url": "https://x/s.png"}},
                        ],
                    },
                    {"type": "text", "text": "and now?"},
                ],
            },
        )
    )
    assert chat["messages"][1]["content"] == ""  # Rule 2: never null
    assert [c["id"] for c in chat["messages"][1]["tool_calls"]] == ["t1", "t2"]
    assert chat["messages"][2:] == [
        {"role": "tool", "content": "one", "tool_call_id": "t1"},
        {"role": "tool", "content": "Error: not found", "tool_call_id": "t2"},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "https://x/s.png"}},
                {"type": "text", "text": "and now?"},
            ],
        },
    ]


def test_settings() -> None:
    chat = _chat(
        _request(
            {"role": "user", "content": "hi"},
            temperature=0.2,
            top_p=0.9,
            top_k=40,
            stop_sequences=["END"],
            stream=False,
            thinking={"type": "enabled", "budget_tokens": 1024},
            metadata={"user_id": "u"},
            service_tier="auto",
        )
    )
    assert chat == {
        "model": "served",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100,
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "stop": ["END"],
    }


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any"}, "required", None),
        ({"type": "none"}, "none", None),
        (
            {"type": "tool", "name": "read"},
            {"type": "function", "function": {"name": "read"}},
            None,
        ),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any, parallel: bool | None) -> None:
    tools = [
        {"name": "read", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    ]
    chat = _chat(_request({"role": "user", "content": "x"}, tools=tools, tool_choice=choice))
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == expected
    assert chat.get("parallel_tool_calls") == parallel


def test_what_carries_nothing_for_a_runtime_is_left_out() -> None:
    chat = _chat(
        _request(
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "redacted_thinking", "data": "c2VhbGVk"},
                    {"type": "text", "text": "hello", "citations": None},
                ],
            },
        )
    )
    assert chat["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]


def _user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def _assistant(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": list(blocks)}


def _assert_named(body: dict[str, Any], param: str, words: str) -> None:
    """The refusal names the field first (the message starts with its path), then why."""
    error = _error(body)
    assert error.param == param
    assert str(error).startswith(param)
    assert words in str(error)


_PDF = {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}


@pytest.mark.parametrize(
    ("block", "field", "words"),
    [
        pytest.param({"type": "video", "url": "x"}, "type", "unknown type 'video'", id="video"),
        pytest.param({"type": "thinking", "thinking": "x"}, "type", "'thinking'", id="thinking"),
        pytest.param({"type": "document", "source": _PDF}, "source.type", "PDF", id="pdf"),
        pytest.param(
            {"type": "image", "source": {"type": "file", "file_id": "f1"}},
            "source.type",
            "Files API",
            id="image-by-file-id",
        ),
    ],
)
def test_a_user_block_that_cannot_be_translated_is_named(
    block: dict[str, Any], field: str, words: str
) -> None:
    _assert_named(_request(_user([block])), f"messages[0].content[0].{field}", words)


@pytest.mark.parametrize(
    ("tool", "field", "words"),
    [
        pytest.param(
            {"type": "web_search_20250305", "name": "web_search"},
            "type",
            "server-side",
            id="server-tool",
        ),
        pytest.param(
            {"type": "bash_20250124", "name": "bash"},
            "type",
            "Anthropic-defined",
            id="anthropic-defined-tool",
        ),
        pytest.param({"name": "f"}, "input_schema", "input_schema", id="custom-without-schema"),
    ],
)
def test_a_tool_that_cannot_be_offered_is_named(
    tool: dict[str, Any], field: str, words: str
) -> None:
    _assert_named(_request(_user("x"), tools=[tool]), f"tools[0].{field}", words)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        pytest.param(
            _request(
                _user("search"),
                _assistant(
                    {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}
                ),
            ),
            "messages[1].content[0].type",
            "server-side",
            id="server-tool-block",
        ),
        pytest.param(
            _request(
                _user("x"),
                _called("t1"),
                _user([{"type": "tool_result", "tool_use_id": "t9", "content": "?"}]),
            ),
            "messages[2].content[0].tool_use_id",
            "'t9'",
            id="tool-result-for-an-unknown-call",
        ),
        pytest.param(
            _request(
                _user("x"), _assistant({"type": "tool_use", "id": "t", "name": "f", "input": "[1]"})
            ),
            "messages[1].content[0].input",
            "JSON object",
            id="tool-use-input-not-an-object",
        ),
        pytest.param(
            _request(_user("x"), _called("t1"), _called("t1")),
            "messages[2].content[0].id",
            "twice",
            id="tool-use-id-reused",
        ),
        pytest.param(_request(_user(7)), "messages[0].content", "Expected", id="wrong-type"),
        pytest.param(
            _request({"role": "tool", "content": "x"}),
            "messages[0].role",
            "'tool'",
            id="unknown-role",
        ),
        pytest.param(
            _request(_user("x"), mcp_servers=[{"type": "url", "url": "https://m"}]),
            "mcp_servers",
            "MCP",
            id="mcp-servers",
        ),
    ],
)
def test_what_cannot_be_translated_is_named(body: dict[str, Any], param: str, words: str) -> None:
    _assert_named(body, param, words)


def test_a_body_that_is_not_json() -> None:
    error = _error(b"{not json")
    assert error.param is None and "not valid JSON" in str(error)


def test_plain_text_document_is_text() -> None:
    document = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "notes"},
    }
    chat = _chat(
        _request({"role": "user", "content": [document, {"type": "text", "text": "sum up"}]})
    )
    assert chat["messages"] == [{"role": "user", "content": "notes\nsum up"}]
