"""A chat completion as an Anthropic Messages response (non-stream), and the shapes the
Messages stream shares with it.

Rules:

1. The message is `msg_<request_id>`, its model the caller's alias. Content blocks come
   in the order a model produces them: thinking (the runtime's `reasoning_content`),
   text (a refusal is text too: Messages has no refusal block, and `stop_reason` says
   `refusal` when the runtime filtered), then one `tool_use` per tool call.
2. A tool call keeps the runtime's id; one with no id, an id already used in this
   message, or one Anthropic's pattern refuses (`functions.get_weather:0`, as vLLM's
   Kimi-K2 parser writes them) gets `toolu_<request_id>_<n>` (deterministic, so a
   retried translation names the same calls). Its arguments must be a JSON object
   (empty is `{}`): Messages carries `input` as an object, so arguments that are not one
   are the runtime's error (`ReplyTranslationError`), not something to guess at; except
   the last call of a reply the output limit cut (`max_tokens`): its input is `{}`, an
   incomplete `tool_use`, as Anthropic documents it (a caller raises `max_tokens` and
   asks again).
3. `stop_reason` as `chat_view.stop_reason` maps it.
4. Usage: Anthropic counts cached input apart (`input_tokens` excludes
   `cache_read_input_tokens`), chat includes it in `prompt_tokens`, so `input_tokens` is
   prompt minus cached. Nothing is written to a runtime's cache on request, so
   `cache_creation_input_tokens` is 0. A runtime that reports no usage gets the caller's
   fallback (`usage=`: the Node's estimate), never zeros it did not count.
5. Every member Anthropic's SDKs declare always present is there, `null` when it has no
   value: the message's `container` and `stop_details`; usage's `cache_creation` (zero
   per TTL), `inference_geo`, `output_tokens_details` (`thinking_tokens` when the
   runtime counted reasoning tokens), `server_tool_use` (no server tool ran) and
   `service_tier` (`standard`); a text block's `citations`; a tool use's `caller`
   (`direct`: the model called it).
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from iop_node.protocols.chat_body import encode
from iop_node.protocols.chat_view import (
    ChatChunk,
    StopReason,
    TokenUsage,
    named_calls,
    read_response,
    stop_reason,
)
from iop_node.protocols.errors import ReplyTranslationError

__all__ = [
    "DIRECT",
    "AnthropicUsage",
    "DeltaUsage",
    "DirectCaller",
    "Message",
    "TextBlock",
    "ThinkingBlock",
    "ToolUseBlock",
    "messages_response_from_chat",
    "tool_input",
    "tool_use_id",
]


class _CacheCreation(msgspec.Struct, frozen=True, kw_only=True):
    ephemeral_1h_input_tokens: int = 0
    ephemeral_5m_input_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, frozen=True):
    thinking_tokens: int


class AnthropicUsage(msgspec.Struct, frozen=True, kw_only=True):
    """A message's usage (Rules 4 and 5)."""

    input_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation: _CacheCreation = _CacheCreation()
    output_tokens: int
    output_tokens_details: OutputTokensDetails | None = None
    server_tool_use: None = None
    service_tier: str = "standard"
    inference_geo: None = None

    @classmethod
    def of(cls, usage: TokenUsage) -> AnthropicUsage:
        """Rule 4."""
        return cls(
            input_tokens=usage.prompt_tokens - usage.cached_tokens,
            output_tokens=usage.completion_tokens,
            cache_read_input_tokens=usage.cached_tokens,
            output_tokens_details=_thinking_details(usage),
        )


class DeltaUsage(msgspec.Struct, frozen=True, kw_only=True):
    """A stream's `message_delta` usage: the counts so far, the input ones included (they
    replace the `message_start` estimate in the SDKs' accumulated message)."""

    input_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens: int
    output_tokens_details: OutputTokensDetails | None = None
    server_tool_use: None = None

    @classmethod
    def of(cls, usage: TokenUsage) -> DeltaUsage:
        """Rule 4."""
        return cls(
            input_tokens=usage.prompt_tokens - usage.cached_tokens,
            output_tokens=usage.completion_tokens,
            cache_read_input_tokens=usage.cached_tokens,
            output_tokens_details=_thinking_details(usage),
        )


