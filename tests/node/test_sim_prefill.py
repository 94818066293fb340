"""The `sim` adapter's prompt prefix cache (iop_node.adapters.sim.sim_prefill): prefill time
per uncached token before the first token, the cached tokens in the chat usage, and an
LRU bounded in tokens (iop_node.adapters.sim.prefix_cache)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio

from iop_node.adapters.sim.adapter import SimAdapter
from iop_node.adapters.sim.prefix_cache import PrefillCost, PrefixCache
from schemas.config import AdapterSettings, ProviderConfig
from schemas.tokens import estimate_input_tokens
from schemas.wire import Run

SYSTEM = {"role": "system", "content": "You are a careful agent. " * 40}


def adapter(**settings: Any) -> SimAdapter:
    config = ProviderConfig(
        id="sim-1",
        type="sim",
        models=["sim-small"],
        capacity=4,
        adapter=AdapterSettings(ttft_ms=0, tokens_per_second=1000, **settings),
    )
    return SimAdapter(config)


def run(messages: list[dict[str, Any]], *, stream: bool = False) -> Run:
    body: dict[str, Any] = {"model": "sim-small", "messages": messages, "max_tokens": 1}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return Run(
        run_id="r",
        provider_id="sim-1",
        target="sim-small",
        operation="chat",
        body=msgspec.json.encode(body),
        stream=stream,
    )


async def _nothing(_: bytes) -> None:
    pass


async def answer(sim: SimAdapter, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], float]:
    """The usage of a non-stream chat run, and how long it took."""
    began = trio.current_time()
    result = await sim.execute(run(messages), _nothing)
    assert result.response is not None
    usage: dict[str, Any] = msgspec.json.decode(result.response)["usage"]
    return usage, trio.current_time() - began


async def test_a_conversations_next_turn_is_cached_and_starts_sooner(
    autojump_clock: trio.abc.Clock,
) -> None:
    sim = adapter(prefix_cache_tokens=100_000, prefill_us_per_token=1000.0)
    first = [SYSTEM, {"role": "user", "content": "Fix the test. " * 50}]
    usage, took = await answer(sim, first)
    prompt = estimate_input_tokens({"messages": first})
    assert usage["prompt_tokens"] == prompt
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert took == pytest.approx(prompt * 1e-3)  # the prefill, then the one token at once
    second = [*first, {"role": "assistant", "content": "done"}, {"role": "user", "content": "ok"}]
    usage, took = await answer(sim, second)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0.9 * prompt <= cached <= usage["prompt_tokens"]
    assert took == pytest.approx((usage["prompt_tokens"] - cached) * 1e-3)


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "ls"}}]])
async def test_a_prompt_sent_again_reports_all_but_its_last_token_cached(
    autojump_clock: trio.abc.Clock, tools: list[dict[str, Any]] | None
) -> None:
    """Cached tokens are counted in the usage's own unit, tools or not: a prompt sent
    again is cached but for the token a runtime computes again to start from."""
    sim = adapter(prefix_cache_tokens=100_000)
    messages = [{"role": "user", "content": "hello there"}]
    body: dict[str, Any] = {"model": "sim-small", "messages": messages, "max_tokens": 1}
    if tools is not None:
        body["tools"] = tools
    for sent in range(2):
        result = await sim.execute(
            Run(
                run_id=f"r{sent}",
                provider_id="sim-1",
                target="sim-small",
                operation="chat",
                body=msgspec.json.encode(body),
            ),
            _nothing,
        )
        assert result.response is not None
        usage = msgspec.json.decode(result.response)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


async def test_a_stream_reports_cached_tokens_in_its_usage_chunk(
    autojump_clock: trio.abc.Clock,
) -> None:
    sim = adapter(prefix_cache_tokens=100_000)
    messages = [SYSTEM, {"role": "user", "content": "hello"}]
    await answer(sim, messages)
    chunks: list[dict[str, Any]] = []

    async def emit(data: bytes) -> None:
        chunks.append(msgspec.json.decode(data))

    await sim.execute(run(messages, stream=True), emit)
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


async def test_without_a_cache_the_usage_says_nothing_of_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    usage, took = await answer(adapter(), [{"role": "user", "content": "hi"}])
    assert "prompt_tokens_details" not in usage
    assert took == 0.0  # ttft 0, no prefill cost


def test_a_cache_bounded_in_tokens_forgets_the_least_recently_used_prompt() -> None:
    cache = PrefixCache(PrefillCost(uncached_us=1.0, cached_us=0.0), slots=64, max_tokens=300)
    one, two = "a" * 800, "b" * 800  # 200 tokens each: both do not fit
    assert cache.prefill(one).cached_tokens == 0
    assert cache.prefill(two).cached_tokens == 0
    assert cache.prefill(one).cached_tokens == 0  # evicted by `two`
    assert cache.prefill(one + "more").cached_tokens == 200  # its continuation: cached


def test_a_prompt_sharing_only_a_head_is_kept_beside_the_other() -> None:
    """Bounded in tokens, two conversations with one system prompt both stay cached."""
    cache = PrefixCache(PrefillCost(uncached_us=1.0, cached_us=0.0), slots=64, max_tokens=10_000)
    head = "s" * 400
    cache.prefill(head + "x" * 400)
    cache.prefill(head + "y" * 400)
    assert cache.prefill(head + "x" * 400 + "next").cached_tokens == 200
    assert cache.prefill(head + "y" * 400 + "next").cached_tokens == 200
