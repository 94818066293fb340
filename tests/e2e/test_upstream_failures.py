"""Upstream failures through the Edge and Node: errors, failover, cooldown, timeouts, hang-ups.

Every test checks what the caller gets (an OpenAI error with the right status and code,
within a bounded time) and that the slot came back (`in_flight` 0 in the catalog), since
a leaked slot is the failure that matters most in a gateway.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import trio

from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import Stack, hang_up_after
from tests.e2e.upstreams import (
    ALIAS,
    MESSAGES,
    MakeStack,
    RunningUpstream,
    all_idle,
    posts,
    provider_of,
    upstream_provider,
    wait_idle,
)
from tests.timing import GUARD_S

#: Long enough that a cooldown never ends by itself during a test.
COOLDOWN = {"cooldown": {"failures": 3, "seconds": 60}}


async def _two_providers(
    nursery: trio.Nursery, make_stack: MakeStack, bad: FakeUpstream, **adapter: Any
) -> tuple[Stack, FakeUpstream]:
    """`bad` (preferred: lower priority) and a healthy upstream, serving different names."""
    good = FakeUpstream()
    bad_url = await nursery.start(bad.serve)
    good_url = await nursery.start(good.serve)
    providers = [
        upstream_provider("bad", bad_url, served="bad-model", priority=1, **adapter),
        upstream_provider("good", good_url, served="good-model", priority=50, **adapter),
    ]
    stack = await make_stack(providers, dispatch=COOLDOWN)
    return stack, good


async def _chat(stack: Stack, **kwargs: Any) -> Any:
    async with stack.client() as client:
        return await client.chat.completions.with_raw_response.create(
            model=ALIAS, messages=MESSAGES, **kwargs
        )


# --- upstream errors ------------------------------------------------------------------------


async def test_upstream_500_is_a_502_and_frees_the_slot(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(status=500, error_message="CUDA out of memory")
    base_url = await nursery.start(fake.serve)
    stack = await make_stack([upstream_provider("gpu", base_url)])
    for stream in (False, True):
        with trio.fail_after(GUARD_S), pytest.raises(openai.InternalServerError) as caught:
            await _chat(stack, stream=stream)
        assert caught.value.status_code == 502
        assert caught.value.code == "upstream_error"
        assert "CUDA out of memory" in caught.value.message
        assert caught.value.response.headers["x-request-id"]
        assert caught.value.response.headers["x-iop-provider"] == "gpu"
        await wait_idle(stack)
    assert fake.requests_total == 2  # never retried on the provider that failed
    # A 500 with no other provider to try may be the request's fault: it counts against
    # nobody (design §4 item 10).
    assert provider_of(await stack.catalog(), "gpu")["consecutive_failures"] == 0
    # Each record names who failed it: the provider and its node.
    await stack.edge.ledger.wait_flushed()
    async with stack.admin() as admin:
        usage = await admin.get("/usage", params={"group_by": "provider,node,status"})
    rows = [(r["provider"], r["node"], r["status"], r["requests"]) for r in usage.json()["rows"]]
    assert rows == [("gpu", "node-1", 502, 2)]


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_500_fails_over_before_the_first_byte(
    nursery: trio.Nursery, make_stack: MakeStack, stream: bool
) -> None:
    bad = FakeUpstream(status=500)
    stack, good = await _two_providers(nursery, make_stack, bad)
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            raw = await client.chat.completions.with_raw_response.create(
                model=ALIAS, messages=MESSAGES, stream=stream
            )
            parsed = raw.parse()
            if isinstance(parsed, openai.AsyncStream):
                chunks = [chunk async for chunk in parsed]
                assert [c.choices[0].delta.content for c in chunks][:1] == ["tok0 "]
                assert all(chunk.model == ALIAS for chunk in chunks)
            else:
                assert parsed.model == ALIAS
    assert raw.headers["x-iop-provider"] == "good"
    # Each attempt carried its own provider's served name.
    assert [p["model"] for p in posts(bad)] == ["bad-model"]
    assert [p["model"] for p in posts(good)] == ["good-model"]
    catalog = await stack.catalog()
    assert provider_of(catalog, "bad")["consecutive_failures"] == 1
    assert all_idle(catalog)


@pytest.mark.parametrize("status", [401, 403, 404])
async def test_misconfigured_provider_fails_over_and_counts_against_it(
    nursery: trio.Nursery, make_stack: MakeStack, status: int
) -> None:
    """A wrong upstream key or a model the upstream lacks is the provider's fault, not
    the caller's: another provider serves the request and the bad one heads to cooldown."""
    bad = FakeUpstream(status=status)
    stack, _good = await _two_providers(nursery, make_stack, bad)
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            raw = await client.chat.completions.with_raw_response.create(
                model=ALIAS, messages=MESSAGES
            )
    assert raw.headers["x-iop-provider"] == "good"
    assert raw.parse().model == ALIAS
    catalog = await stack.catalog()
    assert provider_of(catalog, "bad")["consecutive_failures"] == 1
    assert all_idle(catalog)