def _thinking_details(usage: TokenUsage) -> OutputTokensDetails | None:
    """Rule 5: the reasoning tokens, when the runtime counted some."""
    return OutputTokensDetails(usage.reasoning_tokens) if usage.reasoning_tokens else None


class TextBlock(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    text: str
    citations: None = None


class ThinkingBlock(msgspec.Struct, frozen=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""
    """Anthropic signs its own models' thinking; a runtime's reasoning has no signature."""


class DirectCaller(msgspec.Struct, frozen=True, tag_field="type", tag="direct"):
    """Who called a tool (Rule 5): the model itself."""


DIRECT: Final = DirectCaller()


class ToolUseBlock(msgspec.Struct, frozen=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: msgspec.Raw
    caller: DirectCaller = DIRECT


Block = TextBlock | ThinkingBlock | ToolUseBlock


class Message(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[Block]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    stop_details: None = None
    container: None = None
    usage: AnthropicUsage


_check_object: Final = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_EMPTY_INPUT: Final = msgspec.Raw(b"{}")
#: The ids Anthropic issues and accepts for a `tool_use` (a history holding another is a
#: 400 there, and at every proxy that validates it).
_TOOL_USE_ID: Final = re.compile(r"[a-zA-Z0-9_-]{1,256}\Z")


def tool_input(arguments: str, param: str, *, cut: bool = False) -> msgspec.Raw:
    """Rule 2: a tool call's arguments as the `input` object, bytes untouched; `cut`: the
    output limit ended the reply in this call."""
    data = arguments.strip().encode()
    if not data:
        return _EMPTY_INPUT
    try:
        _check_object(data)
    except (msgspec.DecodeError, RecursionError):
        if cut:
            return _EMPTY_INPUT
        raise ReplyTranslationError(
            "the runtime called a tool with arguments that are not a JSON object: "
            f"{arguments!r:.200}",
            param=param,
        ) from None
    return msgspec.Raw(data)


def tool_use_id(runtime_id: str | None, request_id: str, n: int, used: set[str]) -> str:
    """Rule 2."""
    sound = runtime_id and _TOOL_USE_ID.match(runtime_id) and runtime_id not in used
    chosen = runtime_id if sound and runtime_id else f"toolu_{request_id}_{n}"
    used.add(chosen)
    return chosen


def messages_response_from_chat(
    chat: bytes, *, reply_model: str, request_id: str, usage: TokenUsage | None = None
) -> bytes:
    """The Messages response for a whole chat completion. `usage` counts only when the
    runtime's reply has none (Rule 4)."""
    response: ChatChunk = read_response(chat)
    choice = response.first()
    message = choice.said if choice is not None else None
    blocks: list[Block] = []
    calls = 0
    if message is not None:
        if message.thinking:
            blocks.append(ThinkingBlock(thinking=message.thinking))
        text = (message.content or "") + (message.refusal or "")
        if text:
            blocks.append(TextBlock(text=text))
        used: set[str] = set()
        named = list(named_calls(message))
        cut = choice is not None and choice.finish_reason == "length"
        for position, call in enumerate(named, 1):
            blocks.append(
                ToolUseBlock(
                    id=tool_use_id(call.id, request_id, call.n, used),
                    name=call.name,
                    input=tool_input(
                        call.arguments, call.arguments_param, cut=cut and position == len(named)
                    ),
                )
            )
            calls += 1
    reason, sequence = stop_reason(
        choice.finish_reason if choice is not None else None,
        called_tools=calls > 0,
        matched=choice.stop_reason if choice is not None else None,
    )
    counts = response.tokens() or usage or TokenUsage()
    return encode(
        Message(
            id=f"msg_{request_id}",
            model=reply_model,
            content=blocks,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=AnthropicUsage.of(counts),
        )
    )
