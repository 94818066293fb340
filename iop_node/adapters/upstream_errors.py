"""What an upstream's error answer says that a caller acts on: its code and the field it
names (OpenAI's `code` and `param`), and the context size a context overflow reports.

Clients branch on OpenAI's codes (`context_length_exceeded` is what makes an agent trim its
history), so a request the upstream refused reaches the caller with them. Runtimes word
them in dialects:

    OpenAI, and servers that copy it   {"error": {"code": "context_length_exceeded",
                                                  "param": "messages", ...}}
    llama.cpp (llama-server)            {"error": {"code": 400, "type":
                                                  "exceed_context_size_error",
                                                  "n_prompt_tokens": 9412, "n_ctx": 8192}}
    vLLM                                {"object": "error", "code": 400, "message":
                                         "This model's maximum context length is ..."}
    llama-cpp-python                    OpenAI's, with "maximum context length is 512
                                         tokens" in the message

Rules:
1. A string `code` (in `error`, or at the top level) is the upstream's code, kept as is;
   `param` likewise when it is a string.
2. A numeric code names an HTTP status, not an error: a context overflow is recognised by
   llama.cpp's `exceed_context_size_error` type, or by the words llama.cpp and vLLM use,
   and given OpenAI's code, `context_length_exceeded`.
3. An overflow that names no field names the request's input (`messages` for chat,
   `prompt` for a completion, `input` for embeddings), as OpenAI's does.
4. An overflow tells the provider's context size (per slot): llama.cpp's `n_ctx`, else
   the number its words give ("maximum context length is 512 tokens", "the available
   context size (8192 tokens)"), to be learnt.

Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from schemas.wire import Operation

__all__ = [
    "CONTEXT_LENGTH_EXCEEDED",
    "INPUT_FIELDS",
    "MESSAGE_LIMIT",
    "ErrorFacts",
    "error_message",
    "read_error_facts",
]

#: OpenAI's code for a prompt (plus output) longer than the model's context.
CONTEXT_LENGTH_EXCEEDED: Final = "context_length_exceeded"
#: The request field holding an operation's input (Rule 3).
INPUT_FIELDS: Final[dict[str, str]] = {
    "chat": "messages",
    "completion": "prompt",
    "embedding": "input",
}
_OVERFLOW_TYPES: Final = frozenset({"exceed_context_size_error"})
_OVERFLOW_WORDS: Final = re.compile(
    r"exceeds the available context size|maximum context length|context length exceeded",
    re.IGNORECASE,
)
_CONTEXT_SIZE_WORDS: Final = re.compile(
    r"maximum context length is (\d+)|available context size \((\d+) tokens\)"
    r"|context window of (\d+)",
    re.IGNORECASE,
)
_decode: Final = msgspec.json.Decoder().decode
#: Longest upstream error message carried into an AdapterError, whitespace and all: the
#: caller gets the upstream's own words (design §4 item 10), and the reason is often at the end.
MESSAGE_LIMIT = 8 * 1024


@dataclass(frozen=True, slots=True)
class ErrorFacts:
    code: str | None = None
    param: str | None = None
    context_tokens: int | None = None
    """The provider's context size, when the answer tells it (Rule 4)."""


def read_error_facts(body: bytes, operation: Operation | None = None) -> ErrorFacts:
    """What `body`, an upstream's error answer, says (module rules); nothing for a body
    that is not a JSON object."""
    try:
        parsed = _decode(body)
    except (msgspec.DecodeError, RecursionError):
        return ErrorFacts()
    if not isinstance(parsed, dict):
        return ErrorFacts()
    error = parsed.get("error")
    fields: dict[str, Any] = error if isinstance(error, dict) else parsed
    code = _text(fields.get("code"))
    param = _text(fields.get("param"))
    message = _text(fields.get("message")) or (error if isinstance(error, str) else "")
    context = fields.get("n_ctx")
    context_tokens = context if isinstance(context, int) and context > 0 else None
    if context_tokens is None and (words := _CONTEXT_SIZE_WORDS.search(message or "")):
        context_tokens = int(next(group for group in words.groups() if group))
    overflow = code == CONTEXT_LENGTH_EXCEEDED or (
        code is None
        and (fields.get("type") in _OVERFLOW_TYPES or bool(_OVERFLOW_WORDS.search(message or "")))
    )
    if not overflow:
        return ErrorFacts(code=code, param=param)
    return ErrorFacts(
        code=CONTEXT_LENGTH_EXCEEDED,
        param=param or (INPUT_FIELDS.get(operation) if operation else None),
        context_tokens=context_tokens,
    )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def _bound(text: str) -> str:
    """An upstream message as it was (whitespace kept), cut only past `MESSAGE_LIMIT`."""
    text = text.strip()
    if len(text) <= MESSAGE_LIMIT:
        return text
    marker = f"... [cut: {len(text)} characters in all]"
    return text[: MESSAGE_LIMIT - len(marker)] + marker


def error_message(body: bytes) -> str | None:
    """The human message in an upstream error body, whatever dialect it speaks, kept whole
    up to `MESSAGE_LIMIT` characters.

    OpenAI (and Ollama's /v1, SGLang, Lemonade, llama.cpp): `{"error": {"message": ...}}`;
    older vLLM: `{"object": "error", "message": ...}`; some servers: `{"error": "..."}`;
    FastAPI: `{"detail": ...}`. Anything else falls back to the body as text.
    """
    try:
        parsed = _decode(body)
    except msgspec.DecodeError:
        text = body.decode("utf-8", errors="replace").strip()
        return _bound(text) if text else None
    candidates: list[Any] = []
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict):
            candidates.append(error.get("message"))
        candidates += [error, parsed.get("message"), parsed.get("detail")]
    elif isinstance(parsed, str):
        candidates.append(parsed)
    for candidate in candidates:
        if isinstance(candidate, str) and candidate.strip():
            return _bound(candidate)
    text = body.decode("utf-8", errors="replace").strip()
    return _bound(text) if text else None
