"""The `sim` in `model` mode behaves like a model in every protocol, stream and not: it
calls an offered tool with arguments valid against the tool's schema, answers the tool's
result with text that quotes it, and ends a text by itself (`max_tokens` only caps it).

The callers are the official SDKs, through a real Edge and Node: the sim speaks chat, and
the Node translates its tool calls and texts to Messages and Responses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import anthropic
import jsonschema
import pytest
import trio

from tests.e2e.stack import WAIT_GUARD_S, Stack, edge_config, sim_provider, start_stack

MODEL: Final = "m"
TOOL_OUTPUT: Final = "sunny and 21 degrees"
PROMPT: Final = "What is the weather in `Lisbon`? Use the get_weather tool."
SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "detail": {"$ref": "#/$defs/detail"},
        "note": {"type": "string"},
    },
    "required": ["city", "unit", "days", "detail"],
    "additionalProperties": False,
    "$defs": {
        "detail": {
            "type": "object",
            "properties": {"hourly": {"type": "boolean"}, "fields": {"type": "array"}},
            "required": ["hourly", "fields"],
        }
    },
}
#: A second tool, so the sim must pick the one the prompt names.
OTHER_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {"query": {"type": "string"}},
    "required": ["query"],
}


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    adapter = {"ttft_ms": 1, "tokens_per_second": 5000, "reply": {"mode": "model", "seed": 7}}
    text = edge_config(
        tmp_path / "state",
        providers=[sim_provider("sim-1", adapter=adapter)],
        models=[{"id": MODEL, "providers": {"sim-1": "sim-small"}}],
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=(MODEL,))


def _check_arguments(arguments: dict[str, Any]) -> None:
    jsonschema.validate(arguments, SCHEMA)
    assert arguments["city"] == "Lisbon"  # the prompt's backquoted span, as a model would


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_calls_the_tool_then_answers_with_its_result(stack: Stack, stream: bool) -> None:
    tools: list[Any] = [
        {"type": "function", "function": {"name": "search", "parameters": OTHER_SCHEMA}},
        {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    ]
    messages: list[Any] = [{"role": "user", "content": PROMPT}]
    async with stack.client() as client:
        if stream:
            async with client.chat.completions.stream(
                model=MODEL, messages=messages, tools=tools, max_tokens=32000
            ) as events:
                first = await events.get_final_completion()
        else:
            first = await client.chat.completions.create(
                model=MODEL, messages=messages, tools=tools, max_tokens=32000
            )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls or []
        assert call.type == "function" and call.function.name == "get_weather"
        _check_arguments(json.loads(call.function.arguments))

        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": TOOL_OUTPUT},
        ]
        second = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, max_tokens=32000
        )
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert answer.message.content is not None
    assert answer.message.content.startswith(f"The tool returned: {TOOL_OUTPUT}")
    assert second.usage is not None
    assert second.usage.completion_tokens == len(answer.message.content.split())


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_calls_the_tool_then_answers_with_its_result(
    stack: Stack, stream: bool
) -> None:
    tools: list[Any] = [
        {"name": "search", "input_schema": OTHER_SCHEMA},
        {"name": "get_weather", "description": "The weather.", "input_schema": SCHEMA},
    ]
    messages: list[Any] = [{"role": "user", "content": PROMPT}]
    async with anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url, api_key="open", max_retries=0, timeout=WAIT_GUARD_S
    ) as client:
        if stream:
            async with client.messages.stream(
                model=MODEL, max_tokens=32000, messages=messages, tools=tools
            ) as events:
                first = await events.get_final_message()
        else:
            first = await client.messages.create(
                model=MODEL, max_tokens=32000, messages=messages, tools=tools
            )
        assert first.stop_reason == "tool_use"
        [use] = [block for block in first.content if block.type == "tool_use"]
        assert use.name == "get_weather"
        _check_arguments(dict(use.input))  # type: ignore[call-overload]

        messages += [
            {"role": "assistant", "content": [use.model_dump()]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_OUTPUT}],
            },
        ]
        if stream:
            async with client.messages.stream(
                model=MODEL, max_tokens=32000, messages=messages, tools=tools
            ) as events:
                second = await events.get_final_message()
        else:
            second = await client.messages.create(
                model=MODEL, max_tokens=32000, messages=messages, tools=tools
            )
    assert second.stop_reason == "end_turn"
    [text] = second.content
    assert text.type == "text" and text.text.startswith(f"The tool returned: {TOOL_OUTPUT}")


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_calls_the_tool_then_answers_with_its_result(
    stack: Stack, stream: bool
) -> None:
    tools: list[Any] = [
        {"type": "function", "name": "search", "parameters": OTHER_SCHEMA, "strict": False},
        {"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": False},
    ]
    async with stack.client() as client:

        async def respond(items: list[Any]) -> Any:
            if not stream:
                return await client.responses.create(
                    model=MODEL, input=items, tools=tools, store=False
                )
            async with client.responses.stream(
                model=MODEL, input=items, tools=tools, store=False
            ) as events:
                return await events.get_final_response()

        items: list[Any] = [{"role": "user", "content": PROMPT}]
        first = await respond(items)
        assert first.status == "completed"
        [call] = [item for item in first.output if item.type == "function_call"]
        assert call.name == "get_weather"
        _check_arguments(json.loads(call.arguments))

        items += [
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_OUTPUT},
        ]
        second = await respond(items)
    assert second.status == "completed"
    assert not [item for item in second.output if item.type == "function_call"]
    assert second.output_text.startswith(f"The tool returned: {TOOL_OUTPUT}")


async def test_a_text_ends_by_itself_and_max_tokens_only_caps_it(stack: Stack) -> None:
    lengths: set[int] = set()
    async with stack.client() as client:
        for question in ("How are you?", "Tell me a story.", "Why is the sky blue?"):
            reply = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=32000
            )
            assert reply.choices[0].finish_reason == "stop"
            assert reply.usage is not None and 0 < reply.usage.completion_tokens < 32000
            lengths.add(reply.usage.completion_tokens)
            again = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=32000
            )
            assert again.choices[0].message.content == reply.choices[0].message.content

        capped = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=3
        )
        assert capped.choices[0].finish_reason == "length"
        assert capped.usage is not None and capped.usage.completion_tokens == 3
    assert len(lengths) > 1, "every reply had the same length"
