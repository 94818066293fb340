"""The bench upstream's Anthropic Messages and OpenAI Responses answers, built once.

Runtimes that speak the caller protocols natively (llama.cpp's server, vLLM, SGLang,
Ollama) answer `POST /v1/messages` and `POST /v1/responses` themselves; so does the
bench's upstream, so that IOP's native path, and the direct baseline, are measured
beside chat. The answers say what the chat ones say (the same tokens, the same usage)
in each protocol's shape. They are the chat answer and stream put through IOP's own
translators once, at start (`iop_node.protocols`, whose output the official SDKs parse
in IOP's tests), so no protocol is written by hand here, and per request the upstream
still only sends ready bytes.

A Messages stream carries one text delta per chat token, between `message_start`,
`content_block_start` and `content_block_stop`, `message_delta`, `message_stop`; a
Responses stream the same deltas between the lifecycle and item events OpenAI sends.
"""

from __future__ import annotations

import json
from typing import Any, Final

from iop_node.protocols import (
    MessagesStream,
    ResponsesStream,
    messages_response_from_chat,
    responses_response_from_chat,
)

__all__ = [
    "messages_body",
    "messages_events",
    "responses_body",
    "responses_events",
    "with_usage",
]

_ID: Final = "bench"


def _clock() -> float:
    return 0.0


def _request(model: str) -> bytes:
    """The request a Responses answer echoes (a Responses object repeats its settings)."""
    return json.dumps({"model": model, "store": False}).encode()


def messages_body(completion: bytes, model: str) -> bytes:
    """The non-stream Messages answer saying what the chat `completion` says."""
    return messages_response_from_chat(completion, reply_model=model, request_id=_ID)


def responses_body(completion: bytes, model: str) -> bytes:
    """The non-stream Responses answer saying what the chat `completion` says."""
    return responses_response_from_chat(
        completion, reply_model=model, request_id=_ID, request=_request(model), clock=_clock
    )


def _split(framed: bytes) -> list[bytes]:
    """Framed server-sent events, one per item, each with its blank line."""
    return [event + b"\n\n" for event in framed.split(b"\n\n") if event]


def messages_events(chunks: list[bytes], model: str, prompt_tokens: int) -> list[bytes]:
    """The events of the Messages stream saying what the chat stream `chunks` says, each
    framed (`event: NAME\\ndata: JSON\\n\\n`)."""
    stream = MessagesStream(model, _ID, input_tokens=prompt_tokens)
    return _split(b"".join(stream.feed(chunk) for chunk in chunks) + stream.finish())


def responses_events(chunks: list[bytes], model: str) -> list[bytes]:
    """The events of the Responses stream saying what the chat stream `chunks` says."""
    stream = ResponsesStream(model, _ID, _request(model), clock=_clock)
    return _split(b"".join(stream.feed(chunk) for chunk in chunks) + stream.finish())


def with_usage(body: bytes, path: bytes, *, prompt_tokens: int, cached_tokens: int) -> bytes:
    """A non-stream answer (`body`, for `path`) reporting other prompt counts: what a
    runtime with a prefix cache says (`bench.prefix_cache`), in each protocol's terms."""
    answer: dict[str, Any] = json.loads(body)
    usage = answer["usage"]
    if path == b"/v1/messages":  # Anthropic counts cached input apart
        usage["input_tokens"] = prompt_tokens - cached_tokens
        usage["cache_read_input_tokens"] = cached_tokens
    elif path == b"/v1/responses":
        usage["input_tokens"] = prompt_tokens
        usage["input_tokens_details"] = {"cached_tokens": cached_tokens}
        usage["total_tokens"] = prompt_tokens + usage["output_tokens"]
    else:
        usage["prompt_tokens"] = prompt_tokens
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        usage["total_tokens"] = prompt_tokens + usage["completion_tokens"]
    return json.dumps(answer, separators=(",", ":")).encode()
