"""OpenAI Responses requests as chat completions requests.

`fixtures/codex_*.json` are requests Codex CLI sent (its long instructions and tool
descriptions redacted to their length; structure, tools and schemas as sent): they must
translate without error. Codex offers `web_search` unless configured not to; that one
is refused with a message saying how."""

from __future__ import annotations

from typing import Any

import pytest

from iop_node.protocols import TranslationError, responses_request_to_chat

from .translate import fixture, refusal, translated


def _chat(body: dict[str, Any]) -> dict[str, Any]:
    return translated(responses_request_to_chat, body)


def _request(input: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "served", "input": input, **fields}


def _error(body: dict[str, Any] | bytes) -> TranslationError:
    return refusal(responses_request_to_chat, body)


def _call(call_id: str, name: str = "read", **fields: Any) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}", **fields}


def test_codex_first_turn() -> None:
    request = fixture("codex_first_turn.json")
    chat = _chat(request)
    assert chat["model"] == "served-model"
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["tool_choice"] == "auto"
    assert "parallel_tool_calls" not in chat  # true is every runtime's default
    # Two developer messages are one system message; then the user's two.
    developer = [item for item in request["input"] if item["role"] == "developer"]
    texts = [part["text"] for item in developer for part in item["content"]]
    assert chat["messages"][0] == {"role": "system", "content": "\n".join(texts)}
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "user"]
    assert chat["messages"][-1] == {"role": "user", "content": "run echo LOOP"}
    # Functions by name; the namespace's members as `<namespace>__<name>`.
    names = [tool["function"]["name"] for tool in chat["tools"]]
    namespace = next(tool for tool in request["tools"] if tool["type"] == "namespace")
    members = [f"{namespace['name']}__{member['name']}" for member in namespace["tools"]]
    assert set(members) <= set(names)
    functions = [tool for tool in request["tools"] if tool["type"] == "function"]
    assert {tool["name"] for tool in functions} | set(members) == set(names)
    exec_command = next(
        t["function"] for t in chat["tools"] if t["function"]["name"] == "exec_command"
    )
    assert exec_command["parameters"] == functions[0]["parameters"]
    for dropped in ("store", "include", "prompt_cache_key", "client_metadata", "reasoning"):
        assert dropped not in chat


def test_codex_web_search_is_refused_with_the_way_out() -> None:
    request = fixture("codex_first_turn.json")
    request["tools"].append({"type": "web_search", "external_web_access": False})
    error = _error(request)
    assert error.param == f"tools[{len(request['tools']) - 1}].type"
    assert "web_search" in str(error) and 'web_search = "disabled"' in str(error)


def test_codex_tool_output_turn() -> None:
    request = fixture("codex_tool_output.json")
    chat = _chat(request)
    reasoning, message, call, output = request["input"][-4:]
    assistant, tool = chat["messages"][-2:]
    assert assistant == {
        "role": "assistant",
        "content": message["content"][0]["text"],
        "tool_calls": [
            {
                "type": "function",
                "id": call["call_id"],
                "function": {"name": "exec_command", "arguments": call["arguments"]},
            }
        ],
        "reasoning_content": reasoning["content"][0]["text"],
    }
    assert tool == {"role": "tool", "content": output["output"], "tool_call_id": call["call_id"]}


def test_string_input_and_instructions() -> None:
    chat = _chat(
        _request("hi", instructions="Be brief.", max_output_tokens=50, temperature=0.1, top_p=0.5)
    )
    assert chat == {
        "model": "served",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "temperature": 0.1,
        "top_p": 0.5,
    }


