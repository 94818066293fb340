"""The `sim` provider: a built-in simulated local inference engine (design §9).

It is a real adapter, not a test double: the demo's default provider and the workhorse
of tests and benchmarks. It behaves like a small OpenAI-compatible engine with a known,
tunable speed, so latency, streaming, cancellation and metering can be exercised without
a GPU:

- time to first token is `adapter.ttft_ms` (default 20), then one token per chunk at
  `adapter.tokens_per_second` (default 200), on an absolute schedule so the pace does not
  drift with back-pressure;
- what it says depends on `adapter.reply.mode`. `fill` (the default, what tests and
  benchmarks measure with): exactly `max_completion_tokens` / `max_tokens` tokens
  (default 16, at most `MAX_TOKENS`, its "context length"), so every response ends with
  `finish_reason: "length"`, and never a tool call. `model` (the demo's): a reply of a
  natural length that ends with `stop`, and tool calls when tools are offered
  (`sim_replies` has the rules);
- the text is deterministic: words cycled from a fixed list, starting at an offset
  derived from the prompt (and, in `model` mode, `reply.seed`), so the same request
  always yields the same text;
- usage numbers are real: prompt tokens come from `schemas.tokens`, the same estimator
  the Edge uses for admission, and completion tokens are the tokens generated;
- with `adapter.max_loaded` it holds only that many of its models at once and loads
  the others on demand (`adapters.sim.sim_memory`), as a router runtime does;
- a chat run may model a runtime's prompt prefix cache (`adapters.sim.sim_prefill`: the
  prefill of the tokens not cached adds to the time to first token, and the usage says
  how many were cached);
- every wait is a Trio sleep, so cancelling the run's scope stops it at once, and no
  request can make it block the Node's event loop or grow without bound: tokens come
  one at a time, and embeddings are bounded in count and size and computed with a
  checkpoint per input.

It speaks chat completions only: a Messages or Responses run reaches it translated by
the Node (`protocol_run`), tool calls included. Responses are OpenAI objects
(`chat.completion[.chunk]`, `text_completion`, embedding `list`), encoded with msgspec
from the shared Structs of `schemas.openai`; like the engines it imitates, it sends
`logprobs: null` in every choice. A completion request produces one choice (a list
`prompt` seeds one text); embeddings honour `dimensions` and the `encoding_format:
base64` the official SDKs ask for by default.
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

from iop_node.adapters.base import AdapterError, Emit, ModelCommandFailed, RunResult
from iop_node.adapters.sim.sim_memory import SIM_LIFECYCLE, SimMemory
from iop_node.adapters.sim.sim_prefill import SimPrefill
from iop_node.adapters.sim.sim_replies import WORDS, PlannedCall, ReplyPlan, plan_reply, plan_text
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
    FunctionCall,
    TextChoice,
    TextCompletion,
    ToolCall,
)
from schemas.tokens import CHARS_PER_TOKEN, estimate_input_tokens
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


_encode = msgspec.json.Encoder().encode
_request_decoder = msgspec.json.Decoder(dict[str, Any])


class SimAdapter:
    """A simulated engine serving `provider.models` at the configured speed."""

    def __init__(self, provider: ProviderConfig) -> None:
        self.provider = provider
        settings = provider.adapter
        self._ttft_s = settings.ttft_ms / 1000
        self._token_interval_s = 1 / settings.tokens_per_second
        self.memory = SimMemory.of(provider)
        """Which models it holds, when it holds only some (`adapter.max_loaded`)."""
        self._prefill = SimPrefill(settings)

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        body = self._parse(run)
        if self.memory is None:
            return await self._operation(run, body, emit)
        async with self.memory.serving(run.target):
            return await self._operation(run, body, emit)

    async def _operation(self, run: Run, body: dict[str, Any], emit: Emit) -> RunResult:
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
        memory = self.memory
        if memory is None:
            return ProviderStatus(
                id=self.provider.id, health="available", models=[*self.provider.models]
            )
        return ProviderStatus(
            id=self.provider.id,
            health="available",
            models=[*self.provider.models],
            lifecycle=SIM_LIFECYCLE,
            model_states=memory.states(),
            max_loaded=memory.max_loaded,
        )

    async def load_model(self, model: str) -> None:
        """`base.ModelLifecycle`, for a sim with `adapter.max_loaded`."""
        await self._memory_or_refuse().load(model)

    async def unload_model(self, model: str) -> None:
        await self._memory_or_refuse().unload(model)

    def _memory_or_refuse(self) -> SimMemory:
        if self.memory is None:
            raise ModelCommandFailed("this sim holds every model always (no adapter.max_loaded)")
        return self.memory

    async def aclose(self) -> None:
        """Nothing to release: the engine holds no connections."""

    # --- operations --------------------------------------------------------------------

    async def _chat(self, run: Run, body: dict[str, Any], emit: Emit) -> RunResult:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise _invalid("`messages` must be a list")
        if self.provider.adapter.reply.mode == "model":
            # A model without `max_tokens` stops by itself, within its context.
            cap = _max_tokens(body, default=MAX_TOKENS)
            plan = plan_reply(body, self.provider.adapter.reply, cap)
        else:
            plan = ReplyPlan(_generate(_encode(messages), _max_tokens(body)), None, "length")
        pieces, finish_reason = plan.pieces, plan.finish_reason
        call_pieces = _argument_pieces(plan.call)
        usage = _usage(body, len(pieces) + len(call_pieces))
        cached = self._prefill.cached(body, usage.prompt_tokens)
        if cached.tokens:  # what the Node meters, beside what the caller reads
            usage = msgspec.structs.replace(usage, cached_tokens=cached.tokens)
        completion_id, created = f"chatcmpl-{run.request_id or run.run_id}", int(time.time())
        start = trio.current_time() + cached.seconds
        if not run.stream:
            await self._until_token(start, usage.completion_tokens - 1)
            if plan.call is None:
                message = AssistantMessage(content="".join(pieces))
            else:
                call = plan.call
                function = FunctionCall(name=call.name, arguments=call.arguments)
                tool_call = ToolCall(id=call.id, type="function", function=function)
                message = AssistantMessage(content=None, tool_calls=[tool_call])
            choice = ChatChoice(message=message, logprobs=None, finish_reason=finish_reason)
            response = ChatCompletion(
                id=completion_id,
                created=created,
                model=run.target,
                choices=[choice],
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
        if plan.call is not None:
            call = plan.call
            for index, fragment in enumerate(call_pieces):
                await self._until_token(start, index)
                first = index == 0
                function = FunctionCall(name=call.name if first else None, arguments=fragment)
                tool_call = ToolCall(
                    index=0,
                    id=call.id if first else None,
                    type="function" if first else None,
                    function=function,
                )
                await emit(chunk(Delta(tool_calls=[tool_call])))
        await emit(chunk(Delta(), finish_reason=finish_reason))
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
        if self.provider.adapter.reply.mode == "model":
            plan = plan_text(body, self.provider.adapter.reply, _max_tokens(body, MAX_TOKENS))
        else:
            plan = ReplyPlan(_generate(_encode(prompt), _max_tokens(body)), None, "length")
        pieces, finish_reason = plan.pieces, plan.finish_reason
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
            choice = TextChoice(text="".join(pieces), finish_reason=finish_reason)
            return RunResult(usage=usage, response=completion([choice], CompletionUsage.of(usage)))

        for index, piece in enumerate(pieces):
            await self._until_token(start, index)
            await emit(completion([TextChoice(text=piece)]))
        await self._until_token(start, 0)  # no-op unless zero tokens were asked for
        await emit(completion([TextChoice(text="", finish_reason=finish_reason)]))
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
            # The Edge sends a provider only the models its config says it serves, and
            # this provider's models come from that config: a target it lacks means this
            # Node's copy is behind a refresh. Another provider may serve the run
            # (retryable, as `unknown_provider` is), and the Edge blames nobody for it.
            raise AdapterError(
                FailureCode.MODEL_NOT_FOUND,
                f"sim provider {self.provider.id!r} does not serve model {run.target!r}",
                retryable=True,
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


def _max_tokens(body: dict[str, Any], default: int = DEFAULT_MAX_TOKENS) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _invalid(f"`{key}` must be a non-negative integer")
        if value > MAX_TOKENS:
            raise _invalid(f"`{key}` must be at most {MAX_TOKENS} (this engine's context)")
        return value
    return default


def _generate(seed: bytes, count: int) -> list[str]:
    """`count` token strings: words cycled from `WORDS`, starting where the seed says."""
    offset = int.from_bytes(hashlib.blake2b(seed, digest_size=8).digest(), "big")
    return [
        ("" if index == 0 else " ") + WORDS[(offset + index) % len(WORDS)] for index in range(count)
    ]


def _argument_pieces(call: PlannedCall | None) -> list[str]:
    """A tool call's arguments as it streams them: one token's worth of text a chunk
    (`schemas.tokens`' characters per token), at least one chunk (`{}` is one token)."""
    if call is None:
        return []
    text = call.arguments
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)] or [""]


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
