"""Checks that a body or stream event IOP writes is what the official clients declare.

Two sources: the official SDKs' models (`openai`, `anthropic`: types, enums, nesting),
and, for the members those models leave optional in Python but the specifications
require, the tables below. Each table is the required (always-present, possibly `null`)
members of one object, as the Open Responses OpenAPI schema (`ResponseResource`,
`FunctionTool`, ...) and the Anthropic TypeScript SDK's declarations (`Message`, `Usage`,
`MessageDeltaUsage`, ..., declared `name: T | null`, not `name?: T`) list them. A member
that a newer schema adds is added here by hand: the tables are what IOP promises.
"""

from __future__ import annotations

import typing
from typing import Any, Final

import anthropic.types as anthropic_types
import openai.types.responses as openai_responses
import pydantic

__all__ = [
    "check_message",
    "check_messages_error",
    "check_messages_event",
    "check_response",
    "check_responses_event",
]

# --- Open Responses (openresponses.org, `public/openapi/openapi.json`) -------------------

RESPONSE: Final = frozenset(
    {
        "id", "object", "created_at", "completed_at", "status", "incomplete_details",
        "model", "previous_response_id", "instructions", "output", "error", "tools",
        "tool_choice", "truncation", "parallel_tool_calls", "text", "top_p",
        "presence_penalty", "frequency_penalty", "top_logprobs", "temperature",
        "reasoning", "usage", "max_output_tokens", "max_tool_calls", "store",
        "background", "service_tier", "metadata", "safety_identifier", "prompt_cache_key",
    }
)  # fmt: skip
FUNCTION_TOOL: Final = frozenset({"type", "name", "description", "parameters", "strict"})
USAGE: Final = frozenset(
    {"input_tokens", "output_tokens", "total_tokens", "input_tokens_details",
     "output_tokens_details"}
)  # fmt: skip
ITEMS: Final[dict[str, frozenset[str]]] = {
    "message": frozenset({"type", "id", "status", "role", "content"}),
    "function_call": frozenset({"type", "id", "call_id", "name", "arguments", "status"}),
    "reasoning": frozenset({"type", "id", "summary"}),
}
PARTS: Final[dict[str, frozenset[str]]] = {
    "output_text": frozenset({"type", "text", "annotations"}),
    "refusal": frozenset({"type", "refusal"}),
    "reasoning_text": frozenset({"type", "text"}),
}
ERROR: Final = frozenset({"code", "message"})

# --- Anthropic (the TypeScript SDK's declarations) ----------------------------------------

MESSAGE: Final = frozenset(
    {"id", "container", "content", "model", "role", "stop_details", "stop_reason",
     "stop_sequence", "type", "usage"}
)  # fmt: skip
MESSAGE_USAGE: Final = frozenset(
    {"cache_creation", "cache_creation_input_tokens", "cache_read_input_tokens",
     "inference_geo", "input_tokens", "output_tokens", "output_tokens_details",
     "server_tool_use", "service_tier"}
)  # fmt: skip
DELTA_USAGE: Final = frozenset(
    {"cache_creation_input_tokens", "cache_read_input_tokens", "input_tokens",
     "output_tokens", "output_tokens_details", "server_tool_use"}
)  # fmt: skip
DELTA: Final = frozenset({"container", "stop_details", "stop_reason", "stop_sequence"})
BLOCKS: Final[dict[str, frozenset[str]]] = {
    "text": frozenset({"citations", "text", "type"}),
    "thinking": frozenset({"signature", "thinking", "type"}),
    "tool_use": frozenset({"id", "caller", "input", "name", "type"}),
}
ANTHROPIC_ERROR: Final = frozenset({"error", "request_id", "type"})


def _by_type(union: Any) -> dict[str, type[pydantic.BaseModel]]:
    """A union of event models, by the `type` each one's literal names."""
    members = typing.get_args(
        typing.get_args(union)[0] if typing.get_origin(union) is typing.Annotated else union
    )
    return {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in members}


_RESPONSES_EVENTS: Final = _by_type(openai_responses.ResponseStreamEvent)
_MESSAGES_EVENTS: Final = _by_type(anthropic_types.RawMessageStreamEvent)


def _has(obj: dict[str, Any], required: frozenset[str], what: str) -> None:
    missing = sorted(required - obj.keys())
    assert not missing, f"{what} lacks {missing}: {obj}"


def _check_item(item: dict[str, Any]) -> None:
    kind = item["type"]
    if kind in ITEMS:
        _has(item, ITEMS[kind], f"a {kind} item")
    for part in item.get("content") or ():
        if part["type"] in PARTS:
            _has(part, PARTS[part["type"]], f"a {part['type']} part")


def check_response(response: dict[str, Any]) -> None:
    """A Responses response object: the openai SDK's model and the schema's members."""
    openai_responses.Response.model_validate(response)
    _has(response, RESPONSE, "a response")
    assert (response["completed_at"] is not None) == (response["status"] == "completed")
    for tool in response["tools"]:
        if tool["type"] == "function":
            _has(tool, FUNCTION_TOOL, "a function tool")
    for item in response["output"]:
        _check_item(item)
    if response["usage"] is not None:
        _has(response["usage"], USAGE, "usage")
    if response["error"] is not None:
        _has(response["error"], ERROR, "an error")


def check_responses_event(event: dict[str, Any]) -> None:
    """One Responses stream event."""
    _RESPONSES_EVENTS[event["type"]].model_validate(event)
    assert isinstance(event["sequence_number"], int)
    if "response" in event:
        check_response(event["response"])
    if "item" in event:
        _check_item(event["item"])
    if "part" in event:
        _has(event["part"], PARTS[event["part"]["type"]], "a part")


def _check_block(block: dict[str, Any]) -> None:
    if block["type"] in BLOCKS:
        _has(block, BLOCKS[block["type"]], f"a {block['type']} block")


def check_message(message: dict[str, Any]) -> None:
    """A Messages message (a whole reply, or `message_start`'s)."""
    anthropic_types.Message.model_validate(message)
    _has(message, MESSAGE, "a message")
    _has(message["usage"], MESSAGE_USAGE, "a message's usage")
    for block in message["content"]:
        _check_block(block)


def check_messages_event(event: dict[str, Any]) -> None:
    """One Messages stream event (an `error` event is `check_messages_error`'s)."""
    _MESSAGES_EVENTS[event["type"]].model_validate(event)
    match event["type"]:
        case "message_start":
            check_message(event["message"])
        case "content_block_start":
            _check_block(event["content_block"])
        case "message_delta":
            _has(event["delta"], DELTA, "message_delta's delta")
            _has(event["usage"], DELTA_USAGE, "message_delta's usage")


def check_messages_error(body: dict[str, Any]) -> None:
    """An Anthropic error body (or `error` event)."""
    anthropic_types.ErrorResponse.model_validate(body)
    _has(body, ANTHROPIC_ERROR, "an error body")
