"""The Node's health probes, seen from the Edge: an upstream that goes down leaves the pool.

Providers here probe every half second, so each flip takes one or two probe intervals;
the tests wait for it event-driven (`Stack.wait_catalog`), never by sleeping. A probe is
bounded by its interval: half a second is room for a probe on a loaded machine (at 50 ms
one could time out there and turn an `available` provider `unavailable` before the very
request the test sends next).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest
import trio

from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import Stack
from tests.e2e.upstreams import (
    ALIAS,
    MESSAGES,
    MakeStack,
    RunningUpstream,
    all_idle,
    provider_of,
    upstream_provider,
)
from tests.timing import GUARD_S

PROBE_EVERY_S = 0.5


def _health_is(health: str) -> Callable[[dict[str, Any]], bool]:
    """A catalog predicate: provider `gpu` is connected and its probe says `health`."""

    def check(catalog: dict[str, Any]) -> bool:
        entry = provider_of(catalog, "gpu")
        return bool(entry["connected"] and entry["health"] == health)

    return check


async def _assert_serves(stack: Stack) -> None:
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            completion = await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
    assert completion.model == ALIAS


async def _assert_refused(stack: Stack) -> None:
    with trio.fail_after(GUARD_S), pytest.raises(openai.InternalServerError) as caught:
        async with stack.client() as client:
            await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
    assert caught.value.status_code == 503
    assert caught.value.code == "no_provider"
    assert "available" in caught.value.message


async def test_failing_model_listing_flips_health_both_ways(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream()
    base_url = await nursery.start(fake.serve)
    provider = upstream_provider("gpu", base_url, health_interval_s=PROBE_EVERY_S)
    stack = await make_stack([provider])
    assert provider_of(await stack.catalog(), "gpu")["discovered_models"] == ["fake-model"]
    await _assert_serves(stack)

    fake.models_status = 500  # the runtime is up but broken
    await stack.wait_catalog(_health_is("unavailable"))
    entry = provider_of(await stack.catalog(), "gpu")
    assert entry["health"] == "unavailable"
    assert entry["discovered_models"] == []
    await _assert_refused(stack)

    fake.models_status = 200
    await stack.wait_catalog(_health_is("available"))
    await _assert_serves(stack)
    assert all_idle(await stack.catalog())


async def test_stopped_upstream_flips_health_and_comes_back_on_restart(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    upstream = RunningUpstream(FakeUpstream(), nursery)
    base_url = await upstream.start()
    provider = upstream_provider("gpu", base_url, health_interval_s=PROBE_EVERY_S)
    stack = await make_stack([provider])
    await _assert_serves(stack)

    await upstream.stop()  # the runtime process died: connection refused
    await stack.wait_catalog(_health_is("unavailable"))
    await _assert_refused(stack)

    await upstream.start()  # same port, as a restarted runtime would be
    await stack.wait_catalog(_health_is("available"))
    await _assert_serves(stack)
    assert all_idle(await stack.catalog())


async def test_queued_requests_are_refused_when_the_provider_goes_down(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """A waiter whose every provider became unavailable gets its 503 at once, not after
    its queue timeout; the run already in flight is not disturbed."""
    release = trio.Event()

    async def hold(index: int) -> None:
        if index >= 1:
            await release.wait()

    fake = FakeUpstream(chunks=3, pace=hold)
    base_url = await nursery.start(fake.serve)
    # The held run shows nothing after its first chunk: once its stall window (the
    # first-byte budget) has passed, the Node probes the provider again and finds it down.
    provider = upstream_provider(
        "gpu", base_url, capacity=1, health_interval_s=PROBE_EVERY_S, first_byte_timeout_s=3.0
    )
    stack = await make_stack([provider])
    async with stack.client() as client:
        with trio.fail_after(GUARD_S):
            stream = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
        refused: list[openai.APIStatusError] = []

        async def queued() -> None:
            with pytest.raises(openai.InternalServerError) as caught:
                await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
            refused.append(caught.value)

        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as waiters:
                waiters.start_soon(queued)
                await stack.wait_catalog(lambda c: c["models"][0]["queued"] == 1)
                fake.models_status = 500
        assert refused[0].status_code == 503
        assert refused[0].code == "no_provider"

        release.set()  # the run admitted before the outage finishes normally
        with trio.fail_after(GUARD_S):
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(pieces) == "tok0 tok1 tok2 "
    assert all_idle(await stack.catalog())
