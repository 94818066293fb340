"""The scripted upstream speaks each protocol well enough for the official SDKs.

The agent tests trust the scripted upstream as a native runtime; here the `anthropic`
and `openai` SDKs, with no IOP in between, play both turns of the script against it,
stream and non-stream, so a fault of the fake never passes for a fault of IOP.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
import trio

from tests.agents.script import DONE, MARKER, PROMPT, SHELL_COMMAND, SIDE_ANSWER
from tests.agents.scripted_upstream import ScriptedUpstream

FINAL = f"{DONE} {MARKER}"
SHELL_OUTPUT = f"{MARKER}\n"
_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}}


@pytest.fixture
async def upstream(nursery: trio.Nursery) -> AsyncIterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    await nursery.start(server.serve)
    yield server


def _anthropic(upstream: ScriptedUpstream) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=upstream.root_url, api_key="k", max_retries=0)


def _openai(upstream: ScriptedUpstream) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=upstream.base_url, api_key="k", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_messages_loop_with_the_anthropic_sdk(
    upstream: ScriptedUpstream, stream: bool
) -> None:
    tools: Any = [{"name": "Bash", "description": "run", "input_schema": _SCHEMA}]
    messages: list[Any] = [{"role": "user", "content": PROMPT}]

    async def turn() -> anthropic.types.Message:
        async with _anthropic(upstream) as client:
            if not stream:
                return await client.messages.create(
                    model="m", max_tokens=64, tools=tools, messages=messages
                )
            async with client.messages.stream(
                model="m", max_tokens=64, tools=tools, messages=messages
            ) as events:
                return await events.get_final_message()

    first = await turn()
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "Bash"
    assert call.input == {"command": SHELL_COMMAND, "description": "Print the IOP probe marker"}

    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": SHELL_OUTPUT}],
        },
    ]
    second = await turn()
    assert second.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "text", None)) for b in second.content] == [("text", FINAL)]
    assert second.usage.input_tokens > 0 and second.usage.output_tokens > 0

    async with _anthropic(upstream) as client:
        counted = await client.messages.count_tokens(model="m", messages=messages)
    assert counted.input_tokens > 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_responses_loop_with_the_openai_sdk(upstream: ScriptedUpstream, stream: bool) -> None:
    tools: Any = [{"type": "function", "name": "exec_command", "parameters": _SCHEMA}]
    items: list[Any] = [{"role": "user", "content": PROMPT}]

    async def turn() -> openai.types.responses.Response:
        async with _openai(upstream) as client:
            if not stream:
                return await client.responses.create(model="m", input=items, tools=tools)
            events = await client.responses.create(model="m", input=items, tools=tools, stream=True)
            kinds = [event async for event in events]
        assert kinds[0].type == "response.created" and kinds[-1].type == "response.completed"
        assert [e.sequence_number for e in kinds] == list(range(len(kinds)))
        completed = kinds[-1]
        assert isinstance(completed, openai.types.responses.ResponseCompletedEvent)
        return completed.response

    first = await turn()
    (call,) = first.output
    assert call.type == "function_call" and call.name == "exec_command"
    assert json.loads(call.arguments) == {"cmd": SHELL_COMMAND}

    items += [
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": SHELL_OUTPUT},
    ]
    second = await turn()
    assert second.output_text == FINAL
    assert second.usage is not None and second.usage.output_tokens > 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_chat_loop_with_the_openai_sdk(upstream: ScriptedUpstream, stream: bool) -> None:
    tools: Any = [{"type": "function", "function": {"name": "Bash", "parameters": _SCHEMA}}]
    messages: list[Any] = [{"role": "user", "content": PROMPT}]

    async def turn() -> tuple[str | None, list[Any], str | None]:
        async with _openai(upstream) as client:
            if not stream:
                done = await client.chat.completions.create(
                    model="m", messages=messages, tools=tools
                )
                choice = done.choices[0]
                made = [c.model_dump() for c in choice.message.tool_calls or []]
                return choice.message.content, made, choice.finish_reason
            chunks = await client.chat.completions.create(
                model="m",
                messages=messages,
                tools=tools,
                stream=True,
                stream_options={"include_usage": True},
            )
            text = ""
            calls: list[dict[str, Any]] = []
            finish: str | None = None
            async for chunk in chunks:
                if not chunk.choices:
                    assert chunk.usage is not None and chunk.usage.completion_tokens > 0
                    continue
                delta = chunk.choices[0].delta
                text += delta.content or ""
                for part in delta.tool_calls or []:
                    if part.id:
                        calls.append({"id": part.id, "function": {"name": "", "arguments": ""}})
                    function = calls[part.index]["function"]
                    function["name"] += (part.function and part.function.name) or ""
                    function["arguments"] += (part.function and part.function.arguments) or ""
                finish = chunk.choices[0].finish_reason or finish
            return text or None, calls, finish

    _, calls, finish = await turn()
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["function"]["name"] == "Bash"
    assert json.loads(calls[0]["function"]["arguments"])["command"] == SHELL_COMMAND

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [{**calls[0], "type": "function"}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": SHELL_OUTPUT},
    ]
    text, calls, finish = await turn()
    assert (text, calls, finish) == (FINAL, [], "stop")


async def test_side_requests_get_a_short_answer_and_unspoken_protocols_a_404(
    nursery: trio.Nursery,
) -> None:
    chat_only = ScriptedUpstream(protocols=("chat",))
    await nursery.start(chat_only.serve)
    async with _openai(chat_only) as client:
        titled = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Write a title for: " + PROMPT}]
        )
    assert titled.choices[0].message.content == SIDE_ANSWER  # no tools offered
    async with _anthropic(chat_only) as client:
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(
                model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]
            )
    assert [(ex.path, ex.status) for ex in chat_only.exchanges] == [
        ("/v1/chat/completions", 200),
        ("/v1/messages", 404),
    ]
