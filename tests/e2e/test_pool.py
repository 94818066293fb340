"""The provider pool end to end: spreading, ranking, queueing, long slots, slot release."""

from __future__ import annotations

import collections
import functools
import sqlite3
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
import trio

from tests.e2e.stack import NODE_TOKEN_HASH, Stack, edge_config, sim_provider, start_stack
from tests.timing import GUARD_S

MESSAGES = [{"role": "user", "content": "hi"}]
SLOW = {"ttft_ms": 5, "tokens_per_second": 50}


def _provider(catalog: dict[str, Any], provider_id: str) -> dict[str, Any]:
    return next(p for p in catalog["providers"] if p["id"] == provider_id)


def _all_idle(catalog: dict[str, Any]) -> bool:
    return all(p["in_flight"] == 0 and p["long_in_flight"] == 0 for p in catalog["providers"])


async def _chat(client: openai.AsyncOpenAI, model: str = "m", **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 4)
    return await client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, **kwargs
    )


async def test_identical_providers_share_work_evenly(nursery: trio.Nursery, tmp_path: Path) -> None:
    ids = ["sim-a", "sim-b", "sim-c"]
    text = edge_config(
        tmp_path,
        providers=[sim_provider(i, capacity=4, adapter=SLOW) for i in ids],
        models=[{"id": "m", "providers": dict.fromkeys(ids, "sim-small")}],
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    served: collections.Counter[str] = collections.Counter()

    async def one(client: openai.AsyncOpenAI) -> None:
        response = await _chat(client)
        served[response.headers["x-iop-provider"]] += 1

    async with stack.client() as client:
        for _ in range(4):  # 4 rounds of 6 concurrent requests
            async with trio.open_nursery() as group:
                for _ in range(6):
                    group.start_soon(one, client)
    assert sum(served.values()) == 24
    assert set(served) == set(ids)
    assert max(served.values()) - min(served.values()) <= 2, served
    assert _all_idle(await stack.catalog())


async def test_less_loaded_provider_wins(nursery: trio.Nursery, tmp_path: Path) -> None:
    # big: 1 of 3 slots busy (1/3); small: 0 of 1 -> small first; then small 1/1 full -> big.
    text = edge_config(
        tmp_path,
        providers=[
            sim_provider(
                "big", capacity=3, priority=1, adapter={"ttft_ms": 5, "tokens_per_second": 5}
            ),
            sim_provider(
                "small", capacity=2, priority=50, adapter={"ttft_ms": 5, "tokens_per_second": 5}
            ),
        ],
        models=[{"id": "m", "providers": {"big": "sim-small", "small": "sim-small"}}],
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    async with stack.client() as client, trio.open_nursery() as group:
        # First request: both idle (0/3 vs 0/2) -> priority decides -> big.
        group.start_soon(_chat, client, "m")
        await stack.wait_catalog(lambda c: _provider(c, "big")["in_flight"] == 1)
        # Now big is at 1/3 (0.33) and small at 0/2 (0): small must win despite priority.
        group.start_soon(_chat, client, "m")
        catalog = await stack.wait_catalog(lambda c: _provider(c, "small")["in_flight"] == 1)
        assert _provider(catalog, "big")["in_flight"] == 1
        # big 1/3 (0.33) vs small 1/2 (0.5): big wins.
        group.start_soon(_chat, client, "m")
        catalog = await stack.wait_catalog(lambda c: _provider(c, "big")["in_flight"] == 2)
        assert _provider(catalog, "small")["in_flight"] == 1
    assert _all_idle(await stack.catalog())


async def _queue_stack(nursery: trio.Nursery, tmp_path: Path, **queue: int) -> Stack:
    text = edge_config(
        tmp_path,
        providers=[
            sim_provider("only", capacity=1, adapter={"ttft_ms": 5, "tokens_per_second": 20})
        ],
        models=[{"id": "m", "providers": {"only": "sim-small"}, "queue": queue}],
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


async def test_full_queue_is_rate_limit_error(nursery: trio.Nursery, tmp_path: Path) -> None:
    stack = await _queue_stack(nursery, tmp_path, max_queue=1, queue_timeout_ms=30000)
    async with stack.client() as client, trio.open_nursery() as group:
        group.start_soon(_chat, client, "m")  # holds the only slot
        await stack.wait_catalog(lambda c: _provider(c, "only")["in_flight"] == 1)
        group.start_soon(_chat, client, "m")  # waits in the queue
        await stack.wait_catalog(lambda c: c["models"][0]["queued"] == 1)
        with pytest.raises(openai.RateLimitError) as caught:
            await _chat(client)
        assert caught.value.response.headers["retry-after"]
        assert caught.value.code == "queue_full"
    assert _all_idle(await stack.catalog())


async def test_queue_timeout_is_503(nursery: trio.Nursery, tmp_path: Path) -> None:
    stack = await _queue_stack(nursery, tmp_path, max_queue=4, queue_timeout_ms=50)
    async with stack.client() as client, trio.open_nursery() as group:
        group.start_soon(functools.partial(_chat, client, "m", max_tokens=16))  # ~0.8 s on the slot
        await stack.wait_catalog(lambda c: _provider(c, "only")["in_flight"] == 1)
        with pytest.raises(openai.InternalServerError) as caught:
            await _chat(client)
        assert caught.value.status_code == 503
        assert caught.value.code == "queue_timeout"
        assert caught.value.response.headers["retry-after"]
        # The wait shows as queue time, not as the Edge's own share.
        timing = caught.value.response.headers["server-timing"]
        assert float(timing.split("queue;dur=")[1].split(",")[0]) >= 50


async def test_long_runs_respect_long_slots(nursery: trio.Nursery, tmp_path: Path) -> None:
    text = edge_config(
        tmp_path,
        providers=[
            sim_provider(
                "long-ok",
                capacity=4,
                long_context_slots=1,
                adapter={"ttft_ms": 5, "tokens_per_second": 20},
            ),
            sim_provider("no-long", capacity=4, long_context_slots=0, priority=1),
        ],
        models=[{"id": "m", "providers": {"long-ok": "sim-small", "no-long": "sim-small"}}],
        openai_section={"long_context_threshold_tokens": 100},
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    long_prompt = [{"role": "user", "content": "word " * 200}]
    async with stack.client() as client, trio.open_nursery() as group:
        group.start_soon(
            lambda: client.chat.completions.create(model="m", max_tokens=8, messages=long_prompt)
        )
        catalog = await stack.wait_catalog(lambda c: _provider(c, "long-ok")["long_in_flight"] == 1)
        assert _provider(catalog, "long-ok")["in_flight"] == 1
        assert _provider(catalog, "no-long")["in_flight"] == 0
        # A second long run waits for the one long slot: it is queued, not sent to no-long.
        group.start_soon(
            lambda: client.chat.completions.create(model="m", max_tokens=2, messages=long_prompt)
        )
        await stack.wait_catalog(lambda c: c["models"][0]["queued"] == 1)
        # Short runs still flow (to no-long, the idle, higher-priority provider).
        short = await _chat(client)
        assert short.headers["x-iop-provider"] == "no-long"
    assert _all_idle(await stack.catalog())


async def test_caller_disconnect_mid_stream_frees_the_slot(stack_one: Stack) -> None:
    async with httpx2.AsyncClient(base_url=stack_one.addresses.openai_url, timeout=10) as http:
        body = {"model": "m", "stream": True, "max_tokens": 500, "messages": MESSAGES}
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # got the first chunk; now hang up
    with trio.fail_after(GUARD_S):  # freed by the hang-up itself, not a timer
        await stack_one.wait_catalog(_all_idle)
    # ...and the run is still metered, as the caller's leaving.
    with trio.fail_after(GUARD_S):
        await stack_one.edge.ledger.wait_flushed()
    with sqlite3.connect(stack_one.edge.ledger.path) as db:
        assert [row[0] for row in db.execute("SELECT status FROM usage")] == [499]


async def test_caller_disconnect_non_stream_frees_the_slot(stack_one: Stack) -> None:
    async with httpx2.AsyncClient(base_url=stack_one.addresses.openai_url, timeout=10) as http:
        body = {"model": "m", "max_tokens": 500, "messages": MESSAGES}
        with trio.move_on_after(0.2):
            await http.post("/v1/chat/completions", json=body)
    with trio.fail_after(GUARD_S):  # freed by the hang-up itself, not a timer
        await stack_one.wait_catalog(_all_idle)


async def test_node_killed_mid_stream_ends_stream_and_frees_slot(stack_one: Stack) -> None:
    async with stack_one.client() as client:
        stream = await client.chat.completions.create(
            model="m", stream=True, max_tokens=500, messages=MESSAGES
        )
        got = 0
        with pytest.raises(openai.APIError) as caught:
            async for _chunk in stream:
                got += 1
                if got == 2:
                    stack_one.kill_node("node-1")
        assert "node" in str(caught.value.message)
    with trio.fail_after(GUARD_S):  # freed by the hang-up itself, not a timer
        await stack_one.wait_catalog(_all_idle)


async def test_provider_dying_before_first_byte_fails_over(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    text = edge_config(
        tmp_path,
        providers=[
            sim_provider(
                "doomed",
                capacity=2,
                priority=1,
                adapter={"ttft_ms": 60000, "tokens_per_second": 100},
            )
        ],
        models=[{"id": "m", "providers": {"doomed": "sim-small", "rescue": "sim-small"}}],
        extra_nodes=[
            {
                "id": "node-2",
                "token_hash_sha256": NODE_TOKEN_HASH,
                "providers": [sim_provider("rescue", capacity=2, priority=50)],
            }
        ],
    )
    stack = await start_stack(
        nursery, text, tmp_path / "edge.yaml", nodes=("node-1", "node-2"), wait_models=("m",)
    )
    await stack.wait_catalog(lambda c: all(p["health"] == "available" for p in c["providers"]))
    async with stack.client() as client, trio.open_nursery() as group:
        result: dict[str, Any] = {}

        async def ask() -> None:
            result["response"] = await _chat(client, stream=False)

        group.start_soon(ask)
        await stack.wait_catalog(lambda c: _provider(c, "doomed")["in_flight"] == 1)
        stack.kill_node("node-1")
    response = result["response"]
    assert response.headers["x-iop-provider"] == "rescue"
    assert response.parse().model == "m"
    assert _all_idle(await stack.catalog())
