"""What the Edge reads of Messages and Responses requests
(iop_edge.core.responses.protocol_requests):
the views' checks and the input token estimate that long-context admission uses."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from iop_edge.core.responses.protocol_requests import (
    CountTokensRequest,
    MessagesRequest,
    ResponsesRequest,
    estimate_messages_tokens,
    estimate_responses_tokens,
    input_items,
    openai_tool_choice_problem,
)
from iop_edge.http.errors import invalid_request
from schemas.tokens import IMPLIED_SYSTEM_TOKENS, TOKENS_PER_MESSAGE, TOKENS_PER_REQUEST

_encode = msgspec.json.encode


def framing(messages: int, *, system: bool) -> int:
    """The chat template's share, by `schemas.tokens`'s rule for chat."""
    implied = 0 if system else IMPLIED_SYSTEM_TOKENS
    return TOKENS_PER_MESSAGE * messages + TOKENS_PER_REQUEST + implied


def _messages(**body: Any) -> MessagesRequest:
    return msgspec.convert({"model": "m", "max_tokens": 16, **body}, MessagesRequest)


def _responses(**body: Any) -> ResponsesRequest:
    return msgspec.convert({"model": "m", **body}, ResponsesRequest)


# --- Messages -----------------------------------------------------------------------


def test_messages_estimate_counts_every_text_and_frames_each_message() -> None:
    tool_input = {"path": "/etc/hosts"}
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    request = _messages(
        system=[{"type": "text", "text": "s" * 40}],
        messages=[
            {"role": "user", "content": "u" * 100},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "t" * 20, "signature": "x" * 999},
                    {"type": "text", "text": "a" * 8},
                    {"type": "tool_use", "id": "toolu_1", "name": "read", "input": tool_input},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "r" * 12}],
                    },
                    {"type": "image", "source": {"type": "base64", "data": "A" * 5000}},
                ],
            },
        ],
        tools=[{"name": "read", "description": "d" * 10, "input_schema": schema}],
    )
    chars = 40 + 100 + 20 + 8 + len("read") + len(_encode(tool_input)) + 12
    chars += len("read") + 10 + len(_encode(schema))
    # three messages and the system prompt are framed; the signature and the image are not text
    assert estimate_messages_tokens(request) == -(-chars // 4) + framing(4, system=True)


def test_a_string_system_prompt_counts_like_a_text_block() -> None:
    as_text = _messages(system="x" * 30, messages=[{"role": "user", "content": "hi"}])
    as_block = _messages(
        system=[{"type": "text", "text": "x" * 30}], messages=[{"role": "user", "content": "hi"}]
    )
    assert estimate_messages_tokens(as_text) == estimate_messages_tokens(as_block)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 8, "messages": []}, "messages"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": "y"},
            "stream",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": {"type": "required"},
            },
            "tool_choice.type",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": "auto",
            },
            "tool_choice",
        ),
    ],
)
def test_a_wrong_messages_field_is_named(body: dict[str, Any], field: str) -> None:
    with pytest.raises(msgspec.ValidationError) as raised:
        msgspec.convert({"model": "m", **body}, MessagesRequest)
    error = invalid_request(raised.value)  # the 400 the caller gets
    assert (error.status, error.param) == (400, field)


def test_a_tool_choice_names_a_tool_of_the_request() -> None:
    hi = [{"role": "user", "content": "hi"}]
    tools = [{"name": f"tool_{n}", "input_schema": {"type": "object"}} for n in range(12)]

    def problem(**body: Any) -> str | None:
        return _messages(messages=hi, **body).tool_choice_problem()

    for choice in ({"type": "auto"}, {"type": "any"}, {"type": "none"}, None):
        assert problem(tool_choice=choice) is None
    assert problem(tools=tools, tool_choice={"type": "tool", "name": "tool_11"}) is None
    assert problem(tools=tools, tool_choice={"type": "tool"}) == (
        "tool_choice of type tool names the tool: `name` is required"
    )
    assert problem(tool_choice={"type": "tool", "name": "read"}) == (
        "tool_choice names the tool 'read', but the request has no tools"
    )
    unknown = problem(tools=tools, tool_choice={"type": "tool", "name": "read"})
    assert unknown is not None
    assert unknown.startswith("tool_choice names the tool 'read', which is not in tools ('tool_0'")
    assert unknown.endswith("'tool_9' and 2 more)")


def test_count_tokens_needs_no_max_tokens() -> None:
    view = msgspec.convert(
        {"model": "m", "messages": [{"role": "user", "content": "abcd" * 5}]}, CountTokensRequest
    )
    assert estimate_messages_tokens(view) == 5 + framing(1, system=False)


def test_unknown_block_types_and_fields_pass() -> None:
    request = _messages(
        messages=[
            {
                "role": "user",
                "content": [{"type": "server_tool_use", "whatever": [1, 2]}],
                "cache_control": {"type": "ephemeral"},
            }
        ],
        metadata={"user_id": "u"},
    )
    assert estimate_messages_tokens(request) == framing(1, system=False)


# --- Responses ------------------------------------------------------------------------


def test_responses_estimate_counts_instructions_items_and_tools() -> None:
    request = _responses(
        instructions="i" * 16,
        input=[
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "q" * 20}],
            },
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": '{"d":"."}'},
            {"type": "function_call_output", "call_id": "c1", "output": "o" * 30},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r" * 6}]},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_image", "image_url": "data:" + "A" * 999}],
            },
        ],
        tools=[
            {
                "type": "function",
                "name": "ls",
                "description": "list",
                "parameters": {"type": "object"},
            }
        ],
    )
    chars = 16 + 20 + len("ls") + len('{"d":"."}') + 30 + 6
    chars += len("ls") + len("list") + len(_encode({"type": "object"}))
    assert estimate_responses_tokens(request) == -(-chars // 4) + framing(6, system=True)


def test_a_string_input_is_one_user_message() -> None:
    request = _responses(input="hello there")
    assert estimate_responses_tokens(request) == -(-11 // 4) + framing(1, system=False)
    assert input_items("hello there") == [
        {"type": "message", "role": "user", "content": "hello there"}
    ]


def test_earlier_turns_of_a_conversation_count_too() -> None:
    request = _responses(input="next")
    earlier = [
        {"type": "message", "role": "user", "content": "a" * 40},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "b" * 40}],
        },
        {"type": "web_search_call", "content": {"odd": "shape"}},  # not a shape the view knows
    ]
    odd = len(_encode(earlier[2]))
    stored = [msgspec.Raw(_encode(item)) for item in earlier]  # as the store keeps them
    assert estimate_responses_tokens(request, stored) == -(-(4 + 80 + odd) // 4) + framing(
        4, system=False
    )


def test_a_developer_message_is_the_system_prompt_of_a_responses_request() -> None:
    request = _responses(
        input=[{"role": "developer", "content": "abcd"}, {"role": "user", "content": "efgh"}]
    )
    assert estimate_responses_tokens(request) == 2 + framing(2, system=True)


def test_store_defaults_to_true_and_previous_id_must_be_a_string() -> None:
    assert _responses(input="x").store is True
    assert _responses(input="x", store=False).store is False
    with pytest.raises(msgspec.ValidationError, match=r"\$\.previous_response_id"):
        _responses(input="x", previous_response_id=7)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.max_output_tokens"):
        _responses(input="x", max_output_tokens=0)


CHAT_TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "read"}, {"type": "web_search"}]


@pytest.mark.parametrize(
    ("choice", "tools", "nested", "problem"),
    [
        ("auto", None, True, None),
        ("none", None, True, None),
        ("required", CHAT_TOOLS, True, None),
        ("required", None, True, "tool_choice 'required' needs tools"),
        ("required", [], False, "tool_choice 'required' needs tools"),
        ({"type": "function", "function": {"name": "read"}}, CHAT_TOOLS, True, None),
        (
            {"type": "function", "function": {"name": "write"}},
            CHAT_TOOLS,
            True,
            "tool_choice names the tool 'write', which is not in tools ('read')",
        ),
        ({"type": "function", "function": {}}, CHAT_TOOLS, True, "`function.name` is required"),
        ({"type": "function", "name": "read"}, RESPONSES_TOOLS, False, None),
        (
            {"type": "function", "name": "write"},
            None,
            False,
            "tool_choice names the tool 'write', but the request has no tools",
        ),
        ({"type": "function"}, RESPONSES_TOOLS, False, "`name` is required"),
        ({"type": "web_search"}, RESPONSES_TOOLS, False, None),  # the runtime's to judge
        ("sideways", CHAT_TOOLS, True, None),  # likewise
    ],
)
def test_an_openai_tool_choice_no_tool_meets_is_named(
    choice: object, tools: object, nested: bool, problem: str | None
) -> None:
    found = openai_tool_choice_problem(choice, tools, nested=nested)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found
