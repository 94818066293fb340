"""The caller protocols the Edge serves (design §14), named once for both processes.

A run's protocol decides three things: the caller's endpoint (`/v1/chat/completions`,
`/v1/messages`, `/v1/responses`), the upstream endpoint a provider serves it on natively,
and the shape of errors and stream events the caller expects. A provider either speaks a
protocol natively (the Node relays the body and the reply as they are, but for the model
name) or the Node translates it to chat completions and back.

What each protocol does is one object per process: the Edge's `CallerProtocol`
(`iop_edge.http.protocols.caller_protocol`) and the Node's `Translator`
(`iop_node.runs.protocol_run.translator`), each found by the protocol's name. Here are only
what both share: the names, as the wire carries them, and the two error shapes.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

CallerProtocol = str
"""A caller protocol's name, as the wire carries it (`run.operation` for a protocol's
runs, `ProviderStatus.protocols`) and as the usage ledger records it: one of
`BuiltinProtocol`, or one registered with both processes."""

BuiltinProtocol = Literal["chat", "messages", "responses"]
"""The protocols IOP serves and a config may name as an upstream's (`adapter.protocols`):
`chat`: OpenAI chat completions (and the legacy completions and embeddings, which only
ever go natively). `messages`: Anthropic Messages. `responses`: OpenAI Responses."""

ALL_PROTOCOLS: Final[tuple[BuiltinProtocol, ...]] = ("chat", "messages", "responses")

#: What a provider type speaks natively unless its `adapter.protocols` says otherwise.
#: A guess, not a promise: a `vllm`-type provider may be a server that speaks chat only,
#: so the Node learns from a 404/405 on a native endpoint and translates from then on.
DEFAULT_PROTOCOLS: Final[dict[str, tuple[BuiltinProtocol, ...]]] = {
    "vllm": ALL_PROTOCOLS,
    "sglang": ALL_PROTOCOLS,
    "ollama": ALL_PROTOCOLS,
    "lemonade": ("chat",),
    "lmstudio": ("chat", "responses"),
    "openai_api": ("chat", "responses"),
    "cli": ("chat",),
    "sim": ("chat",),
}


def default_protocols(provider_type: str) -> tuple[BuiltinProtocol, ...]:
    """The protocols a provider of this type is assumed to speak natively."""
    return DEFAULT_PROTOCOLS.get(provider_type, ("chat",))


# --- errors in the caller's protocol -----------------------------------------------------

#: Anthropic's error `type` for an HTTP status (its documented error types); a status not
#: listed is an `api_error`.
_ANTHROPIC_ERROR_TYPES: Final[dict[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class _OpenAIErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class _OpenAIError(msgspec.Struct, frozen=True, kw_only=True):
    error: _OpenAIErrorDetail


class _AnthropicErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    message: str


class _AnthropicError(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="error"):
    error: _AnthropicErrorDetail
    request_id: str | None


_encode = msgspec.json.Encoder().encode


#: IOP failure codes that are a load signal: OpenAI's `rate_limit_exceeded` in a failed
#: Response (the SDKs know a fixed set of codes there; every other failure is theirs
#: `server_error`).
_LOAD_SIGNALS: Final = frozenset({"busy", "upstream_busy"})


def response_error(code: str | None, message: str) -> tuple[str, str]:
    """A failed Response's `error` (`code`, `message`) for an IOP failure: OpenAI's code
    for it, and IOP's own code leading the message."""
    kind = "rate_limit_exceeded" if code in _LOAD_SIGNALS else "server_error"
    return kind, message if code is None else f"{code}: {message}"


def anthropic_error_type(status: int) -> str:
    """Anthropic's error `type` for an HTTP status."""
    if status in _ANTHROPIC_ERROR_TYPES:
        return _ANTHROPIC_ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def openai_error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> bytes:
    """OpenAI's error body, `{"error": {message, type, param, code}}`: chat completions'
    and Responses'."""
    return _encode(
        _OpenAIError(error=_OpenAIErrorDetail(message=message, type=type, param=param, code=code))
    )


def anthropic_error_body(
    status: int, message: str, *, code: str | None = None, request_id: str | None = None
) -> bytes:
    """Anthropic's error body, `{"type": "error", "error": {type, message}, "request_id":
    ...}`, whose `type` follows the status, as Anthropic's API does; IOP's machine-readable
    `code` is kept at the front of the message, since the shape has no field for it.
    `request_id` is the caller's request (its `x-request-id`), which the shape always
    carries (`null` where none is known)."""
    text = message if code is None else f"{code}: {message}"
    detail = _AnthropicErrorDetail(type=anthropic_error_type(status), message=text)
    return _encode(_AnthropicError(error=detail, request_id=request_id or None))


def error_body(
    protocol: CallerProtocol,
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    request_id: str | None = None,
) -> bytes:
    """An error body in a built-in protocol's shape: Anthropic's for Messages, OpenAI's
    for the others."""
    if protocol == "messages":
        return anthropic_error_body(status, message, code=code, request_id=request_id)
    return openai_error_body(message, type=type, code=code, param=param)
