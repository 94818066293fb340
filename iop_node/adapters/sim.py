"""The `sim` provider: a built-in simulated local inference engine (design §9).

It is a real adapter, not a test double: the demo's default provider and the workhorse
of tests and benchmarks. It behaves like a small OpenAI-compatible engine with a known,
tunable speed, so latency, streaming, cancellation and metering can be exercised without
a GPU:

- time to first token is `adapter.ttft_ms` (default 20), then one token per chunk at
  `adapter.tokens_per_second` (default 200), on an absolute schedule so the pace does not
  drift with back-pressure;
- it generates exactly `max_completion_tokens` / `max_tokens` tokens (default 16, at
  most `MAX_TOKENS`, its "context length"), so every response ends with
  `finish_reason: "length"`;
- the text is deterministic: words cycled from a fixed list, starting at an offset
  derived from the prompt, so the same request always yields the same text;
- usage numbers are real: prompt tokens come from `schemas.tokens`, the same estimator
  the Edge uses for admission, and completion tokens are the tokens generated;
- a chat run may model a runtime's prompt prefix cache (`adapters.sim_prefill`: the
  prefill of the tokens not cached adds to the time to first token, and the usage says
  how many were cached);
- every wait is a Trio sleep, so cancelling the run's scope stops it at once, and no
  request can make it block the Node's event loop or grow without bound: tokens come
  one at a time, and embeddings are bounded in count and size and computed with a
  checkpoint per input.

Responses are OpenAI objects (`chat.completion[.chunk]`, `text_completion`, embedding
`list`), encoded with msgspec from the shared Structs of `schemas.openai`; like the
engines it imitates, it sends `logprobs: null` in every choice. A completion request produces one
choice (a list `prompt` seeds one text); embeddings honour `dimensions` and the
`encoding_format: base64` the official SDKs ask for by default.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import time
from typing import Any

import msgspec
import trio
from msgspec import UNSET, UnsetType

from iop_node.adapters.base import AdapterError, Emit, RunResult
from iop_node.adapters.sim_prefill import SimPrefill
from schemas.config import ProviderConfig
from schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    CompletionUsage,
    Delta,
    Embedding,
    EmbeddingList,
    EmbeddingUsage,
    TextChoice,
    TextCompletion,
)
from schemas.tokens import estimate_input_tokens
from schemas.wire import FailureCode, ProviderStatus, Run, Usage

DEFAULT_MAX_TOKENS = 16
#: The engine's context: a larger `max_tokens` is refused, as a real engine refuses one
#: past its context length. What one run can cost the Node (time, memory) is bounded by it.
MAX_TOKENS = 65_536
EMBEDDING_DIMENSIONS = 16
MAX_EMBEDDING_DIMENSIONS = 4096
#: OpenAI's bound on inputs per embedding request.
MAX_EMBEDDING_INPUTS = 2048
#: Bound on inputs x dimensions: the response stays a few MB and the work a few hundred
#: milliseconds, spread over checkpoints.
MAX_EMBEDDING_VALUES = 1 << 20

#: The vocabulary of the simulated engine. Any fixed list works; this one reads well.
WORDS: tuple[str, ...] = (
    "the", "engine", "answers", "with", "simulated", "tokens", "that", "arrive",
    "at", "a", "steady", "pace", "while", "the", "gateway", "routes", "each",
    "request", "to", "a", "provider", "slot", "and", "streams", "every", "chunk",
    "back", "through", "one", "calm", "endpoint", "today",
)  # fmt: skip


_encode = msgspec.json.Encoder().encode
_request_decoder = msgspec.json.Decoder(dict[str, Any])


class SimAdapter:
    """A simulated engine serving `provider.models` at the configured speed."""

    def __init__(self, provider: ProviderConfig) -> None:
        self.provider = provider
        settings = provider.adapter
        self._ttft_s = settings.ttft_ms / 1000
        self._token_interval_s = 1 / settings.tokens_per_second
        self._prefill = SimPrefill(settings)

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        body = self._parse(run)
        match run.operation:
            case "chat":
                return await self._chat(run, body, emit)
            case "completion":
                return await self._completion(run, body, emit)
            case "embedding":
                return await self._embedding(run, body)
        raise AdapterError(FailureCode.INVALID_REQUEST, f"unsupported operation {run.operation!r}")

    async def probe(self) -> ProviderStatus:
        """The engine lives in this process: it is available whenever it exists."""
        return ProviderStatus(
            id=self.provider.id, health="available", models=[*self.provider.models]
        )

    async def aclose(self) -> None:
        """Nothing to release: the engine holds no connections."""

    # --- operations --------------------------------------------------------------------

    async def _chat(self, run: Run, body: dict[str, Any], emit: Emit) -> RunResult:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise _invalid("`messages` must be a list")
        pieces = _generate(_encode(messages), _max_tokens(body))
        usage = _usage(body, len(pieces))
        cached = self._prefill.cached(body, usage.prompt_tokens)
        completion_id, created = f"chatcmpl-{run.request_id or run.run_id}", int(time.time())
        start = trio.current_time() + cached.seconds
        if not run.stream:
            await self._until_token(start, len(pieces) - 1)
            message = AssistantMessage(content="".join(pieces))
            response = ChatCompletion(
                id=completion_id,
                created=created,
                model=run.target,
                choices=[ChatChoice(message=message, logprobs=None, finish_reason="length")],
                usage=CompletionUsage.of(usage, cached_tokens=cached.tokens),
            )
            return RunResult(usage=usage, response=_encode(response))

        def chunk(delta: Delta, finish_reason: str | None = None) -> bytes:
            choice = ChunkChoice(delta=delta, logprobs=None, finish_reason=finish_reason)
            return _encode(
                ChatCompletionChunk(
                    id=completion_id, created=created, model=run.target, choices=[choice]
                )
            )

        await self._until_token(start, 0)
        await emit(chunk(Delta(role="assistant", content="")))
        for index, piece in enumerate(pieces):
            await self._until_token(start, index)
            await emit(chunk(Delta(content=piece)))
        await emit(chunk(Delta(), finish_reason="length"))
        if _include_usage(body):
            last = ChatCompletionChunk(
                id=completion_id,
                created=created,
                model=run.target,
                choices=[],
                usage=CompletionUsage.of(usage, cached_tokens=cached.tokens),
            )
            await emit(_encode(last))
        return RunResult(usage=usage)

    async def _completion(self, run: Run, body: dict[str, Any], emit: Emit) -> RunResult:
        prompt = body.get("prompt")
        if prompt is None:
            raise _invalid("`prompt` is required")
        pieces = _generate(_encode(prompt), _max_tokens(body))
        usage = _usage(body, len(pieces))
        completion_id, created = f"cmpl-{run.request_id or run.run_id}", int(time.time())
        start = trio.current_time()

        def completion(
            choices: list[TextChoice], usage_body: CompletionUsage | UnsetType = UNSET
        ) -> bytes:
            return _encode(
                TextCompletion(
                    id=completion_id,
                    created=created,
                    model=run.target,
                    choices=choices,
                    usage=usage_body,
                )
            )

        if not run.stream:
            await self._until_token(start, len(pieces) - 1)
            choice = TextChoice(text="".join(pieces), finish_reason="length")
            return RunResult(usage=usage, response=completion([choice], CompletionUsage.of(usage)))

        for index, piece in enumerate(pieces):
            await self._until_token(start, index)
            await emit(completion([TextChoice(text=piece)]))
        await self._until_token(start, 0)  # no-op unless zero tokens were asked for
        await emit(completion([TextChoice(text="", finish_reason="length")]))
        if _include_usage(body):
            await emit(completion([], CompletionUsage.of(usage)))
        return RunResult(usage=usage)

    async def _embedding(self, run: Run, body: dict[str, Any]) -> RunResult:
        inputs = _embedding_inputs(body.get("input"))
        dimensions = _dimensions(body)
        as_base64 = body.get("encoding_format") == "base64"
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise _invalid(f"`input` must have at most {MAX_EMBEDDING_INPUTS} items")
        if len(inputs) * dimensions > MAX_EMBEDDING_VALUES:
            raise _invalid(
                f"{len(inputs)} inputs x {dimensions} dimensions exceeds this engine's "
                f"{MAX_EMBEDDING_VALUES} values per request"
            )
        await self._until_token(trio.current_time(), 0)  # one forward pass
        data: list[Embedding] = []
        for index, item in enumerate(inputs):
            await trio.lowlevel.checkpoint()  # a large batch never holds the event loop
            vector = _vector(_encode(item), dimensions)
            encoded: list[float] | str = (
                base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode("ascii")
                if as_base64
                else vector
            )
            data.append(Embedding(index=index, embedding=encoded))
        prompt_tokens = estimate_input_tokens(body)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)
        response = EmbeddingList(
            data=data,
            model=run.target,
            usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        )
        return RunResult(usage=usage, response=_encode(response))

    # --- helpers -----------------------------------------------------------------------

    def _parse(self, run: Run) -> dict[str, Any]:
        models = self.provider.models
        if models and run.target not in models:
            raise AdapterError(
                FailureCode.MODEL_NOT_FOUND,
                f"sim provider {self.provider.id!r} does not serve model {run.target!r}",
                status=404,
            )
        try:
            return _request_decoder.decode(run.body)
        except msgspec.DecodeError as exc:
            raise _invalid(f"request body is not a JSON object: {exc}") from None

    async def _until_token(self, start: float, index: int) -> None:
        """Sleep until token `index` is due: `ttft` for the first, then one per interval."""
        await trio.sleep_until(start + self._ttft_s + max(index, 0) * self._token_interval_s)


def _invalid(message: str) -> AdapterError:
    return AdapterError(FailureCode.INVALID_REQUEST, message, status=400)


def _max_tokens(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _invalid(f"`{key}` must be a non-negative integer")
        if value > MAX_TOKENS:
            raise _invalid(f"`{key}` must be at most {MAX_TOKENS} (this engine's context)")
        return value
    return DEFAULT_MAX_TOKENS


def _generate(seed: bytes, count: int) -> list[str]:
    """`count` token strings: words cycled from `WORDS`, starting where the seed says."""
    offset = int.from_bytes(hashlib.blake2b(seed, digest_size=8).digest(), "big")
    return [
        ("" if index == 0 else " ") + WORDS[(offset + index) % len(WORDS)] for index in range(count)
    ]


def _usage(body: dict[str, Any], completion_tokens: int) -> Usage:
    prompt_tokens = estimate_input_tokens(body)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _embedding_inputs(value: object) -> list[object]:
    """OpenAI's `input`: a string, a token array, or a list of either."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            return [value]  # one token array
        if all(isinstance(item, str | list) for item in value):
            return list(value)
    raise _invalid("`input` must be a string, a token array or a non-empty list of them")


def _dimensions(body: dict[str, Any]) -> int:
    value = body.get("dimensions")
    if value is None:
        return EMBEDDING_DIMENSIONS
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid("`dimensions` must be an integer")
    if not 1 <= value <= MAX_EMBEDDING_DIMENSIONS:
        raise _invalid(f"`dimensions` must be between 1 and {MAX_EMBEDDING_DIMENSIONS}")
    return value


def _vector(seed: bytes, dimensions: int) -> list[float]:
    """A deterministic unit vector derived from the input's bytes."""
    raw = hashlib.shake_256(seed).digest(2 * dimensions)
    values = [
        int.from_bytes(raw[2 * i : 2 * i + 2], "big") / 32767.5 - 1.0 for i in range(dimensions)
    ]
    norm = sum(value * value for value in values) ** 0.5 or 1.0
    return [value / norm for value in values]
