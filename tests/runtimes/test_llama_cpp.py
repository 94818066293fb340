"""IOP in front of a real llama.cpp server (llama-cpp-python 0.3.36, SmolLM2-135M-Instruct).

Opt-in (`just test-runtimes`, see `conftest.py`). The same server is called directly and
through a real Edge and Node, with the official openai SDK (sync and async, stream and
not): what a caller gets must match, field for field, and the four things this runtime
breaks in a gateway that calls it naively must hold:

1. while it generates it does not answer `GET /v1/models` (and a model listing that does
   get through cuts the stream it generates): the provider is `busy`, is not probed, and
   a second caller waits its turn in IOP's queue instead of getting a 503;
2. it answers invalid requests with 500: one caller's bad requests never take the model
   offline, and the caller reads llama.cpp's own message, as direct;
3. it ignores `stream_options.include_usage`: streams are metered with estimates
   (`usage_source: estimated`), never zero, cancelled ones too;
4. error replies carry `x-iop-provider`, `x-request-id` and `Server-Timing`.

Output is not compared word for word: the server's prompt cache makes even greedy
decoding differ between two identical calls. Lengths are pinned instead: the end-of-text
tokens are banned (`logit_bias`), so every answer runs to `max_tokens`. Lines starting
with `RESULT` are what the README reports (run with `-s` to see them).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any

import openai
import pytest
import trio
from pydantic import BaseModel

from schemas.tokens import estimate_input_tokens
from tests.e2e.stack import Stack, hang_up_after
from tests.e2e.upstreams import (
    ALIAS,
    MakeStack,
    all_idle,
    provider_of,
    upstream_provider,
)
from tests.runtimes.conftest import SERVED

# A real model loads and generates: minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.runtime, pytest.mark.timeout(900)]

#: Bound on one exchange with the runtime (a 135M model on 2 busy cores).
GUARD_S = 120.0
#: SmolLM2's end-of-text tokens (<|endoftext|>, <|im_end|>), banned so answers run to length.
NO_EOS = {"0": -100, "2": -100}
MESSAGES: list[Any] = [{"role": "user", "content": "Name three colours."}]
#: A tool-result turn with `content: null`: llama.cpp's request validation answers 500.
NULL_TOOL_RESULT: list[Any] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": None},
]
#: A response format llama-cpp-python 0.3.36 does not know: 500 as well.
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "colours", "schema": {"type": "object"}},
}
COOLDOWN = {"cooldown": {"failures": 3, "seconds": 60}}


def _adapter(**overrides: Any) -> dict[str, Any]:
    """Adapter settings for llama.cpp on a small shared machine: generous run budgets
    (it serves one request at a time; the next one waits upstream), quick probes."""
    return {
        "request_timeout_s": 300.0,
        "first_byte_timeout_s": 120.0,
        "health_interval_s": 0.25,
        **overrides,
    }


async def _one_provider(llama_server: str, make_stack: MakeStack) -> Stack:
    """Capacity 1: llama-cpp-python's server cuts the request it generates for when
    another arrives (`interrupt_requests`), so IOP must queue the second one itself."""
    provider = upstream_provider("llama", llama_server, served=SERVED, capacity=1, **_adapter())
    return await make_stack([provider], dispatch=COOLDOWN)


@pytest.fixture
async def one_provider(llama_server: str, make_stack: MakeStack) -> Stack:
    return await _one_provider(llama_server, make_stack)


@pytest.fixture
async def two_providers(llama_server: str, make_stack: MakeStack) -> Stack:
    """One server behind two providers, a `vllm` and an `openai_api`."""
    providers = [
        upstream_provider(
            "llama-vllm", llama_server, type="vllm", served=SERVED, capacity=1, **_adapter()
        ),
        upstream_provider(
            "llama-api", llama_server, type="openai_api", served=SERVED, capacity=1, **_adapter()
        ),
    ]
    return await make_stack(providers, dispatch=COOLDOWN)


def _shape(value: Any) -> Any:
    """The fields of an SDK object and the types of their values, recursively."""
    if isinstance(value, BaseModel):
        return _shape(value.model_dump())
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in sorted(value.items())}
    if isinstance(value, list):
        return [_shape(item) for item in value]
    return type(value).__name__


def _message(error: openai.APIStatusError) -> str:
    assert isinstance(error.body, dict)
    return str(error.body["message"])


def _ledger(stack: Stack) -> list[dict[str, Any]]:
    with sqlite3.connect(stack.edge.ledger.path) as db:
        db.row_factory = sqlite3.Row
        return [dict(row) for row in db.execute("SELECT * FROM usage ORDER BY time")]


# --- parity with calling llama.cpp directly ------------------------------------------------


@pytest.mark.parametrize("sdk", ["sync", "async"])
@pytest.mark.parametrize("stream", [False, True])
async def test_the_sdk_gets_what_it_gets_direct(
    llama_server: str, make_stack: MakeStack, sdk: str, stream: bool
) -> None:
    """Direct first, then through IOP. (While IOP runs, its probes of an idle server would
    cut a direct caller's stream: llama.cpp cannot tell a listing from a new request.)"""
    request: dict[str, Any] = {
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 0,
        "logit_bias": NO_EOS,
        "stream": stream,
    }
    direct = await _call(sdk, llama_server, {"model": SERVED, **request})
    stack = await _one_provider(llama_server, make_stack)
    via_iop = await _call(sdk, stack.base_url, {"model": ALIAS, **request})
    if not stream:
        assert via_iop.model == ALIAS and direct.model == SERVED
        assert _shape(via_iop) == _shape(direct)
        assert via_iop.usage == direct.usage  # llama.cpp's own numbers, passed on
        assert via_iop.choices[0].finish_reason == direct.choices[0].finish_reason == "length"
        assert via_iop.choices[0].message.content
        return
    assert {chunk.model for chunk in via_iop} == {ALIAS}
    assert [_shape(chunk) for chunk in via_iop] == [_shape(chunk) for chunk in direct]
    # A chunk per token either way, the same finish, and no usage chunk: not asked for.
    finish = [chunk.choices[0].finish_reason for chunk in via_iop if chunk.choices]
    assert finish == [chunk.choices[0].finish_reason for chunk in direct if chunk.choices]
    assert finish[-1] == "length"
    assert all(chunk.usage is None for chunk in [*via_iop, *direct])


async def test_completions_match_direct_too(llama_server: str, make_stack: MakeStack) -> None:
    request: dict[str, Any] = {
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "temperature": 0,
        "logit_bias": NO_EOS,
    }
    async with openai.AsyncOpenAI(base_url=llama_server, api_key="unused") as direct_client:
        with trio.fail_after(GUARD_S):
            direct = await direct_client.completions.create(model=SERVED, **request)
    stack = await _one_provider(llama_server, make_stack)
    async with stack.client() as client:
        with trio.fail_after(GUARD_S):
            via_iop = await client.completions.create(model=ALIAS, **request)
    assert _shape(via_iop) == _shape(direct)
    assert via_iop.usage == direct.usage
    assert via_iop.model == ALIAS


async def _available(stack: Stack) -> None:
    """Wait until every provider's probe answers again after a direct call.

    While llama.cpp serves a caller that bypasses IOP, IOP's probe of it times out with
    no run of its own in flight: from where IOP stands that is a runtime that does not
    answer, so the provider is `unavailable` until a probe gets through."""
    await stack.wait_catalog(
        lambda c: all(p["health"] == "available" for p in c["providers"]), within_s=GUARD_S
    )


async def _call(sdk: str, base_url: str, request: dict[str, Any]) -> Any:
    """One chat completion with the sync or async SDK: the response, or a stream's chunks."""
    if sdk == "sync":

        def call() -> Any:
            with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
                answer = client.chat.completions.create(**request)
                return list(answer) if request["stream"] else answer

        with trio.fail_after(GUARD_S):
            return await trio.to_thread.run_sync(call)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        with trio.fail_after(GUARD_S):
            answer = await client.chat.completions.create(**request)
            return [chunk async for chunk in answer] if request["stream"] else answer


# --- 1. busy is not down ------------------------------------------------------------------


async def test_a_generating_runtime_is_busy_and_the_next_caller_waits_its_turn(
    one_provider: Stack,
) -> None:
    stack = one_provider
    seen_busy: list[str] = []
    answers: list[str] = []

    async def long_stream(client: openai.AsyncOpenAI) -> None:
        stream = await client.chat.completions.create(
            model=ALIAS,
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=150,
            logit_bias=NO_EOS,
            stream=True,
        )
        answers.append("".join([c.choices[0].delta.content or "" async for c in stream]))

    async def next_caller(client: openai.AsyncOpenAI) -> None:
        completion = await client.chat.completions.create(
            model=ALIAS, messages=MESSAGES, max_tokens=8, logit_bias=NO_EOS
        )
        answers.append(completion.choices[0].message.content or "")

    with trio.fail_after(GUARD_S):
        async with stack.client() as client, trio.open_nursery() as callers:
            callers.start_soon(long_stream, client)
            catalog = await stack.wait_catalog(_health_is("busy"), within_s=GUARD_S)
            seen_busy.append(provider_of(catalog, "llama")["health_reason"])
            callers.start_soon(next_caller, client)
            await stack.wait_catalog(lambda c: c["models"][0]["queued"] == 1)
    print(f"RESULT busy: health_reason while generating: {seen_busy[0]!r}")
    assert "from IOP producing output at the runtime" in seen_busy[0]
    assert len(answers) == 2 and all(answers)
    assert len(answers[0]) > len(answers[1])  # the long story was not cut short
    await stack.wait_catalog(_health_is("available"), within_s=GUARD_S)
    assert all_idle(await stack.catalog())


def _health_is(health: str) -> Callable[[dict[str, Any]], bool]:
    def check(catalog: dict[str, Any]) -> bool:
        return bool(provider_of(catalog, "llama")["health"] == health)

    return check


# --- 2. blame -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_request",
    [{"messages": NULL_TOOL_RESULT}, {"messages": MESSAGES, "response_format": JSON_SCHEMA}],
    ids=["null-tool-result", "json-schema"],
)
async def test_bad_requests_never_take_the_model_offline(
    llama_server: str, two_providers: Stack, bad_request: dict[str, Any]
) -> None:
    stack = two_providers
    async with openai.AsyncOpenAI(base_url=llama_server, api_key="unused") as direct_client:
        with trio.fail_after(GUARD_S), pytest.raises(openai.APIStatusError) as direct:
            await direct_client.chat.completions.create(model=SERVED, max_tokens=4, **bad_request)
    await _available(stack)
    errors: list[openai.APIStatusError] = []
    with trio.fail_after(GUARD_S):
        async with stack.client(max_retries=2) as bad_caller:  # the SDK's default retries
            for _ in range(3):  # the cooldown threshold, three times over with the retries
                with pytest.raises(openai.APIStatusError) as caught:
                    await bad_caller.chat.completions.create(
                        model=ALIAS, max_tokens=4, **bad_request
                    )
                errors.append(caught.value)
        async with stack.client() as good_caller:
            completion = await good_caller.chat.completions.create(
                model=ALIAS, messages=MESSAGES, max_tokens=4
            )
    assert completion.choices[0].message.content
    for entry in (await stack.catalog())["providers"]:
        assert (entry["cooling_down"], entry["consecutive_failures"]) == (False, 0)
    for error in errors:
        assert error.status_code == direct.value.status_code == 500
        assert _message(error) == _message(direct.value)  # llama.cpp's own, whole
        assert error.response.headers["x-iop-provider"] in {"llama-vllm", "llama-api"}
        assert error.response.headers["x-request-id"].startswith("req_")
        assert "upstream;dur=" in error.response.headers["server-timing"]
    message = _message(direct.value)
    print(f"RESULT blame: llama.cpp's 500 message ({len(message)} chars) passed on whole")


