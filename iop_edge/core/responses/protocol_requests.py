"""What the Edge reads of an Anthropic Messages or OpenAI Responses request (design §14).

The Edge never translates a protocol: it admits the request and relays it. Admission needs
a handful of fields (the model, the stream flag, the output bound, for Responses `store`
and `previous_response_id`) and an estimate of the input tokens (long-context admission,
design §4 step 4, and the usage of a run whose provider reports none, design §7). These
views are those fields and nothing more.

As for chat, the body is decoded once into a dict (every field the Edge does not read
passes through to the Node untouched) and checked against a view with `msgspec.convert`,
which follows only the fields the view names: an image's base64 data or a tool's JSON
schema the estimate does not count is never looked at. A wrong type on a field the view
names is a 400 that names the field; unknown fields and item types are left alone (a
runtime or the Node's translator judges them).

Estimate rule (`schemas.tokens`'s for chat, so a request costs the same whichever
protocol it came in): ceil(characters / 4) over every piece of text the model reads, plus
the chat template's share (`_framing`): `TOKENS_PER_MESSAGE` per message or input item
(the system prompt or instructions count as one), `TOKENS_PER_REQUEST`, and
`IMPLIED_SYSTEM_TOKENS` when the request has no system prompt. Text is: the system prompt
or instructions; text, thinking and tool result content; a tool call's name and arguments
(a Messages `tool_use` input counts as its JSON); each tool definition's name,
description and parameter schema (as JSON).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from schemas.tokens import (
    CHARS_PER_TOKEN,
    IMPLIED_SYSTEM_TOKENS,
    TOKENS_PER_MESSAGE,
    TOKENS_PER_REQUEST,
)

__all__ = [
    "CountTokensRequest",
    "MessagesRequest",
    "ResponsesRequest",
    "estimate_messages_tokens",
    "estimate_responses_tokens",
    "input_items",
    "named_tool_problem",
    "openai_tool_choice_problem",
]

NonEmptyStr = Annotated[str, Meta(min_length=1)]
PositiveInt = Annotated[int, Meta(ge=1)]

_json_encode: Final = msgspec.json.Encoder().encode
#: Roles of a Responses input item that stand in for a system prompt.
_SYSTEM_ROLES: Final = frozenset({"system", "developer"})


def _framing(messages: int, *, has_system: bool) -> int:
    """The chat template's share of a request's input tokens (the module's rule)."""
    implied = 0 if has_system else IMPLIED_SYSTEM_TOKENS
    return TOKENS_PER_MESSAGE * messages + TOKENS_PER_REQUEST + implied


class _View(msgspec.Struct, frozen=True, kw_only=True):
    """Base of the views: unknown fields are ignored (they pass through untouched)."""


# --- Anthropic Messages ---------------------------------------------------------------


class _Block(_View, frozen=True, kw_only=True):
    """A content block, as far as its text goes: `text`, `thinking`, `tool_use` (name and
    input), `tool_result` (its content, a string or blocks); other types (images,
    documents, redacted thinking) carry no text the estimate counts."""

    text: str | None = None
    thinking: str | None = None
    name: str | None = None
    input: Any = None
    content: str | list[_Block] | None = None

    def chars(self) -> int:
        total = 0
        for text in (self.text, self.thinking, self.name):
            if text:
                total += len(text)
        if self.input is not None:
            total += len(_json_encode(self.input))
        return total + _content_chars(self.content)


class _Message(_View, frozen=True, kw_only=True):
    """A turn. Its role is not checked: besides `user` and `assistant`, Claude Code
    sends `system` messages between turns (context it adds as it goes)."""

    role: str
    content: str | list[_Block]


class _AnthropicTool(_View, frozen=True, kw_only=True):
    name: str | None = None
    description: str | None = None
    input_schema: Any = None

    def chars(self) -> int:
        total = len(self.name or "") + len(self.description or "")
        if self.input_schema is not None:
            total += len(_json_encode(self.input_schema))
        return total


class AnthropicToolChoice(_View, frozen=True, kw_only=True):
    """`tool_choice`: one of Anthropic's four, `tool` with the `name` of a tool given."""

    type: Literal["auto", "any", "tool", "none"]
    name: NonEmptyStr | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(_View, frozen=True, kw_only=True):
    """`POST /v1/messages/count_tokens`: a Messages request without an output bound."""

    model: NonEmptyStr
    system: str | list[_Block] | None = None
    messages: Annotated[list[_Message], Meta(min_length=1)]
    tools: list[_AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None

    def tool_choice_problem(self) -> str | None:
        """Why `tool_choice` cannot be met by `tools` (Anthropic refuses it too), or None."""
        choice = self.tool_choice
        if choice is None or choice.type != "tool":
            return None
        if choice.name is None:
            return "tool_choice of type tool names the tool: `name` is required"
        return named_tool_problem(choice.name, [tool.name for tool in self.tools or ()])


class _MessagesMetadata(_View, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Anthropic's `metadata`: an id of the end user, and nothing else."""

    user_id: str | None = None


class MessagesRequest(CountTokensRequest, frozen=True, kw_only=True):
    """`POST /v1/messages`. `max_tokens` is required, as Anthropic's API requires it; the
    sampling settings have Anthropic's types and ranges."""

    max_tokens: PositiveInt
    stream: bool = False
    metadata: _MessagesMetadata | None = None
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stop_sequences: list[str] | None = None


def named_tool_problem(name: str, names: Sequence[str | None]) -> str | None:
    """Why a `tool_choice` naming the tool `name` cannot be met by the request's tools
    (`names`), or None: each API refuses it (OpenAI, Anthropic, vLLM)."""
    offered = [tool for tool in names if tool]
    if name in offered:
        return None
    if not offered:
        return f"tool_choice names the tool {name!r}, but the request has no tools"
    listed = ", ".join(repr(tool) for tool in offered[:10])
    more = f" and {len(offered) - 10} more" if len(offered) > 10 else ""
    return f"tool_choice names the tool {name!r}, which is not in tools ({listed}{more})"


def openai_tool_choice_problem(choice: object, tools: object, *, nested: bool) -> str | None:
    """Why an OpenAI `tool_choice` (chat's, `nested`: `{"type": "function", "function":
    {"name"}}`; Responses': `{"type": "function", "name"}`) cannot be met by `tools`, or
    None. Only what OpenAI and vLLM both refuse: `required`, or a named function, with no
    such tool; any other shape is the runtime's to judge."""
    if choice == "required":
        return None if tools else "tool_choice 'required' needs tools, and the request has none"
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    where = choice.get("function") if nested else choice
    name = where.get("name") if isinstance(where, dict) else None
    if not isinstance(name, str) or not name:
        field = "function.name" if nested else "name"
        return f"tool_choice of type function names the function: `{field}` is required"
    return named_tool_problem(name, _function_names(tools, nested=nested))


def _function_names(tools: object, *, nested: bool) -> list[str | None]:
    names: list[str | None] = []
    for tool in tools if isinstance(tools, list) else ():
        where = tool.get("function") if nested and isinstance(tool, dict) else tool
        name = where.get("name") if isinstance(where, dict) else None
        names.append(name if isinstance(name, str) else None)
    return names


def estimate_messages_tokens(request: CountTokensRequest) -> int:
    """Input tokens of a Messages (or count_tokens) request by the module's rule."""
    chars = _content_chars(request.system)
    for message in request.messages:
        chars += _content_chars(message.content)
    for tool in request.tools or ():
        chars += tool.chars()
    has_system = bool(request.system)
    framing = _framing(len(request.messages) + has_system, has_system=has_system)
    return -(-chars // CHARS_PER_TOKEN) + framing


def _content_chars(content: str | list[_Block] | list[_Part] | None) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(part.chars() for part in content)


# --- OpenAI Responses -----------------------------------------------------------------


class _Part(_View, frozen=True, kw_only=True):
    """A content part (`input_text`, `output_text`, `summary_text`, `reasoning_text`...),
    as far as its text goes; images and files carry none the estimate counts."""

    text: str | None = None
    refusal: str | None = None

    def chars(self) -> int:
        return len(self.text or "") + len(self.refusal or "")


class _Item(_View, frozen=True, kw_only=True):
    """An input item: a message (`content`), a function call (`name`, `arguments`), a
    function call's output (`output`), a reasoning item (`summary`, `content`). Its `type`
    and `id` are strings where given: the Edge reads the one (`uncalled_outputs`) and
    lists items by the other (`input_item_pages`)."""

    type: str | None = None
    id: str | None = None
    role: str | None = None
    content: str | list[_Part] | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[_Part] | None = None
    summary: list[_Part] | None = None

    def chars(self) -> int:
        total = len(self.name or "") + len(self.arguments or "")
        total += _content_chars(self.content) + _content_chars(self.output)
        return total + _content_chars(self.summary)


class _ResponsesTool(_View, frozen=True, kw_only=True):
    name: str | None = None
    description: str | None = None
    parameters: Any = None

    def chars(self) -> int:
        total = len(self.name or "") + len(self.description or "")
        if self.parameters is not None:
            total += len(_json_encode(self.parameters))
        return total


#: OpenAI's `metadata`: at most 16 pairs, keys of at most 64 characters, values of 512.
Metadata = Annotated[
    dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
    Meta(max_length=16),
]


class ResponsesRequest(_View, frozen=True, kw_only=True):
    """`POST /v1/responses`. `store` defaults to true, as in OpenAI's API. The settings a
    response object echoes have OpenAI's types and ranges: echoed as sent, a wrong one
    would make the response itself break the protocol's schema."""

    model: NonEmptyStr
    stream: bool = False
    input: str | list[_Item] = []
    instructions: str | None = None
    tools: list[_ResponsesTool] | None = None
    max_output_tokens: PositiveInt | None = None
    store: bool = True
    previous_response_id: NonEmptyStr | None = None
    metadata: Metadata | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    max_tool_calls: Annotated[int, Meta(ge=1)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


_decode_item: Final = msgspec.json.Decoder(_Item).decode


def estimate_responses_tokens(
    request: ResponsesRequest, earlier: Sequence[msgspec.Raw] = ()
) -> int:
    """Input tokens of a Responses request by the module's rule; `earlier` are the items
    of the stored conversation it continues (`previous_response_id`), as stored (JSON),
    which the model reads too. An earlier item that is not shaped as the view expects (an
    output item of a kind it does not know) counts as its JSON text."""
    chars = len(request.instructions or "")
    has_system = bool(request.instructions)
    count = len(earlier) + has_system
    items: list[_Item] = []
    for raw in earlier:
        try:
            items.append(_decode_item(raw))
        except (msgspec.DecodeError, RecursionError):  # a ValidationError is a DecodeError
            chars += len(raw)
    if isinstance(request.input, str):
        chars += len(request.input)
        count += 1
    else:
        count += len(request.input)
        items += request.input
    for item in items:
        chars += item.chars()
        has_system = has_system or item.role in _SYSTEM_ROLES
    for tool in request.tools or ():
        chars += tool.chars()
    return -(-chars // CHARS_PER_TOKEN) + _framing(count, has_system=has_system)


def input_items(value: object) -> list[Any]:
    """A Responses request's `input` as a list of items: a string is one user message
    (as OpenAI's API reads it); anything else is taken to be the list already checked by
    `ResponsesRequest`."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return value
    return []