async def test_an_upstream_that_echoes_its_key_does_not_hand_it_to_callers(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """OpenAI's 401 names the key it was sent: the caller's error keeps the upstream's
    words but not the operator's key (`core.caller_text` Rule 4)."""
    key = "sk-proj-NOT-A-REAL-KEY-0123456789"
    bad = FakeUpstream(status=401, error_message=f"Incorrect API key provided: {key}.")
    url = await nursery.start(bad.serve)
    stack = await make_stack([upstream_provider("bad", url)], dispatch=COOLDOWN)
    with trio.fail_after(GUARD_S), pytest.raises(openai.APIStatusError) as failed:
        await _chat(stack)
    assert failed.value.status_code == 502
    assert "Incorrect API key provided: <credential>." in failed.value.message
    assert key not in failed.value.message


@pytest.mark.parametrize("knob", ["error_after_chunks", "drop_after_chunks"])
async def test_stream_broken_before_its_first_chunk_fails_over(
    nursery: trio.Nursery, make_stack: MakeStack, knob: str
) -> None:
    """An in-band error event or a cut connection before any chunk: nothing reached the
    caller yet, so the run moves to the next provider."""
    knobs: dict[str, Any] = {knob: 0}
    bad = FakeUpstream(**knobs)
    stack, good = await _two_providers(nursery, make_stack, bad)
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            raw = await client.chat.completions.with_raw_response.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            pieces = [c.choices[0].delta.content async for c in raw.parse() if c.choices]
    assert raw.headers["x-iop-provider"] == "good"
    assert "".join(p or "" for p in pieces) == "tok0 tok1 tok2 "
    assert (bad.requests_total, good.requests_total) == (1, 1)
    assert provider_of(await stack.catalog(), "bad")["consecutive_failures"] == 1
    await wait_idle(stack)


async def test_three_500s_cool_the_provider_down(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    bad = FakeUpstream(status=500)
    stack, good = await _two_providers(nursery, make_stack, bad)
    with trio.fail_after(GUARD_S):
        for _ in range(3):
            assert (await _chat(stack)).headers["x-iop-provider"] == "good"
    catalog = await stack.catalog()
    bad_entry = provider_of(catalog, "bad")
    assert bad_entry["cooling_down"] is True
    assert bad_entry["consecutive_failures"] == 3
    assert bad_entry["health"] == "available"  # passive health, not the probe's verdict
    # While it cools down, runs go straight to the healthy provider.
    with trio.fail_after(GUARD_S):
        assert (await _chat(stack)).headers["x-iop-provider"] == "good"
    assert bad.requests_total == 3
    assert good.requests_total == 4
    assert all_idle(await stack.catalog())


@pytest.mark.parametrize("status", [429, 503])
async def test_upstream_busy_fails_over_without_cooldown(
    nursery: trio.Nursery, make_stack: MakeStack, status: int
) -> None:
    busy = FakeUpstream(status=status, error_message="server at capacity")
    stack, good = await _two_providers(nursery, make_stack, busy)
    with trio.fail_after(GUARD_S):
        for _ in range(4):  # more than the cooldown threshold
            assert (await _chat(stack)).headers["x-iop-provider"] == "good"
    assert busy.requests_total == 4  # still in the pool: tried first every time
    entry = provider_of(await stack.catalog(), "bad")
    assert entry["cooling_down"] is False
    assert entry["consecutive_failures"] == 0
    assert good.requests_total == 4


async def test_upstream_busy_everywhere_is_a_retryable_503(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(status=429, error_message="too many requests")
    base_url = await nursery.start(fake.serve)
    stack = await make_stack([upstream_provider("gpu", base_url)])
    for stream in (False, True):
        with trio.fail_after(GUARD_S), pytest.raises(openai.InternalServerError) as caught:
            await _chat(stack, stream=stream)
        # Busy, not broken: a retryable 503 with Retry-After, not a 502 failure.
        assert caught.value.status_code == 503
        assert caught.value.code == "upstream_busy"
        assert caught.value.response.headers["retry-after"] == "1"
        assert "too many requests" in caught.value.message
    assert not provider_of(await stack.catalog(), "gpu")["cooling_down"]
    await wait_idle(stack)


async def test_upstream_retry_after_rests_the_provider(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    limited = FakeUpstream(
        status=429, error_message="rate limit reached", error_headers={"Retry-After": "30"}
    )
    stack, good = await _two_providers(nursery, make_stack, limited)
    with trio.fail_after(GUARD_S):
        for _ in range(4):
            assert (await _chat(stack)).headers["x-iop-provider"] == "good"
    # Asked once, then left alone while its Retry-After runs: no run is sent where the
    # upstream would refuse it, and no failure is counted.
    assert limited.requests_total == 1
    assert good.requests_total == 4
    entry = provider_of(await stack.catalog(), "bad")
    assert 0 < entry["rate_limited_s"] <= 30
    assert entry["health_reason"].startswith("rate-limited by its upstream for ")
    assert (entry["cooling_down"], entry["consecutive_failures"]) == (False, 0)
    assert provider_of(await stack.catalog(), "good")["rate_limited_s"] is None
    await wait_idle(stack)


async def test_upstream_retry_after_reaches_the_caller(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(
        status=429, error_message="too many requests", error_headers={"retry-after-ms": "29500"}
    )
    base_url = await nursery.start(fake.serve)
    stack = await make_stack([upstream_provider("gpu", base_url)])
    with trio.fail_after(GUARD_S), pytest.raises(openai.InternalServerError) as caught:
        await _chat(stack)
    assert caught.value.status_code == 503
    assert caught.value.code == "upstream_busy"
    assert caught.value.response.headers["retry-after"] == "30"  # the upstream's 29.5 s
    # Resting, the provider is not asked: the caller hears when it is back.
    with trio.fail_after(GUARD_S), pytest.raises(openai.InternalServerError) as refused:
        await _chat(stack, stream=True)
    assert refused.value.status_code == 503
    assert refused.value.code == "no_provider"
    assert "rate-limited by its upstream" in refused.value.message
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 30
    assert fake.requests_total == 1
    await wait_idle(stack)


@pytest.mark.parametrize("operation", ["completion", "embedding"])
async def test_a_runtime_without_the_endpoint_fails_over_and_is_not_blamed(
    nursery: trio.Nursery, make_stack: MakeStack, operation: str
) -> None:
    """One caller asking a chat-only runtime for completions or embeddings takes the
    model offline for nobody: its runs go to a provider that has the endpoint, and with
    none the caller hears that the model does not serve it."""
    chat_only = FakeUpstream(missing=frozenset({"completion", "embedding"}))
    stack, good = await _two_providers(nursery, make_stack, chat_only)

    async def ask() -> Any:
        async with stack.client() as client:
            if operation == "completion":
                return await client.completions.with_raw_response.create(model=ALIAS, prompt="Hi")
            return await client.embeddings.with_raw_response.create(model=ALIAS, input="Hi")

    with trio.fail_after(GUARD_S):
        for _ in range(4):  # more than the cooldown threshold
            assert (await ask()).headers["x-iop-provider"] == "good"
    entry = provider_of(await stack.catalog(), "bad")
    assert (entry["cooling_down"], entry["consecutive_failures"]) == (False, 0)
    good.missing = chat_only.missing
    with trio.fail_after(GUARD_S), pytest.raises(openai.BadRequestError) as caught:
        await ask()
    assert (caught.value.code, caught.value.param) == ("unsupported_operation", "model")
    assert "runtime has no /" in caught.value.message
    with trio.fail_after(GUARD_S):  # chat still served by the preferred provider
        assert (await _chat(stack)).headers["x-iop-provider"] == "bad"
    await wait_idle(stack)


async def test_upstream_rejection_is_passed_on_without_failover(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    bad = FakeUpstream(status=400, error_message="max_tokens is too large for this model")
    stack, good = await _two_providers(nursery, make_stack, bad)
    with trio.fail_after(GUARD_S), pytest.raises(openai.BadRequestError) as caught:
        await _chat(stack)
    assert caught.value.status_code == 400
    assert caught.value.code == "upstream_rejected"
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["message"] == "max_tokens is too large for this model"  # upstream's words
    assert good.requests_total == 0  # the request is at fault, not the provider
    entry = provider_of(await stack.catalog(), "bad")
    assert entry["consecutive_failures"] == 0
    await wait_idle(stack)


async def test_cooldown_ends_with_one_trial_run(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    bad = FakeUpstream(status=500)
    good = FakeUpstream()
    providers = [
        upstream_provider("bad", await nursery.start(bad.serve), priority=1),
        upstream_provider("good", await nursery.start(good.serve), priority=50),
    ]
    dispatch = {"cooldown": {"failures": 3, "seconds": 0.3}}
    stack = await make_stack(providers, dispatch=dispatch)
    with trio.fail_after(GUARD_S):
        for _ in range(3):
            await _chat(stack)
    await stack.wait_catalog(lambda c: provider_of(c, "bad")["cooling_down"])
    bad.status = 200  # the runtime recovered while out of the pool
    await stack.wait_catalog(lambda c: not provider_of(c, "bad")["cooling_down"])
    with trio.fail_after(GUARD_S):
        trial = await _chat(stack)
    assert trial.headers["x-iop-provider"] == "bad"  # preferred again, on trial
    entry = provider_of(await stack.catalog(), "bad")
    assert (entry["cooling_down"], entry["consecutive_failures"]) == (False, 0)
    assert bad.requests_total == 4
    assert good.requests_total == 3


# --- unreachable and hung upstreams ---------------------------------------------------------


async def test_unreachable_upstream_is_unavailable_and_refused(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    upstream = RunningUpstream(FakeUpstream(), nursery)
    base_url = await upstream.start()
    await upstream.stop()  # nothing listens on that port any more
    stack = await make_stack([upstream_provider("gpu", base_url)], wait=False)
    await stack.wait_catalog(
        lambda c: (
            provider_of(c, "gpu")["connected"] and provider_of(c, "gpu")["health"] != "unknown"
        )
    )
    assert provider_of(await stack.catalog(), "gpu")["health"] == "unavailable"  # probe failed
    with trio.fail_after(GUARD_S), pytest.raises(openai.InternalServerError) as caught:
        await _chat(stack)
    assert caught.value.status_code == 503
    assert caught.value.code == "no_provider"
    assert caught.value.response.headers["retry-after"]
    assert all_idle(await stack.catalog())


async def test_upstream_gone_between_probes_is_a_502(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    upstream = RunningUpstream(FakeUpstream(), nursery)
    base_url = await upstream.start()
    stack = await make_stack([upstream_provider("gpu", base_url)])
    with trio.fail_after(GUARD_S):
        await _chat(stack)  # leaves a keep-alive connection in the adapter's pool
    await upstream.stop()  # the probe (every 30 s) has not noticed yet
    for stream in (False, True):
        with trio.fail_after(GUARD_S), pytest.raises(openai.InternalServerError) as caught:
            await _chat(stack, stream=stream)
        assert caught.value.status_code == 502
        assert caught.value.code == "upstream_unreachable"
        await wait_idle(stack)
    assert provider_of(await stack.catalog(), "gpu")["consecutive_failures"] == 2


async def test_hung_upstream_is_bounded_by_first_byte_timeout(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(hang=True)
    base_url = await nursery.start(fake.serve)
    provider = upstream_provider("gpu", base_url, first_byte_timeout_s=0.3, request_timeout_s=30)
    stack = await make_stack([provider])
    started = trio.current_time()
    with trio.fail_after(GUARD_S), pytest.raises(openai.InternalServerError) as caught:
        await _chat(stack, stream=True)
    assert trio.current_time() - started >= 0.3
    assert caught.value.status_code == 502
    assert caught.value.code == "upstream_timeout"
    await wait_idle(stack)
    with trio.fail_after(GUARD_S):  # the adapter hung up on the upstream
        await fake.wait_for(lambda: fake.disconnects == 1 and fake.active == 0)


async def test_first_byte_timeout_does_not_cut_a_long_non_stream_generation(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """A non-stream response's first byte is its whole body, sent when generation ends; so
    `first_byte_timeout_s` (a bound on prefill) must not cut it: only `request_timeout_s`
    bounds it. A stream that stays silent as long is stalled in prefill and is cut."""
    fake = FakeUpstream(first_byte_delay_s=0.5)  # prefill + generation: 0.5 s
    base_url = await nursery.start(fake.serve)
    provider = upstream_provider("gpu", base_url, first_byte_timeout_s=0.2, request_timeout_s=30)
    stack = await make_stack([provider])
    with trio.fail_after(GUARD_S):
        raw = await _chat(stack)
    assert raw.parse().choices[0].message.content == "tok0 tok1 tok2 "
    with trio.fail_after(GUARD_S), pytest.raises(openai.InternalServerError) as caught:
        await _chat(stack, stream=True)
    assert caught.value.code == "upstream_timeout"
    entry = provider_of(await stack.catalog(), "gpu")
    assert entry["consecutive_failures"] == 1
    await wait_idle(stack)


async def test_hung_non_stream_upstream_is_bounded_by_request_timeout(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(hang=True)
    base_url = await nursery.start(fake.serve)
    provider = upstream_provider("gpu", base_url, first_byte_timeout_s=0.2, request_timeout_s=0.6)
    stack = await make_stack([provider])
    started = trio.current_time()
    with trio.fail_after(GUARD_S), pytest.raises(openai.InternalServerError) as caught:
        await _chat(stack)
    assert trio.current_time() - started >= 0.6
    assert (caught.value.status_code, caught.value.code) == (502, "upstream_timeout")
    await wait_idle(stack)
    with trio.fail_after(GUARD_S):
        await fake.wait_for(lambda: fake.disconnects == 1 and fake.active == 0)


async def test_stream_hung_after_chunks_ends_with_an_error_event(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    async def stall_after_two(index: int) -> None:
        if index >= 2:
            await trio.sleep_forever()

    fake = FakeUpstream(chunks=5, pace=stall_after_two)
    base_url = await nursery.start(fake.serve)
    # Its first chunks in time on a loaded machine; the stall after them is what times out.
    provider = upstream_provider("gpu", base_url, first_byte_timeout_s=2.0, request_timeout_s=2.0)
    stack = await make_stack([provider])
    got: list[str] = []
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            stream = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            with pytest.raises(openai.APIError) as caught:
                async for chunk in stream:
                    got.append(chunk.choices[0].delta.content or "")
    assert got == ["tok0 ", "tok1 "]
    assert "did not complete within" in caught.value.message
    await wait_idle(stack)
    entry = provider_of(await stack.catalog(), "gpu")
    assert entry["consecutive_failures"] == 1


async def test_hung_upstream_fails_over_after_first_byte_timeout(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    hung = FakeUpstream(hang=True)
    # The good provider gets the same budget: long enough for its first byte under load.
    stack, good = await _two_providers(nursery, make_stack, hung, first_byte_timeout_s=2.0)
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            raw = await client.chat.completions.with_raw_response.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            pieces = [c.choices[0].delta.content async for c in raw.parse() if c.choices]
    assert raw.headers["x-iop-provider"] == "good"
    assert "".join(p or "" for p in pieces) == "tok0 tok1 tok2 "
    assert good.requests_total == 1
    with trio.fail_after(GUARD_S):
        await hung.wait_for(lambda: hung.disconnects == 1)
    assert provider_of(await stack.catalog(), "bad")["consecutive_failures"] == 1
    await wait_idle(stack)


async def test_refused_connection_fails_over(nursery: trio.Nursery, make_stack: MakeStack) -> None:
    gone = RunningUpstream(FakeUpstream(), nursery)
    good = FakeUpstream()
    providers = [
        upstream_provider("gone", await gone.start(), served="gone-model", priority=1),
        upstream_provider("good", await nursery.start(good.serve), priority=50),
    ]
    stack = await make_stack(providers, dispatch=COOLDOWN)
    await gone.stop()  # between two probes: still `available` in the pool
    with trio.fail_after(GUARD_S):
        raw = await _chat(stack, stream=True)
    assert raw.headers["x-iop-provider"] == "good"
    assert provider_of(await stack.catalog(), "gone")["consecutive_failures"] == 1
    assert good.requests_total == 1
    await wait_idle(stack)


@pytest.mark.parametrize("knob", ["error_after_chunks", "drop_after_chunks"])
async def test_stream_broken_mid_way_ends_with_error_then_done(
    nursery: trio.Nursery, make_stack: MakeStack, knob: str
) -> None:
    """A mid-stream failure (in-band error event, or a cut connection) is never retried:
    the caller's stream ends with an OpenAI error event, then `[DONE]`."""
    knobs: dict[str, Any] = {knob: 2}
    fake = FakeUpstream(chunks=5, **knobs)
    base_url = await nursery.start(fake.serve)
    stack = await make_stack([upstream_provider("gpu", base_url)])
    body = {"model": ALIAS, "messages": MESSAGES, "stream": True}
    with trio.fail_after(GUARD_S):
        async with (
            stack.http() as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200
            events = [line async for line in response.aiter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-2]]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["tok0 ", "tok1 "]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_stream_error"
    assert error["type"] == "api_error"
    assert "after 2 chunks" in error["message"]
    assert fake.requests_total == 1  # chunks reached the caller: no retry
    await wait_idle(stack)


# --- the caller hangs up --------------------------------------------------------------------


async def _hang_up_on_a_stalled_stream(
    nursery: trio.Nursery, make_stack: MakeStack
) -> tuple[FakeUpstream, Stack]:
    """A stack on an upstream whose streams stall after two chunks, and a caller that
    hung up on one after those two."""
    release = trio.Event()  # never set: the upstream stalls after two chunks

    async def hold_after_two(index: int) -> None:
        if index >= 2:
            await release.wait()

    fake = FakeUpstream(chunks=50, pace=hold_after_two)
    base_url = await nursery.start(fake.serve)
    stack = await make_stack([upstream_provider("gpu", base_url)])
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            stream = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            await hang_up_after(stream, 2)
    return fake, stack


async def test_caller_gone_mid_stream_closes_the_upstream_request(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake, stack = await _hang_up_on_a_stalled_stream(nursery, make_stack)
    assert fake.disconnects == 0
    with trio.fail_after(GUARD_S):  # the hang-up cancels the run (event-driven)
        await fake.wait_for(lambda: fake.disconnects == 1 and fake.active == 0)
        await stack.wait_catalog(all_idle)
    assert provider_of(await stack.catalog(), "gpu")["consecutive_failures"] == 0


async def test_runs_after_a_hang_up_share_one_new_connection(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """The connection of a run cut short is closed, never reused; the runs that follow
    open one new connection and keep it (`iop_node/adapters/run_connections.py`)."""
    fake, stack = await _hang_up_on_a_stalled_stream(nursery, make_stack)
    with trio.fail_after(GUARD_S):
        await fake.wait_for(lambda: fake.disconnects == 1 and fake.active == 0)
        opened = fake.connections_total
        fake.pace = None
        async with stack.client() as client:
            await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
            again = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            async for _chunk in again:
                pass
            await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
    assert fake.connections_total == opened + 1
    assert fake.disconnects == 1


async def test_an_idle_connection_the_upstream_drops_as_a_run_arrives_costs_nothing(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """An upstream closes each kept connection just as the next run arrives on it (its
    keep-alive timeout racing the Node's): every run is still answered, from the one
    provider, by sending it once more on a new connection."""
    fake = FakeUpstream(runs_per_connection=1)
    base_url = await nursery.start(fake.serve)
    stack = await make_stack([upstream_provider("gpu", base_url)])
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            for stream in (False, True, False):
                reply = await client.chat.completions.create(
                    model=ALIAS, messages=MESSAGES, stream=stream
                )
                if stream:
                    assert [chunk async for chunk in reply]
    assert fake.dropped == 2 and fake.requests_total == 3
    assert provider_of(await stack.catalog(), "gpu")["consecutive_failures"] == 0


async def test_caller_gone_while_upstream_thinks_closes_the_upstream_request(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(hang=True)
    base_url = await nursery.start(fake.serve)
    stack = await make_stack([upstream_provider("gpu", base_url)])
    async with trio.open_nursery() as callers:
        callers.start_soon(_chat, stack)
        with trio.fail_after(GUARD_S):
            await fake.wait_for(lambda: fake.active == 1)
        callers.cancel_scope.cancel()  # the caller gives up before the first byte
    with trio.fail_after(GUARD_S):
        await fake.wait_for(lambda: fake.disconnects == 1 and fake.active == 0)
        await stack.wait_catalog(all_idle)