# --- 3. metering with no gaps ---------------------------------------------------------------


async def test_streams_are_metered_with_estimates_never_zero(one_provider: Stack) -> None:
    stack = one_provider
    request: dict[str, Any] = {
        "model": ALIAS,
        "messages": MESSAGES,
        "max_tokens": 32,
        "logit_bias": NO_EOS,
    }
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            whole = await client.chat.completions.create(**request)
            stream = await client.chat.completions.create(
                **request, stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
            cancelled = await client.chat.completions.create(
                **{**request, "max_tokens": 200}, stream=True
            )
            await hang_up_after(cancelled, 5)
    assert whole.usage is not None and whole.usage.completion_tokens == 32
    assert all(chunk.usage is None for chunk in chunks)  # llama.cpp ignored the request
    await stack.wait_catalog(all_idle, within_s=GUARD_S)
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    reported, streamed, cut = _ledger(stack)
    assert (reported["usage_source"], reported["completion_tokens"]) == ("provider", 32)
    assert streamed["usage_source"] == "estimated" and streamed["status"] == 200
    # The runtime's tokenizer counted the streamed prompt (plus the template's share):
    # close to what llama.cpp itself counts for the same request.
    real = reported["prompt_tokens"]
    assert abs(streamed["prompt_tokens"] - real) <= real / 4, (streamed, real)
    assert abs(estimate_input_tokens({"messages": MESSAGES}) - real) <= real / 4
    assert streamed["completion_tokens"] > 0
    assert (cut["status"], cut["usage_source"]) == (499, "estimated")
    assert cut["completion_tokens"] >= 5
    print(
        "RESULT metering: 32-token stream estimated at "
        f"{streamed['prompt_tokens']}+{streamed['completion_tokens']} tokens "
        f"(llama.cpp counts {reported['prompt_tokens']}+{reported['completion_tokens']} "
        f"for the same request non-stream); cancelled after 5 chunks: "
        f"{cut['prompt_tokens']}+{cut['completion_tokens']} estimated"
    )


async def test_a_context_overflow_reaches_the_caller_as_context_length_exceeded(
    one_provider: Stack,
) -> None:
    """llama.cpp refuses a prompt past its context (2048 here) with OpenAI's
    `context_length_exceeded` when not streamed, and with an empty 200 when streamed: the
    caller gets the same 400, code and param either way, as calling it directly (its
    context size learnt from the first answer), and the provider stays healthy."""
    overflow = [{"role": "user", "content": "tell me everything " * 1500}]
    for stream in (False, True):
        with trio.fail_after(GUARD_S), pytest.raises(openai.BadRequestError) as caught:
            async with one_provider.client() as client:
                reply = await client.chat.completions.create(
                    model=ALIAS, messages=overflow, max_tokens=8, stream=stream
                )
                if stream:
                    async for _ in reply:  # type: ignore[union-attr]
                        pass
        error = caught.value
        assert (error.code, error.param) == ("context_length_exceeded", "messages"), error
        assert "2048" in error.message
    entry = provider_of(await one_provider.catalog(), "llama")
    assert entry["health"] == "available" and entry["consecutive_failures"] == 0
