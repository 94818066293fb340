"""The sim's `model` mode decisions (`sim_replies`): tool calls whose arguments validate
against the real agents' tool schemas, which tool, text lengths, determinism."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Final

import jsonschema
import msgspec
import pytest
import trio

from iop_node.adapters.sim.adapter import SimAdapter
from iop_node.adapters.sim.sim_replies import natural_length, plan_reply, plan_text, schema_instance
from iop_node.protocols import messages_request_to_chat, responses_request_to_chat
from schemas.config import AdapterSettings, ProviderConfig, SimReply
from schemas.wire import Run

FIXTURES: Final = Path(__file__).resolve().parents[1] / "protocols" / "fixtures"
MODEL: Final = SimReply(mode="model")


def _chat_tools(name: str) -> list[dict[str, Any]]:
    """The chat tools the Node offers a runtime for a recorded agent request."""
    body = (FIXTURES / f"{name}.json").read_bytes()
    to_chat = messages_request_to_chat if name.startswith("claude") else responses_request_to_chat
    tools: list[dict[str, Any]] = json.loads(to_chat(body))["tools"]
    return tools


AGENT_TOOLS: Final = [
    pytest.param(tool, id=f"{agent}:{tool['function']['name']}")
    for agent in ("claude_code_first_turn", "codex_first_turn")
    for tool in _chat_tools(agent)
]


@pytest.mark.parametrize("tool", AGENT_TOOLS)
def test_every_agent_tool_gets_arguments_its_schema_accepts(tool: dict[str, Any]) -> None:
    body = {
        "messages": [{"role": "user", "content": "Do it with `echo hi`."}],
        "tools": [tool],
        "tool_choice": "required",
    }
    plan = plan_reply(body, MODEL, max_tokens=100)
    assert plan.call is not None and plan.call.name == tool["function"]["name"]
    assert plan.finish_reason == "tool_calls" and plan.pieces == []
    schema = tool["function"]["parameters"]
    jsonschema.validate(json.loads(plan.call.arguments), schema)


@pytest.mark.parametrize(
    ("schema", "instance"),
    [
        ({"type": "string", "minLength": 9, "maxLength": 10}, "enginexxx"),
        ({"type": "string", "maxLength": 3}, "eng"),
        ({"type": "string", "format": "uri"}, "https://example.com/"),
        ({"type": "integer", "minimum": 2.5}, 3),
        ({"type": "integer", "exclusiveMinimum": 0, "maximum": 9}, 1),
        ({"type": "number", "exclusiveMaximum": -1}, -1.5),
        ({"type": ["null", "boolean"]}, False),
        ({"enum": ["b", "a"]}, "b"),
        ({"const": {"k": 1}}, {"k": 1}),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [0, 0]),
        ({"type": "array", "maxItems": 0}, []),
        ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "null"}], "minItems": 2},
         ["engine", None]),
        ({"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 4}]}, 4),
        (
            {
                "allOf": [
                    {"$ref": "#/$defs/a"},
                    {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
                ],
                "$defs": {"a": {"properties": {"a": {"type": "string"}}, "required": ["a"]}},
            },
            {"a": "engine", "b": False},
        ),
    ],
)  # fmt: skip
def test_the_smallest_instance_of_a_schema(schema: dict[str, Any], instance: object) -> None:
    found = schema_instance(schema)
    assert found == instance
    jsonschema.validate(found, schema)


def _tool(name: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS: Final = [_tool("search"), _tool("read_file"), _tool("write_file")]


def test_the_tool_the_prompt_names_is_called_with_its_backquoted_argument() -> None:
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<context>search</context>"}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<reminder>use search</reminder>"},
                    {"type": "text", "text": "Please write_file, then read_file: `notes.txt`"},
                ],
            },
        ],
        "tools": TOOLS,
    }
    plan = plan_reply(body, MODEL, max_tokens=100)
    assert plan.call is not None
    assert (plan.call.name, json.loads(plan.call.arguments)) == ("write_file", {"q": "notes.txt"})
    assert plan.call.id.startswith("call_")


def test_after_a_tool_result_the_reply_is_text_quoting_it() -> None:
    body: dict[str, Any] = {
        "messages": [
            {"role": "user", "content": "Use search."},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "tool_call_id": "c1", "content": "three results found"},
            {"role": "user", "content": "<reminder>keep going</reminder>"},
        ],
        "tools": TOOLS,
    }
    plan = plan_reply(body, MODEL, max_tokens=1000)
    assert plan.call is None and plan.finish_reason == "stop"
    assert "".join(plan.pieces).startswith("The tool returned: three results found")
    # `required` makes it call a tool all the same; `none` never does.
    assert plan_reply({**body, "tool_choice": "required"}, MODEL, 1000).call is not None
    fresh = {**body, "messages": body["messages"][:1], "tool_choice": "none"}
    assert plan_reply(fresh, MODEL, 1000).call is None
    named = {**fresh, "tool_choice": {"type": "function", "function": {"name": "read_file"}}}
    call = plan_reply(named, MODEL, 1000).call
    assert call is not None and call.name == "read_file"


def test_text_lengths_are_log_normal_around_the_median_and_only_capped_by_max_tokens() -> None:
    settings = SimReply(mode="model", median_tokens=40, spread=0.6)
    lengths = []
    for i in range(400):
        plan = plan_reply({"messages": [{"role": "user", "content": f"q{i}"}]}, settings, 10_000)
        assert plan.finish_reason == "stop"
        lengths.append(len(plan.pieces))
    assert 30 <= statistics.median(lengths) <= 53
    assert min(lengths) < 25 and max(lengths) > 65  # a spread, not one length
    capped = plan_reply({"messages": [{"role": "user", "content": "q1"}]}, settings, 5)
    assert (len(capped.pieces), capped.finish_reason) == (5, "length")
    assert natural_length(SimReply(mode="model", spread=0), 0.999) == 120


def test_the_same_seed_and_request_get_the_same_reply_and_another_seed_another() -> None:
    body = {"messages": [{"role": "user", "content": "Hello"}], "tools": TOOLS}
    text = {"messages": [{"role": "user", "content": "Hello"}]}
    assert plan_reply(body, MODEL, 100) == plan_reply(body, MODEL, 100)
    seeds = [SimReply(mode="model", seed=seed) for seed in range(8)]
    replies = {plan_reply(text, settings, 1000).pieces[0] for settings in seeds}
    calls = {plan_reply(body, settings, 100).call for settings in seeds}
    assert len(replies) > 1 and len(calls) > 1


async def test_the_adapter_streams_a_tool_call_in_fragments_ending_tool_calls() -> None:
    adapter = SimAdapter(
        ProviderConfig(
            id="sim",
            type="sim",
            models=["s"],
            capacity=1,
            adapter=AdapterSettings(ttft_ms=0, tokens_per_second=1e6, reply=MODEL),
        )
    )
    body = {
        "messages": [{"role": "user", "content": "search for `a long query string`"}],
        "tools": TOOLS,
        "stream_options": {"include_usage": True},
    }
    run = Run(
        run_id="r", provider_id="sim", target="s", operation="chat",
        body=msgspec.json.encode(body), stream=True,
    )  # fmt: skip
    chunks: list[dict[str, Any]] = []

    async def emit(data: bytes, parsed: object = None, /) -> None:
        chunks.append(json.loads(data))

    with trio.fail_after(5):
        result = await adapter.execute(run, emit)
    fragments = [
        call
        for chunk in chunks
        for choice in chunk["choices"]
        for call in choice["delta"].get("tool_calls", ())
    ]
    assert len(fragments) > 1 and fragments[0]["function"]["name"] == "search"
    assert all("name" not in f["function"] and "id" not in f for f in fragments[1:])
    arguments = "".join(f["function"]["arguments"] for f in fragments)
    assert json.loads(arguments) == {"q": "a long query string"}
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert result.usage is not None
    assert (
        chunks[-1]["usage"]["completion_tokens"] == result.usage.completion_tokens == len(fragments)
    )


def test_a_text_completion_ends_by_itself_too() -> None:
    plans = [plan_text({"prompt": f"Once upon a time {i}"}, MODEL, 10_000) for i in range(20)]
    assert {plan.finish_reason for plan in plans} == {"stop"}
    assert len({len(plan.pieces) for plan in plans}) > 1
    capped = plan_text({"prompt": "Once upon a time"}, MODEL, 2)
    assert (len(capped.pieces), capped.finish_reason) == (2, "length")


def test_a_text_ends_before_its_first_stop_string() -> None:
    """Rule 7: a runtime stops before the stop string, and does not send it."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Tell me a story"}]}
    whole = "".join(plan_reply(body, MODEL, 10_000).pieces)
    word = whole.split()[len(whole.split()) // 2]
    stopped = plan_reply({**body, "stop": ["never-said", word]}, MODEL, 10_000)
    text = "".join(stopped.pieces)
    assert text == whole[: whole.find(word)]
    assert stopped.finish_reason == "stop"
    mid = whole[whole.find(word) + 1 : whole.find(word) + 4]  # inside a token
    assert (
        "".join(plan_reply({**body, "stop": mid}, MODEL, 10_000).pieces) == whole[: whole.find(mid)]
    )
    assert plan_reply({**body, "stop": "never-said"}, MODEL, 10_000).pieces == (
        plan_reply(body, MODEL, 10_000).pieces
    )
    completion = plan_text({"prompt": "Once", "stop": "engine"}, MODEL, 10_000)
    assert "engine" not in "".join(completion.pieces)