def test_items_to_messages() -> None:
    tools = [
        {"type": "function", "name": "read", "parameters": {"type": "object"}},
        {
            "type": "custom",
            "name": "apply_patch",
            "description": "Patch.",
            "format": {"type": "text"},
        },
        {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "go"}]},
    ]
    chat = _chat(
        _request(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "look"},
                        {
                            "type": "input_image",
                            "image_url": "data:image/png;base64,iVBO",
                            "detail": "low",
                        },
                    ],
                },
                {
                    "type": "reasoning",
                    "id": "rs1",
                    "summary": [{"type": "summary_text", "text": "plan"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "ok"}],
                },
                _call("c1"),
                {
                    "type": "custom_tool_call",
                    "call_id": "c2",
                    "name": "apply_patch",
                    "input": "*** Begin",
                },
                _call("c3", "go", namespace="ns"),
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [
                        {"type": "input_text", "text": "file"},
                        {"type": "input_image", "image_url": "https://x/i.png"},
                    ],
                },
                {"type": "custom_tool_call_output", "call_id": "c2", "output": "patched"},
                {"type": "function_call_output", "call_id": "c3", "output": "went"},
                {"role": "user", "content": "next"},
            ],
            tools=tools,
        )
    )
    assert chat["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64,iVBO", "detail": "low"},
                },
            ],
        },
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [
                {"type": "function", "id": "c1", "function": {"name": "read", "arguments": "{}"}},
                {
                    "type": "function",
                    "id": "c2",
                    "function": {"name": "apply_patch", "arguments": '{"input":"*** Begin"}'},
                },
                {"type": "function", "id": "c3", "function": {"name": "ns__go", "arguments": "{}"}},
            ],
            "reasoning_content": "plan",
        },
        {"role": "tool", "content": "file", "tool_call_id": "c1"},
        {"role": "tool", "content": "patched", "tool_call_id": "c2"},
        {"role": "tool", "content": "went", "tool_call_id": "c3"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://x/i.png"}}],
        },
        {"role": "user", "content": "next"},
    ]
    custom = next(t["function"] for t in chat["tools"] if t["function"]["name"] == "apply_patch")
    assert custom["parameters"]["required"] == ["input"]
    assert custom["parameters"]["properties"]["input"]["type"] == "string"
    namespaced = next(t["function"] for t in chat["tools"] if t["function"]["name"] == "ns__go")
    assert namespaced["parameters"] == {"type": "object", "properties": {}}


def test_a_custom_tool_grammar_is_in_its_description() -> None:
    tool = {
        "type": "custom",
        "name": "p",
        "description": "Patch.",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: /x+/"},
    }
    chat = _chat(_request("x", tools=[tool]))
    description = chat["tools"][0]["function"]["description"]
    assert (
        description.startswith("Patch.") and "lark" in description and "start: /x+/" in description
    )


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ({"type": "function", "name": "read"}, {"type": "function", "function": {"name": "read"}}),
        ({"type": "custom", "name": "read"}, {"type": "function", "function": {"name": "read"}}),
    ],
)
def test_tool_choice(choice: Any, expected: Any) -> None:
    tools = [{"type": "function", "name": "read", "parameters": {"type": "object"}}]
    chat = _chat(_request("x", tools=tools, tool_choice=choice, parallel_tool_calls=False))
    assert chat["tool_choice"] == expected
    assert chat["parallel_tool_calls"] is False


def test_allowed_tools_keeps_only_those() -> None:
    tools = [
        {"type": "function", "name": n, "parameters": {"type": "object"}} for n in ("a", "b", "c")
    ]
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "b"}],
    }
    chat = _chat(_request("x", tools=tools, tool_choice=choice))
    assert [t["function"]["name"] for t in chat["tools"]] == ["b"]
    assert chat["tool_choice"] == "required"


