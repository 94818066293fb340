"""OpenAI bodies as IOP reads and writes them: request views, error bodies, model lists,
and the response bodies of the engines that live in a Node (`sim`, `cli`).

Requests: the Edge never rebuilds a caller's request: it decodes the JSON once into a dict
(so every provider-specific field passes through), then checks the handful of fields it
acts on against these views. The views ignore unknown fields on purpose; a wrong *type* on
a known field is a 400 that names the field.

Responses: an adapter that produces its answer itself (rather than relaying an upstream's
bytes) encodes it from the Structs at the end of this module, so every such engine speaks
the same OpenAI shapes. A field set to `UNSET` is left out of the JSON; `None` is sent
as `null`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from schemas.wire import Usage

PositiveInt = Annotated[int, Meta(ge=1)]


class RequestView(msgspec.Struct, frozen=True, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    stream: bool = False


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str | list[Any] | None = None


class FunctionName(msgspec.Struct, frozen=True, kw_only=True):
    name: Annotated[str, Meta(min_length=1)]


class FunctionTool(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="function"):
    function: FunctionName


class CustomTool(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="custom"):
    custom: dict[str, Any]


class Typed(msgspec.Struct, frozen=True, kw_only=True):
    """An object that says what it is (`tool_choice`'s, `response_format`)."""

    type: str


class ChatRequest(RequestView, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    n: PositiveInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    # Shapes a runtime cannot take otherwise: checked here so a caller's mistake is a 400
    # naming the field rather than whatever the runtime makes of it.
    tools: list[FunctionTool | CustomTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | Typed | None = None
    stop: str | list[str] | None = None
    response_format: Typed | None = None


# A prompt / input is a string, a list of strings, or token ids (list[int] or
# list[list[int]]); msgspec unions admit one array type, so the list is checked loosely.
PromptLike = str | list[str | int | list[int]]


class CompletionRequest(RequestView, frozen=True, kw_only=True):
    prompt: PromptLike
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    n: PositiveInt | None = None
    temperature: float | None = None


class EmbeddingRequest(RequestView, frozen=True, kw_only=True):
    input: PromptLike


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's error envelope: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "iop"
    display_name: str | None = None


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    object: str = "list"
    data: list[ModelCard] = []


# --- response bodies ---------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, frozen=True, kw_only=True):
    cached_tokens: int
    """Of the prompt tokens, those read from the runtime's prefix cache."""


class CompletionUsage(msgspec.Struct, frozen=True, kw_only=True):
    """`usage` of a chat or text completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET

    @classmethod
    def of(cls, usage: Usage, *, cached_tokens: int | None = None) -> CompletionUsage:
        """`usage` as a chat body says it; with `prompt_tokens_details` when the engine
        knows its cached prompt tokens."""
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            prompt_tokens_details=UNSET
            if cached_tokens is None
            else PromptTokensDetails(cached_tokens=cached_tokens),
        )


class FunctionCall(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A tool call's function: its name (in a stream, on the call's first fragment only)
    and its arguments, JSON text (in a stream, a fragment of it)."""

    name: str | None = None
    arguments: str = ""


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One `tool_calls[]` entry of an assistant message, or a fragment of one in a chunk
    (`index` says which call; `id` and `type` come on its first fragment only)."""

    index: int | None = None
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class Delta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a chat chunk adds to the message; fields not set are left out."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    delta: Delta
    logprobs: UnsetType | None = UNSET
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True):
    """`chat.completion.chunk`: one event of a chat stream."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | UnsetType = UNSET
    """Only on the last chunk, when the caller asked for `stream_options.include_usage`."""


class AssistantMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: UnsetType | None = UNSET
    finish_reason: str


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    """`chat.completion`: a whole (non-stream) chat answer."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class TextChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class TextCompletion(msgspec.Struct, frozen=True, kw_only=True):
    """`text_completion`: a whole answer, or one event of a stream (then without usage,
    except for the last event when the caller asked for it)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: CompletionUsage | UnsetType = UNSET


class EmbeddingUsage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class Embedding(msgspec.Struct, frozen=True, kw_only=True):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    """The vector, or its little-endian float32 bytes in base64 (`encoding_format`)."""


class EmbeddingList(msgspec.Struct, frozen=True, kw_only=True):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
