"""What the fake upstream says when it speaks a caller protocol natively (design §14).

`FakeUpstream` (in `fake_upstream`) serves Anthropic Messages (`POST /v1/messages`,
`/v1/messages/count_tokens`) and OpenAI Responses (`POST /v1/responses`) when its
`native` knob names them, as llama.cpp's server, vLLM and Ollama do, and a runtime's
tokenizer endpoint when its `tokenizer` knob names a dialect. This module holds the bytes
it sends, pure, so tests compare what a relay passes on with what the server said.

Like the chat answers, bodies are written with `json.dumps` defaults and carry the
provider-specific `EXTRA` field, so a relay that re-encodes instead of passing bytes
through is caught. Usage is reported as real runtimes do: Messages gives `input_tokens`
(cache reads apart, in `cache_read_input_tokens`) in `message_start` and the cumulative
`output_tokens` in `message_delta`; Responses gives it once, in `response.completed`
(`input_tokens` including the cached ones, `input_tokens_details.cached_tokens`).

Tokenizer dialects (`TOKENIZERS`): `llama_cpp` (llama-server: `POST /tokenize`
`{"content"}` -> `{"tokens"}`), `vllm` (`POST /tokenize` `{"model", "prompt"}` ->
`{"count", "max_model_len", "tokens"}`) and `llama_cpp_python` (`POST
/extras/tokenize/count` `{"input"}` -> `{"count"}`). The fake's tokens are the text's
whitespace-separated words, a count no estimator would make up, so a test can tell which
way a count was made.
"""

from __future__ import annotations

import json
from typing import Any, Final

from .fake_data import EXTRA, PROMPT_TOKENS

#: Input tokens the upstream says it read from its prompt cache (a part of the prompt).
CACHED_TOKENS: Final = 5
#: What the fake's own `/v1/messages/count_tokens` answers.
NATIVE_COUNT: Final = 4242
TOKENIZERS: Final = frozenset({"llama_cpp", "vllm", "llama_cpp_python"})
MAX_MODEL_LEN: Final = 8192


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def _text(chunks: int) -> str:
    return "".join(f"tok{i} " for i in range(chunks))


def sse(event: str, data: bytes) -> bytes:
    """One server-sent event with its name, as Anthropic and OpenAI frame them."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


# --- Anthropic Messages ------------------------------------------------------------------------


def _messages_usage(output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": PROMPT_TOKENS - CACHED_TOKENS,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": CACHED_TOKENS,
        "output_tokens": output_tokens,
    }


def messages_response(model: str, chunks: int) -> bytes:
    """The exact body of a non-stream Messages answer."""
    body = {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": _text(chunks)}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": _messages_usage(chunks),
        **EXTRA,
    }
    return _dumps(body)


def messages_events(model: str, chunks: int) -> list[tuple[str, bytes]]:
    """The (event name, data) pairs of one Messages stream, in order."""
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _messages_usage(1),
            **EXTRA,
        },
    }
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", start),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        ("ping", {"type": "ping"}),
    ]
    for i in range(chunks):
        delta = {"type": "text_delta", "text": f"tok{i} "}
        events.append(
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
        )
    events += [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": chunks},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return [(name, _dumps(data)) for name, data in events]


def messages_error(message: str, status: int) -> bytes:
    """An error in Anthropic's shape, as a Messages-native runtime answers."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
    error = {"type": kind.get(status, "api_error"), "message": message}
    return _dumps({"type": "error", "error": error})


def unknown_input(payload: dict[str, Any], headers: dict[str, str]) -> str | None:
    """The first of Anthropic's beta extras a strict runtime does not know, in a Messages
    request: its `anthropic-beta` header, `context_management`, a `cache_control.ttl`."""
    if any(name.lower() == "anthropic-beta" for name in headers):
        return "anthropic-beta"
    if "context_management" in payload:
        return "context_management"
    if '"ttl"' in json.dumps(payload, separators=(",", ":")):
        return "cache_control.ttl"
    return None


def extra_forbidden(field: str) -> bytes:
    """A strict runtime's 400 for an input it does not know (pydantic's words, in
    Anthropic's error shape)."""
    return messages_error(f"{field}: Extra inputs are not permitted", 400)