def test_text_format_and_reasoning_effort() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    chat = _chat(
        _request(
            "x",
            text={
                "format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True},
                "verbosity": "low",
            },
            reasoning={"effort": "high", "summary": "auto"},
        )
    )
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": schema, "strict": True},
    }
    assert chat["reasoning_effort"] == "high"
    assert "reasoning_effort" not in _chat(_request("x", reasoning={"effort": "minimal"}))
    assert _chat(_request("x", text={"format": {"type": "json_object"}}))["response_format"] == {
        "type": "json_object"
    }


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        pytest.param(
            _request(
                [
                    {"role": "user", "content": "x"},
                    {"type": "function_call_output", "call_id": "c9", "output": "?"},
                ]
            ),
            "input[1].call_id",
            "'c9'",
            id="output-for-an-unknown-call",
        ),
        pytest.param(
            _request([{"type": "item_reference", "id": "msg_1"}]),
            "input[0].type",
            "state",
            id="item-reference",
        ),
        pytest.param(
            _request([{"type": "web_search_call", "id": "ws", "status": "completed"}]),
            "input[0].type",
            "server-side",
            id="server-tool-call-item",
        ),
        pytest.param(
            _request([{"type": "local_shell_call", "call_id": "c", "action": {}}]),
            "input[0].type",
            "built into OpenAI's models",
            id="built-in-tool-call-item",
        ),
        pytest.param(
            _request([{"type": "hologram"}]),
            "input[0].type",
            "'hologram'",
            id="unknown-item-type",
        ),
        pytest.param(
            _request([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
            "input[0].content[0].type",
            "files",
            id="input-file",
        ),
        pytest.param(
            _request([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
            "input[0].content[0].file_id",
            "Files API",
            id="image-by-file-id",
        ),
        pytest.param(
            _request([{"role": "user", "content": [{"type": "input_text", "text": 5}]}]),
            "input[0].content[0].text",
            "Expected `str`",
            id="wrong-type",
        ),
        pytest.param(
            _request([{"role": "critic", "content": "x"}]),
            "input[0].role",
            "'critic'",
            id="unknown-role",
        ),
        pytest.param(
            _request("x", tools=[{"type": "file_search", "vector_store_ids": []}]),
            "tools[0].type",
            "server-side",
            id="server-tool",
        ),
        pytest.param(
            _request(
                "x", tools=[{"type": "function", "name": "a"}, {"type": "function", "name": "a"}]
            ),
            "tools[1].name",
            "'a'",
            id="one-name-twice",
        ),
        pytest.param(
            _request("x", tool_choice="sometimes"),
            "tool_choice",
            "'sometimes'",
            id="unknown-tool-choice",
        ),
        pytest.param(
            _request("x", tool_choice={"type": "web_search_preview"}),
            "tool_choice.type",
            "server-side",
            id="hosted-tool-choice",
        ),
        pytest.param(_request("x", background=True), "background", "background", id="background"),
        pytest.param(
            _request("x", conversation="conv_1"), "conversation", "state", id="conversation"
        ),
        pytest.param(_request("x", prompt={"id": "pmpt_1"}), "prompt", "prompts", id="prompt"),
        pytest.param(
            _request("x", text={"format": {"type": "yaml"}}),
            "text.format.type",
            "'yaml'",
            id="text-format",
        ),
        pytest.param(
            _request([_call("c1"), _call("c1")]), "input[1].call_id", "twice", id="call-id-reused"
        ),
        pytest.param(
            _request([{"role": "user", "content": "hi"}, _call("c1", arguments='{"path": ')]),
            "input[1].arguments",
            "JSON object",
            id="malformed-call-arguments",
        ),
        pytest.param(
            _request([_call("c1", arguments='["a.txt"]')]),
            "input[0].arguments",
            "JSON object",
            id="call-arguments-not-an-object",
        ),
        pytest.param(
            _request([_call("c1"), {"type": "function_call_output", "output": "ok"}]),
            "input[1]",
            "a 'function_call_output' item: Object missing required field `call_id`",
            id="item-named-by-its-type",
        ),
    ],
)
def test_what_cannot_be_translated_is_named(body: dict[str, Any], param: str, words: str) -> None:
    error = _error(body)
    assert error.param == param
    assert words in str(error)
