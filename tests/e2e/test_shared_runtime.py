"""A runtime shared with clients IOP does not see, through the Edge: while another client
keeps it generating, its health probe goes unanswered on a connection it accepted. The
provider stays in the pool (`busy`, with that reason) and callers are served as they would
be calling the runtime directly; a runtime that takes runs and never answers them is
taken out by the runs themselves (first-byte timeouts, the Edge's cooldown)."""

from __future__ import annotations

from typing import Any

import httpx2
import openai
import pytest
import trio

from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.upstreams import ALIAS, MESSAGES, MakeStack, provider_of, upstream_provider
from tests.timing import GUARD_S

#: Probes (bounded by the interval) and their answers take a fraction of this, even on a
#: loaded machine: a probe that has not even connected when it times out makes the
#: provider `unavailable`, which is not what these tests are about.
PROBE_EVERY_S = 1.0
ACCEPTED = "probe timed out; upstream accepted the connection"


async def _someone_else_generates(fake: FakeUpstream) -> None:
    """Another client of the runtime: a stream it reads until the runtime ends it."""
    body = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    async with (
        httpx2.AsyncClient(timeout=None) as client,
        client.stream("POST", fake.base_url + "/chat/completions", json=body) as response,
    ):
        async for _ in response.aiter_bytes():
            pass


def _busy_by_probe(catalog: dict[str, Any]) -> bool:
    entry = provider_of(catalog, "llama")
    return entry["health"] == "busy" and ACCEPTED in (entry["health_reason"] or "")


async def test_a_runtime_busy_with_another_client_still_serves_ours(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    release = trio.Event()

    async def hold(_index: int) -> None:
        await release.wait()

    fake = FakeUpstream(models_blocked_while_generating=True)
    base_url = await nursery.start(fake.serve)
    stack = await make_stack(
        [upstream_provider("llama", base_url, health_interval_s=PROBE_EVERY_S)]
    )
    fake.pace = hold  # from now on, streams wait for `release`: the other client's does
    try:
        nursery.start_soon(_someone_else_generates, fake)
        await stack.wait_catalog(_busy_by_probe, within_s=GUARD_S)
        fake.pace = None
        with trio.fail_after(GUARD_S):
            async with stack.client() as client:
                completion = await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
        assert completion.model == ALIAS  # served, as calling the runtime directly would be
    finally:
        release.set()


async def test_a_runtime_that_accepts_and_never_answers_is_cooled_down_by_its_runs(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(models_blocked_while_generating=True)
    base_url = await nursery.start(fake.serve)
    provider = upstream_provider(
        "llama", base_url, health_interval_s=PROBE_EVERY_S, first_byte_timeout_s=0.2
    )
    stack = await make_stack([provider], dispatch={"cooldown": {"failures": 2, "seconds": 60}})
    fake.hang = True  # it takes requests and answers none, the other client's included
    nursery.start_soon(_someone_else_generates, fake)
    await stack.wait_catalog(_busy_by_probe, within_s=GUARD_S)
    for _ in range(2):
        with trio.fail_after(GUARD_S), pytest.raises(openai.APIStatusError) as caught:
            async with stack.client() as client:
                await client.chat.completions.create(model=ALIAS, messages=MESSAGES, stream=True)
        assert caught.value.code == "upstream_timeout"
    entry = provider_of(await stack.catalog(), "llama")
    assert entry["cooling_down"], entry
    with trio.fail_after(GUARD_S), pytest.raises(openai.InternalServerError) as refused:
        async with stack.client() as client:
            await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
    assert refused.value.code == "no_provider"  # out of the pool, at once
