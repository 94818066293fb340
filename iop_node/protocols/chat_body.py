"""The chat completions request both translators write, and the SSE framing both use.

Rules the translators follow when writing a chat body:

1. Text-only content is a string, never a list of text parts: every chat template reads
   a string, not every one reads a list (llama-cpp-python's renders the list's Python
   repr). Parts are written only when an image is among them.
2. An assistant message that only calls tools has `content: ""`, not null: a template
   that prints `message.content` prints `None` for null.
3. A field the caller did not set is left out (`UNSET`), so the runtime's own default
   applies; `parallel_tool_calls` is written only when it is false (true is the
   default everywhere).
4. A stream asks for usage (`stream_options.include_usage`): the translated reply must
   carry the runtime's own counts, and the caller's protocol always reports usage.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import msgspec
from msgspec import UNSET, UnsetType

__all__ = [
    "ChatBody",
    "ChatFunction",
    "ChatMessage",
    "ChatTool",
    "ChatToolCall",
    "FunctionCall",
    "ImagePart",
    "ImageURL",
    "Part",
    "TextPart",
    "chat_body",
    "encode",
    "sse_event",
    "sse_head",
    "text_and_images",
    "text_or_parts",
]

encode: Final = msgspec.json.Encoder().encode


class TextPart(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    text: str


class ImageURL(msgspec.Struct, frozen=True, omit_defaults=True):
    url: str
    detail: str | UnsetType = UNSET


class ImagePart(msgspec.Struct, frozen=True, tag_field="type", tag="image_url"):
    image_url: ImageURL


Part = TextPart | ImagePart


class FunctionCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str


class ChatToolCall(msgspec.Struct, frozen=True, tag_field="type", tag="function"):
    id: str
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[Part]
    tool_calls: list[ChatToolCall] | UnsetType = UNSET
    tool_call_id: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    """The reasoning of an earlier assistant turn, where the runtime's template reads it
    (llama.cpp, vLLM); runtimes that do not skip the field."""


class ChatFunction(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str
    description: str | UnsetType = UNSET
    parameters: msgspec.Raw | dict[str, Any] | UnsetType = UNSET
    strict: bool | UnsetType = UNSET


class ChatTool(msgspec.Struct, frozen=True, tag_field="type", tag="function"):
    function: ChatFunction


class _StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = True


_STREAM_OPTIONS: Final = _StreamOptions()


class ChatBody(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    messages: list[ChatMessage]
    stream: bool = False
    stream_options: _StreamOptions | UnsetType = UNSET
    max_tokens: int | UnsetType = UNSET
    temperature: float | UnsetType = UNSET
    top_p: float | UnsetType = UNSET
    top_k: int | UnsetType = UNSET
    stop: list[str] | UnsetType = UNSET
    tools: list[ChatTool] | UnsetType = UNSET
    tool_choice: str | dict[str, Any] | UnsetType = UNSET
    parallel_tool_calls: bool | UnsetType = UNSET
    reasoning_effort: str | UnsetType = UNSET
    response_format: msgspec.Raw | dict[str, Any] | UnsetType = UNSET


def chat_body(
    model: str,
    messages: list[ChatMessage],
    *,
    stream: bool,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
) -> ChatBody:
    """The body with the settings every caller protocol has: what the caller left out
    stays out (Rule 3), and a stream asks for usage (Rule 4)."""
    chat = ChatBody(model=model, messages=messages, stream=stream)
    if stream:
        chat.stream_options = _STREAM_OPTIONS
    if max_tokens is not None:
        chat.max_tokens = max_tokens
    if temperature is not None:
        chat.temperature = temperature
    if top_p is not None:
        chat.top_p = top_p
    return chat


def text_and_images(parts: Iterable[Part]) -> tuple[str, list[Part]]:
    """A tool result's parts as a `tool` message can carry them: its text (joined by a
    newline), and the images apart, since a tool message carries text only (they travel
    in a user message after it)."""
    texts: list[str] = []
    images: list[Part] = []
    for part in parts:
        if isinstance(part, TextPart):
            texts.append(part.text)
        else:
            images.append(part)
    return "\n".join(texts), images


def text_or_parts(parts: list[Part]) -> str | list[Part]:
    """Rule 1: the parts as one string when all are text (joined by a newline, so two
    blocks never run into one word)."""
    texts = [part.text for part in parts if isinstance(part, TextPart)]
    return "\n".join(texts) if len(texts) == len(parts) else parts


def sse_event(name: str, data: bytes) -> bytes:
    """One named server-sent event. msgspec escapes every newline inside a JSON string, so
    the payload is always one `data:` line."""
    return sse_head(name) + data + b"\n\n"


def sse_head(name: str) -> bytes:
    """A named server-sent event up to its data (`event: NAME\\ndata: `): what
    `sse_event` writes before the payload, for a translator that frames many events of
    one name."""
    return b"event: " + name.encode() + b"\ndata: "
