"""The `sim` adapter: OpenAI shapes, pacing, usage, determinism and cancellation."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import msgspec
import pytest
import trio

from iop_node.adapters.base import AdapterError, RunResult
from iop_node.adapters.sim.adapter import DEFAULT_MAX_TOKENS, EMBEDDING_DIMENSIONS, SimAdapter
from iop_node.reply import ParsedChunk
from schemas.config import AdapterSettings, ProviderConfig
from schemas.tokens import estimate_input_tokens
from schemas.wire import Operation, Run, Usage

TTFT_S = 0.020
INTERVAL_S = 1 / 200


def _adapter(**settings: Any) -> SimAdapter:
    return SimAdapter(
        ProviderConfig(
            id="gpu1-sim",
            type="sim",
            models=["sim-small"],
            capacity=4,
            adapter=AdapterSettings(**settings),
        )
    )


def _run(
    body: dict[str, Any],
    *,
    operation: Operation = "chat",
    stream: bool = False,
    run_id: str = "run-1",
    target: str = "sim-small",
) -> Run:
    return Run(
        run_id=run_id,
        provider_id="gpu1-sim",
        target=target,
        operation=operation,
        body=msgspec.json.encode(body),
        stream=stream,
    )


class _Recorder:
    """An `emit` that records each chunk (decoded) and when it was emitted."""

    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.times: list[float] = []

    async def __call__(self, data: bytes) -> None:
        self.chunks.append(msgspec.json.decode(data))
        self.times.append(trio.current_time())


CHAT = {"model": "sim-small", "messages": [{"role": "user", "content": "Say something nice."}]}


async def _execute(adapter: SimAdapter, run: Run) -> tuple[RunResult, _Recorder, float]:
    recorder = _Recorder()
    start = trio.current_time()
    result = await adapter.execute(run, recorder)
    return result, recorder, trio.current_time() - start


async def test_chat_stream_paces_tokens_and_ends_with_length(
    autojump_clock: trio.abc.Clock,
) -> None:
    start = trio.current_time()
    result, recorder, elapsed = await _execute(
        _adapter(), _run({**CHAT, "max_tokens": 4}, stream=True)
    )
    chunks = recorder.chunks
    assert [chunk["object"] for chunk in chunks] == ["chat.completion.chunk"] * 6
    assert {chunk["id"] for chunk in chunks} == {"chatcmpl-run-1"}
    assert {chunk["model"] for chunk in chunks} == {"sim-small"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [chunk["choices"][0]["delta"]["content"] for chunk in chunks[1:5]]
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:5])
    assert chunks[5]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert all("usage" not in chunk for chunk in chunks)
    # First token after the TTFT, then one token per interval.
    token_times = [time - start for time in recorder.times[1:5]]
    assert token_times == pytest.approx([TTFT_S + i * INTERVAL_S for i in range(4)])
    assert elapsed == pytest.approx(TTFT_S + 3 * INTERVAL_S)
    prompt_tokens = estimate_input_tokens({**CHAT, "max_tokens": 4})
    assert result == RunResult(
        usage=Usage(
            prompt_tokens=prompt_tokens, completion_tokens=4, total_tokens=prompt_tokens + 4
        )
    )
    assert len(contents) == 4 and not contents[0].startswith(" ")


async def test_chat_stream_include_usage_adds_a_final_usage_chunk(
    autojump_clock: trio.abc.Clock,
) -> None:
    body = {**CHAT, "max_completion_tokens": 3, "stream_options": {"include_usage": True}}
    result, recorder, _ = await _execute(_adapter(), _run(body, stream=True))
    last = recorder.chunks[-1]
    assert last["choices"] == []
    assert last["usage"] == msgspec.to_builtins(result.usage)
    assert last["usage"]["completion_tokens"] == 3
    assert recorder.chunks[-2]["choices"][0]["finish_reason"] == "length"


async def test_chat_non_stream_matches_the_streamed_text(autojump_clock: trio.abc.Clock) -> None:
    adapter = _adapter()
    body = {**CHAT, "max_tokens": 5}
    streamed, recorder, _ = await _execute(adapter, _run(body, stream=True))
    result, nothing, elapsed = await _execute(adapter, _run(body, run_id="run-2"))
    assert nothing.chunks == []
    assert result.response is not None
    response = msgspec.json.decode(result.response)
    assert response["object"] == "chat.completion"
    assert response["id"] == "chatcmpl-run-2"
    assert response["model"] == "sim-small"
    assert isinstance(response["created"], int)
    choice = response["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    streamed_text = "".join(
        chunk["choices"][0]["delta"].get("content", "") for chunk in recorder.chunks
    )
    assert choice["message"]["content"] == streamed_text
    assert len(streamed_text.split(" ")) == 5
    assert (
        response["usage"]
        == msgspec.to_builtins(result.usage)
        == msgspec.to_builtins(streamed.usage)
    )
    # A non-stream request takes as long as generating every token.
    assert elapsed == pytest.approx(TTFT_S + 4 * INTERVAL_S)


async def test_text_is_deterministic_per_prompt(autojump_clock: trio.abc.Clock) -> None:
    adapter = _adapter()

    async def text(content: str) -> str:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8}
        result, _, _ = await _execute(adapter, _run(body))
        assert result.response is not None
        content_out: str = msgspec.json.decode(result.response)["choices"][0]["message"]["content"]
        return content_out

    assert await text("hello") == await text("hello")
    assert await text("hello") != await text("a different prompt")
    # A fresh adapter (another process) produces the same text for the same request.
    other, _, _ = await _execute(
        _adapter(), _run({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
    )
    assert other.response is not None
    assert msgspec.json.decode(other.response)["choices"][0]["message"]["content"] == await text(
        "hello"
    )


async def test_max_tokens_default_and_precedence(autojump_clock: trio.abc.Clock) -> None:
    adapter = _adapter()
    result, _, _ = await _execute(adapter, _run(CHAT))
    assert result.usage is not None and result.usage.completion_tokens == DEFAULT_MAX_TOKENS
    both = {**CHAT, "max_tokens": 9, "max_completion_tokens": 2}
    result, _, _ = await _execute(adapter, _run(both))
    assert result.usage is not None and result.usage.completion_tokens == 2


async def test_speed_follows_the_provider_settings(autojump_clock: trio.abc.Clock) -> None:
    adapter = _adapter(ttft_ms=100, tokens_per_second=10)
    _, _, elapsed = await _execute(adapter, _run({**CHAT, "max_tokens": 3}))
    assert elapsed == pytest.approx(0.1 + 2 * 0.1)


async def test_completion_stream_and_non_stream(autojump_clock: trio.abc.Clock) -> None:
    adapter = _adapter()
    body = {
        "model": "sim-small",
        "prompt": "Once upon a time",
        "max_tokens": 3,
        "stream_options": {"include_usage": True},
    }
    streamed, recorder, _ = await _execute(adapter, _run(body, operation="completion", stream=True))
    chunks = recorder.chunks
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert {chunk["id"] for chunk in chunks} == {"cmpl-run-1"}
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[:4]] == [
        None,
        None,
        None,
        "length",
    ]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks[:4])

    result, _, _ = await _execute(adapter, _run(body, operation="completion"))
    assert result.response is not None
    response = msgspec.json.decode(result.response)
    assert response["object"] == "text_completion"
    assert response["choices"][0]["text"] == text
    assert response["choices"][0]["finish_reason"] == "length"
    prompt_tokens = estimate_input_tokens(body)
    assert response["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 3,
        "total_tokens": prompt_tokens + 3,
    }
    assert result.usage == streamed.usage


async def test_embeddings_are_deterministic_unit_vectors(autojump_clock: trio.abc.Clock) -> None:
    adapter = _adapter()
    body = {"model": "sim-small", "input": ["first text", "second text", "first text"]}
    result, recorder, elapsed = await _execute(adapter, _run(body, operation="embedding"))
    assert recorder.chunks == []
    assert elapsed == pytest.approx(TTFT_S)
    assert result.response is not None
    response = msgspec.json.decode(result.response)
    assert response["object"] == "list"
    assert response["model"] == "sim-small"
    data = response["data"]
    assert [item["index"] for item in data] == [0, 1, 2]
    assert {item["object"] for item in data} == {"embedding"}
    vectors = [item["embedding"] for item in data]
    assert all(len(vector) == EMBEDDING_DIMENSIONS for vector in vectors)
    assert all(math.isclose(math.hypot(*vector), 1.0) for vector in vectors)
    assert vectors[0] == vectors[2] != vectors[1]
    prompt_tokens = estimate_input_tokens(body)
    assert prompt_tokens > 0
    assert response["usage"] == {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    assert result.usage == Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)


async def test_embeddings_single_input_base64_and_dimensions(
    autojump_clock: trio.abc.Clock,
) -> None:
    adapter = _adapter()
    plain, _, _ = await _execute(adapter, _run({"input": "hi"}, operation="embedding"))
    encoded, _, _ = await _execute(
        adapter, _run({"input": "hi", "encoding_format": "base64"}, operation="embedding")
    )
    assert plain.response is not None and encoded.response is not None
    vector = msgspec.json.decode(plain.response)["data"][0]["embedding"]
    raw = base64.b64decode(msgspec.json.decode(encoded.response)["data"][0]["embedding"])
    assert list(struct.unpack(f"<{EMBEDDING_DIMENSIONS}f", raw)) == pytest.approx(vector, rel=1e-6)

    wide, _, _ = await _execute(
        adapter, _run({"input": [[1, 2, 3]], "dimensions": 64}, operation="embedding")
    )
    assert wide.response is not None
    assert len(msgspec.json.decode(wide.response)["data"][0]["embedding"]) == 64


async def test_cancellation_stops_at_once(autojump_clock: trio.abc.Clock) -> None:
    adapter = _adapter(ttft_ms=10, tokens_per_second=1)
    chunks: list[bytes] = []
    with trio.CancelScope() as scope:

        async def emit(data: bytes, parsed: ParsedChunk | None = None, /) -> None:
            chunks.append(data)
            if len(chunks) == 2:  # the role chunk and the first token
                scope.cancel()

        await adapter.execute(_run({**CHAT, "max_tokens": 100}, stream=True), emit)
    assert scope.cancelled_caught
    assert len(chunks) == 2
    # Cancelled right at the first token: no waiting for the next one (a second away).
    assert trio.current_time() == pytest.approx(0.010)


@pytest.mark.parametrize(
    ("run", "code", "status"),
    [
        (_run({**CHAT, "max_tokens": -1}), "invalid_request", 400),
        (_run({**CHAT, "max_tokens": "many"}), "invalid_request", 400),
        (_run({"prompt": "no messages"}), "invalid_request", 400),
        (_run({"messages": []}, operation="completion"), "invalid_request", 400),
        (_run({"input": []}, operation="embedding"), "invalid_request", 400),
        (_run({"input": "x", "dimensions": 0}, operation="embedding"), "invalid_request", 400),
    ],
)
async def test_bad_requests_fail_like_an_engine(run: Run, code: str, status: int) -> None:
    with pytest.raises(AdapterError) as info:
        await _adapter().execute(run, _Recorder())
    assert (info.value.code, info.value.status, info.value.retryable) == (code, status, False)


async def test_a_model_it_does_not_serve_is_failed_over_not_the_callers_error() -> None:
    with pytest.raises(AdapterError) as info:
        await _adapter().execute(_run(CHAT, target="other-model"), _Recorder())
    assert (info.value.code, info.value.status, info.value.retryable) == (
        "model_not_found",
        404,
        True,
    )


async def test_body_that_is_not_a_json_object_is_rejected() -> None:
    run = msgspec.structs.replace(_run(CHAT), body=b"[1, 2")
    with pytest.raises(AdapterError, match="JSON object") as info:
        await _adapter().execute(run, _Recorder())
    assert info.value.code == "invalid_request"


async def test_probe_reports_available_with_models() -> None:
    status = await _adapter().probe()
    assert (status.id, status.health, status.models) == ("gpu1-sim", "available", ["sim-small"])
