"""OpenAI request views and error bodies, as far as the Edge needs to understand them.

The Edge never rebuilds a caller's request: it decodes the JSON once into a dict (so
every provider-specific field passes through), then checks the handful of fields it acts
on against these views. The views ignore unknown fields on purpose; a wrong *type* on a
known field is a 400 that names the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PositiveInt = Annotated[int, Meta(ge=1)]


class RequestView(msgspec.Struct, frozen=True, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    stream: bool = False


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str | list[Any] | None = None


class ChatRequest(RequestView, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    n: PositiveInt | None = None
    temperature: float | None = None
    top_p: float | None = None


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


ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "not_found_error",
    "rate_limit_error",
    "api_error",
    "service_unavailable_error",
]


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