def in_band_error(operation: str, message: str) -> tuple[str, bytes]:
    """The event a runtime sends when generation fails mid-stream: Anthropic's `error`
    event, or Responses' `response.failed` (whose response carries the error)."""
    if operation == "messages":
        return "error", _dumps(
            {"type": "error", "error": {"type": "api_error", "message": message}}
        )
    failed = _response_object("fake-model", "failed", [], None)
    failed["error"] = {"code": "server_error", "message": message}
    return "response.failed", _dumps({"type": "response.failed", "response": failed})


# --- OpenAI Responses --------------------------------------------------------------------------


def _responses_usage(output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": PROMPT_TOKENS,
        "input_tokens_details": {"cached_tokens": CACHED_TOKENS},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": PROMPT_TOKENS + output_tokens,
    }


def _message_item(text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if text else []
    return {
        "type": "message",
        "id": "msg_fake",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _response_object(
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    store: bool = True,
) -> dict[str, Any]:
    """A response object; `store` echoes the request's, as a runtime does."""
    return {
        "id": "resp_fake",
        "object": "response",
        "created_at": 0,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "store": store,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
        **EXTRA,
    }


def responses_response(model: str, chunks: int, *, store: bool = True) -> bytes:
    """The exact body of a non-stream Responses answer to a request with `store`."""
    item = _message_item(_text(chunks), "completed")
    return _dumps(_response_object(model, "completed", [item], _responses_usage(chunks), store))


def responses_events(
    model: str, chunks: int, *, store: bool = True, indexed: bool = True
) -> list[tuple[str, bytes]]:
    """The (event name, data) pairs of one Responses stream, in order, answering a request
    with `store`; without `indexed`, as llama.cpp's server sends them: no event has its
    `sequence_number`, `output_index` or `content_index`."""
    text = _text(chunks)
    part_done = {"type": "output_text", "text": text, "annotations": []}
    events: list[dict[str, Any]] = [
        {
            "type": "response.created",
            "response": _response_object(model, "in_progress", [], None, store),
        },
        {
            "type": "response.in_progress",
            "response": _response_object(model, "in_progress", [], None, store),
        },
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": _message_item("", "in_progress"),
        },
        {
            "type": "response.content_part.added",
            "item_id": "msg_fake",
            "output_index": 0,
            "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": []},
        },
    ]
    for i in range(chunks):
        events.append(
            {
                "type": "response.output_text.delta",
                "item_id": "msg_fake",
                "output_index": 0,
                "content_index": 0,
                "delta": f"tok{i} ",
            }
        )
    done_item = _message_item(text, "completed")
    events += [
        {
            "type": "response.output_text.done",
            "item_id": "msg_fake",
            "output_index": 0,
            "content_index": 0,
            "text": text,
        },
        {
            "type": "response.content_part.done",
            "item_id": "msg_fake",
            "output_index": 0,
            "content_index": 0,
            "part": part_done,
        },
        {"type": "response.output_item.done", "output_index": 0, "item": done_item},
        {
            "type": "response.completed",
            "response": _response_object(
                model, "completed", [done_item], _responses_usage(chunks), store
            ),
        },
    ]
    for number, event in enumerate(events):
        event["sequence_number"] = number
        if not indexed:
            for index in ("sequence_number", "output_index", "content_index"):
                event.pop(index, None)
    return [(event["type"], _dumps(event)) for event in events]


def completed_response(model: str, chunks: int) -> bytes:
    """The `response` object of the stream's `response.completed` event, as sent."""
    item = _message_item(_text(chunks), "completed")
    return _dumps(_response_object(model, "completed", [item], _responses_usage(chunks)))


# --- tokenizers --------------------------------------------------------------------------------


def fake_tokens(text: str) -> list[int]:
    """The fake tokenizer: one token per whitespace-separated word."""
    return [len(word) for word in text.split()]


def tokenize_answer(dialect: str, path: str, payload: dict[str, Any]) -> tuple[int, bytes] | None:
    """The answer of a tokenizer endpoint in `dialect`; None when it has no such route."""
    if dialect == "llama_cpp" and path == "/tokenize":
        return 200, _dumps({"tokens": fake_tokens(str(payload.get("content", "")))})
    if dialect == "vllm" and path == "/tokenize":
        if "prompt" not in payload:
            return 400, _dumps({"object": "error", "message": "prompt is required", "code": 400})
        tokens = fake_tokens(str(payload["prompt"]))
        body = {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens}
        return 200, _dumps(body)
    if dialect == "llama_cpp_python" and path == "/extras/tokenize/count":
        return 200, _dumps({"count": len(fake_tokens(str(payload.get("input", ""))))})
    return None
