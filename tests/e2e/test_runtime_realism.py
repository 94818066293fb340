"""What real runtimes do, through a real Edge and Node, with the openai SDK as the caller.

llama.cpp's Python server broke four things that never break when it is called directly
(`tests/runtimes` checks them against the real server). The fake upstream reproduces
each of its behaviours (`LLAMA_CPP`, `warmup`), and these tests pin IOP's answers
(design §4 items 10-11, §7, §8):

1. busy is not down: a provider generating (or loading its model) while its model list
   does not answer stays in the pool as `busy`, and is not probed meanwhile (a probe
   would cut llama.cpp's stream); runs stalled past their first-byte budget take it out;
2. blame: bad requests from one caller never make another caller's good request fail,
   with one provider or two; the caller gets the upstream's own status and message;
3. metering: a stream without a usage chunk, one the caller cancels, one cut by a lost
   node are each metered with estimated tokens, flagged `usage_source: estimated`;
4. errors: upstream messages whole, provider/request-id/timing headers on error replies,
   the failed attempt's time charged to `upstream`, the response id the request's.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable
from typing import Any

import openai
import pytest
import trio

from iop_edge.cli import main as edge_cli
from schemas.tokens import OutputTally, estimate_input_tokens
from tests.adapters.fake_upstream import (
    INVALID_REASON,
    LLAMA_CPP,
    FakeUpstream,
    expected_events,
    invalid_report,
)
from tests.e2e.stack import Stack, hang_up_after, sim_provider
from tests.e2e.upstreams import (
    ALIAS,
    MESSAGES,
    MakeStack,
    all_idle,
    provider_of,
    upstream_provider,
    wait_idle,
)
from tests.timing import GUARD_S

#: Probes every half second: a probe of a runtime that is generating times out within it,
#: and one of an idle runtime answers within it however loaded the machine.
PROBE_EVERY_S = 0.5
#: Long enough that a cooldown never ends by itself during a test.
COOLDOWN = {"cooldown": {"failures": 3, "seconds": 60}}
#: A tool-result turn with `content: null`: llama.cpp answers it with a 500.
BAD_MESSAGES: list[Any] = [
    {"role": "user", "content": "what is the weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": None},
]


def _health(provider_id: str, health: str) -> Callable[[dict[str, Any]], bool]:
    def check(catalog: dict[str, Any]) -> bool:
        entry = provider_of(catalog, provider_id)
        return bool(entry["connected"] and entry["health"] == health)

    return check


def _message(error: openai.APIStatusError) -> str:
    """The OpenAI error body's `message`, exactly as the Edge sent it."""
    assert isinstance(error.body, dict)
    message = error.body["message"]
    assert isinstance(message, str)
    return message


def _timing(header: str) -> dict[str, float]:
    """`Server-Timing` as {name: milliseconds}."""
    return {name: float(dur) for name, dur in re.findall(r"(\w+);dur=([\d.]+)", header)}


async def _ledger(stack: Stack) -> list[dict[str, Any]]:
    """Every usage record, oldest first."""
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    with sqlite3.connect(stack.edge.ledger.path) as db:
        db.row_factory = sqlite3.Row
        return [dict(row) for row in db.execute("SELECT * FROM usage ORDER BY time")]


# --- 1. busy is not down ------------------------------------------------------------------


async def test_a_provider_generating_is_busy_and_queued_callers_wait_their_turn(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """While it generates, the runtime does not answer its model list: the probe times
    out, and the provider is `busy`, not `unavailable`. A second caller waits for the
    slot (capacity 1) as it would direct, instead of getting `503 no_provider`."""
    release = trio.Event()

    async def hold_after_first(index: int) -> None:
        if index >= 1:
            await release.wait()

    fake = FakeUpstream(chunks=3, pace=hold_after_first, **LLAMA_CPP)
    provider = upstream_provider(
        "gpu",
        await nursery.start(fake.serve),
        capacity=1,
        health_interval_s=PROBE_EVERY_S,
        first_byte_timeout_s=30,
        request_timeout_s=60,
    )
    stack = await make_stack([provider])
    async with stack.client() as client:
        with trio.fail_after(GUARD_S):
            stream = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            first = await stream.__anext__()
        assert first.choices[0].delta.content == "tok0 "
        catalog = await stack.wait_catalog(_health("gpu", "busy"))
        entry = provider_of(catalog, "gpu")
        # The Node's words, once (the health is its own column), and whose run it is.
        assert not entry["health_reason"].startswith("busy")
        assert "1 run from IOP producing output at the runtime" in entry["health_reason"]
        assert entry["discovered_models"] == ["fake-model"]  # still serving what it served

        answers: list[str | None] = []

        async def second_caller() -> None:
            completion = await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
            answers.append(completion.choices[0].message.content)

        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as callers:
                callers.start_soon(second_caller)
                await stack.wait_catalog(lambda c: c["models"][0]["queued"] == 1)
                release.set()
                rest = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(["tok0 ", *rest]) == "tok0 tok1 tok2 "
    assert answers == ["tok0 tok1 tok2 "]
    await stack.wait_catalog(_health("gpu", "available"))  # idle again: the probe answers
    assert all_idle(await stack.catalog())


async def test_a_runtime_loading_its_model_on_the_first_request_is_busy_not_down(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """The first request after start waits for the model to load, with no output yet:
    within its budget the run counts as progressing, so the provider is `busy`."""
    loaded = trio.Event()
    fake = FakeUpstream(warmup=loaded.wait, **LLAMA_CPP)
    provider = upstream_provider(
        "gpu",
        await nursery.start(fake.serve),
        health_interval_s=PROBE_EVERY_S,
        request_timeout_s=60,
    )
    stack = await make_stack([provider])
    answers: list[str | None] = []

    async def first_caller() -> None:
        async with stack.client() as client:
            completion = await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
        answers.append(completion.choices[0].message.content)

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as callers:
            callers.start_soon(first_caller)
            await stack.wait_catalog(_health("gpu", "busy"))
            loaded.set()
    assert answers == ["tok0 tok1 tok2 "]
    await stack.wait_catalog(_health("gpu", "available"))


async def test_no_probe_reaches_a_runtime_while_it_generates(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """llama-cpp-python's server cuts the stream it generates when any other request
    arrives, a model listing included. Output is proof of life, so the Node does not probe
    a provider whose runs produce output: a stream outlives many probe intervals whole."""
    release = trio.Event()

    async def hold_at_two(index: int) -> None:
        if index == 2:
            await release.wait()

    fake = FakeUpstream(chunks=5, pace=hold_at_two, **LLAMA_CPP)
    provider = upstream_provider(
        "gpu",
        await nursery.start(fake.serve),
        health_interval_s=PROBE_EVERY_S,
        first_byte_timeout_s=30,
        request_timeout_s=60,
    )
    stack = await make_stack([provider])

    def listings() -> int:
        return sum(r.path == "/v1/models" for r in fake.requests)

    async with stack.client() as client:
        with trio.fail_after(GUARD_S):
            stream = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            chunks = [await stream.__anext__(), await stream.__anext__()]
        await stack.wait_catalog(_health("gpu", "busy"))
        fake.interrupt_streams = True  # from now on, any request would cut the stream
        before = listings()
        await trio.sleep(4 * PROBE_EVERY_S)  # not a wait for anything: 4 probe intervals
        probed_while_generating = listings() - before
        release.set()
        with trio.fail_after(GUARD_S):
            chunks += [chunk async for chunk in stream]
    assert probed_while_generating == 0
    assert fake.interrupted == 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok0 tok1 tok2 tok3 tok4 "
    assert chunks[-1].choices[0].finish_reason == "stop"
    await stack.wait_catalog(_health("gpu", "available"))  # probed again once idle


async def test_runs_stalled_past_the_first_byte_timeout_take_the_provider_out(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """Silence is not progress: a stream that shows nothing for its first-byte budget while
    the probe gets no answer leaves the pool at the next probe, and the catalog says why."""
    release = trio.Event()

    async def stall_after_first(index: int) -> None:
        if index >= 1:
            await release.wait()

    fake = FakeUpstream(chunks=3, pace=stall_after_first, **LLAMA_CPP)
    provider = upstream_provider(
        "gpu",
        await nursery.start(fake.serve),
        health_interval_s=PROBE_EVERY_S,
        first_byte_timeout_s=1.0,
        request_timeout_s=60,
    )
    stack = await make_stack([provider])
    async with stack.client() as client:
        with trio.fail_after(GUARD_S):
            stream = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            await stream.__anext__()
        catalog = await stack.wait_catalog(_health("gpu", "unavailable"))
        assert "(stalled)" in provider_of(catalog, "gpu")["health_reason"]
        with trio.fail_after(GUARD_S), pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
        assert (caught.value.status_code, caught.value.code) == (503, "no_provider")
        release.set()  # the runtime recovers: the run ends and the probe answers again
        with trio.fail_after(GUARD_S):
            async for _chunk in stream:
                pass
    await stack.wait_catalog(_health("gpu", "available"))
    assert all_idle(await stack.catalog())


# --- 2. blame -------------------------------------------------------------------------------


@pytest.mark.parametrize("providers", [1, 2])
async def test_bad_requests_from_one_caller_never_fail_another_callers_good_request(
    nursery: trio.Nursery, make_stack: MakeStack, providers: int
) -> None:
    """Three times the cooldown threshold of bad requests (stream and not, one of them with
    the SDK's default retries) and the model is still there for everyone else."""
    fakes = [FakeUpstream(**LLAMA_CPP) for _ in range(providers)]
    stack = await make_stack(
        [
            upstream_provider(f"gpu-{i}", await nursery.start(fake.serve))
            for i, fake in enumerate(fakes)
        ],
        dispatch=COOLDOWN,
    )
    errors: list[openai.APIStatusError] = []
    with trio.fail_after(3 * GUARD_S):
        async with stack.client() as bad_caller:
            for attempt in range(9):
                with pytest.raises(openai.APIStatusError) as caught:
                    await bad_caller.chat.completions.create(
                        model=ALIAS, messages=BAD_MESSAGES, stream=bool(attempt % 2)
                    )
                errors.append(caught.value)
        async with stack.client(max_retries=2) as retrying_caller:  # the SDK's default
            with pytest.raises(openai.APIStatusError):
                await retrying_caller.chat.completions.create(model=ALIAS, messages=BAD_MESSAGES)
        async with stack.client() as good_caller:
            completion = await good_caller.chat.completions.create(model=ALIAS, messages=MESSAGES)
    assert completion.choices[0].message.content == "tok0 tok1 tok2 "
    catalog = await stack.catalog()
    for entry in catalog["providers"]:
        assert (entry["cooling_down"], entry["consecutive_failures"]) == (False, 0)
    assert all_idle(catalog)

    for error in errors:
        headers = error.response.headers
        assert headers["x-iop-provider"].startswith("gpu-")
        assert headers["x-request-id"].startswith("req_")
        assert "upstream;dur=" in headers["server-timing"]
    if providers == 2:
        # Both providers said 500 to the same request: the request's fault. The caller
        # gets what calling the upstream directly gives: its status and its message.
        assert {(e.status_code, e.code) for e in errors} == {(500, "upstream_rejected")}
        assert {_message(e) for e in errors} == {invalid_report()}
        # Each bad call tried on both providers (the retrying SDK made 3), then the good one.
        assert sum(fake.requests_total for fake in fakes) == 2 * 9 + 2 * 3 + 1
    else:
        # One provider: a 500 alone cannot tell whose fault it is; nobody is penalised.
        assert {(e.status_code, e.code) for e in errors} == {(502, "upstream_error")}
        assert all(INVALID_REASON in e.message for e in errors)
        assert all("upstream returned 500" in e.message for e in errors)


async def test_a_5xx_counts_against_a_provider_only_when_another_one_serves_the_request(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    broken = FakeUpstream(status=500, error_message="CUDA error: an illegal memory access")
    healthy = FakeUpstream()
    stack = await make_stack(
        [
            upstream_provider("broken", await nursery.start(broken.serve), priority=1),
            upstream_provider("healthy", await nursery.start(healthy.serve), priority=50),
        ],
        dispatch=COOLDOWN,
    )
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            for _ in range(3):
                raw = await client.chat.completions.with_raw_response.create(
                    model=ALIAS, messages=MESSAGES
                )
                assert raw.headers["x-iop-provider"] == "healthy"
    entry = provider_of(await stack.catalog(), "broken")
    assert (entry["cooling_down"], entry["consecutive_failures"]) == (True, 3)
    assert entry["health_reason"] == "cooling down after 3 consecutive failures"


@pytest.mark.parametrize("status", [400, 409, 422])
async def test_an_upstream_4xx_is_the_callers_answer_whole_with_no_failover(
    nursery: trio.Nursery, make_stack: MakeStack, status: int
) -> None:
    refusing = FakeUpstream(invalid_status=status)
    other = FakeUpstream()
    stack = await make_stack(
        [
            upstream_provider("refusing", await nursery.start(refusing.serve), priority=1),
            upstream_provider("other", await nursery.start(other.serve), priority=50),
        ],
        dispatch=COOLDOWN,
    )
    with trio.fail_after(GUARD_S), pytest.raises(openai.APIStatusError) as caught:
        async with stack.client() as client:
            await client.chat.completions.create(model=ALIAS, messages=BAD_MESSAGES)
    assert caught.value.status_code == status
    assert caught.value.code == "upstream_rejected"
    message = _message(caught.value)
    assert message == invalid_report()  # whole: newlines, indentation, the reason at the end
    assert len(message) > 500
    assert caught.value.response.headers["x-iop-provider"] == "refusing"
    assert other.requests_total == 0
    entry = provider_of(await stack.catalog(), "refusing")
    assert (entry["cooling_down"], entry["consecutive_failures"]) == (False, 0)


# --- 3. metering with no gaps ---------------------------------------------------------------


def _estimated_completion(chunks: int) -> int:
    """The Node's estimate for a whole stream of the fake's `chunks` tokens."""
    tally = OutputTally()
    for event in expected_events("fake-model", chunks):
        tally.add(event)
    return tally.tokens()


async def test_a_stream_without_a_usage_chunk_is_metered_as_estimated(
    nursery: trio.Nursery,
    make_stack: MakeStack,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # every usage column (80 leaves some out, named)
    fake = FakeUpstream(chunks=5, **LLAMA_CPP)
    stack = await make_stack([upstream_provider("gpu", await nursery.start(fake.serve))])
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            stream = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
    assert text == "tok0 tok1 tok2 tok3 tok4 "
    streamed, whole = await _ledger(stack)
    prompt = estimate_input_tokens({"messages": MESSAGES})
    assert (streamed["usage_source"], streamed["status"]) == ("estimated", 200)
    assert (streamed["prompt_tokens"], streamed["completion_tokens"]) == (
        prompt,
        _estimated_completion(5),
    )
    assert whole["usage_source"] == "provider"  # a non-stream answer carries its usage
    assert (whole["prompt_tokens"], whole["completion_tokens"]) == (11, 5)

    async with stack.admin() as admin:
        report = (await admin.get("/usage", params={"group_by": "usage_source"})).json()
    rows = {row["usage_source"]: row for row in report["rows"]}
    assert rows["estimated"]["estimated_requests"] == 1
    assert rows["estimated"]["estimated_tokens"] == prompt + _estimated_completion(5)
    assert rows["provider"]["estimated_requests"] == 0
    code = await trio.to_thread.run_sync(
        edge_cli, ["usage", "--admin", stack.addresses.admin_url, "--group-by", "model"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "estimated" in out
    # the last two columns: estimated requests, estimated tokens
    assert re.search(rf"│\s*1\s*│\s*{prompt + _estimated_completion(5)}\s*│", out), out


async def test_a_stream_the_caller_cancels_is_metered_with_what_reached_it(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    async def stall_after_three(index: int) -> None:
        if index >= 3:
            await trio.sleep_forever()

    fake = FakeUpstream(chunks=20, pace=stall_after_three, **LLAMA_CPP)
    stack = await make_stack([upstream_provider("gpu", await nursery.start(fake.serve))])
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            stream = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            await hang_up_after(stream, 3)
    await wait_idle(stack)
    [record] = await _ledger(stack)
    assert (record["status"], record["usage_source"]) == (499, "estimated")
    prompt = estimate_input_tokens({"messages": MESSAGES})
    # The Edge ended this run itself: one token per chunk it relayed.
    assert (record["prompt_tokens"], record["completion_tokens"]) == (prompt, 3)


async def test_a_stream_cut_by_a_lost_node_is_metered_with_what_reached_the_caller(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    async def stall_after_two(index: int) -> None:
        if index >= 2:
            await trio.sleep_forever()

    fake = FakeUpstream(chunks=20, pace=stall_after_two, **LLAMA_CPP)
    stack = await make_stack([upstream_provider("gpu", await nursery.start(fake.serve))])
    pieces: list[str] = []
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            stream = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            with pytest.raises(openai.APIError) as caught:
                async for chunk in stream:
                    pieces.append(chunk.choices[0].delta.content or "")
                    if len(pieces) == 2:
                        stack.kill_node()
    assert pieces == ["tok0 ", "tok1 "]
    assert "disconnected" in caught.value.message
    [record] = await _ledger(stack)
    assert (record["status"], record["usage_source"]) == (502, "estimated")
    assert record["completion_tokens"] == 2
    assert record["prompt_tokens"] == estimate_input_tokens({"messages": MESSAGES})


# --- 4. errors ------------------------------------------------------------------------------


async def test_after_a_failover_the_lost_time_is_upstream_and_the_id_is_the_requests(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """The first provider takes 0.3 s to fail: that is time the caller spent on providers
    (`upstream`), not in the Edge. The answer comes from the second attempt (`req_x.1` on
    the wire) and still carries an id derived from the caller's request id."""
    slow_failure = FakeUpstream(status=500, first_byte_delay_s=0.3)
    stack = await make_stack(
        [
            upstream_provider("slow-failure", await nursery.start(slow_failure.serve), priority=1),
            sim_provider("sim", priority=50),
        ]
    )
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            raw = await client.chat.completions.with_raw_response.create(
                model=ALIAS, messages=MESSAGES, max_tokens=3
            )
    assert raw.headers["x-iop-provider"] == "sim"
    request_id = raw.headers["x-request-id"]
    assert raw.parse().id == f"chatcmpl-{request_id}"
    assert _timing(raw.headers["server-timing"])["upstream"] >= 300


async def test_an_error_after_failovers_carries_every_attempts_upstream_time(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fakes = [FakeUpstream(first_byte_delay_s=0.2, **LLAMA_CPP) for _ in range(2)]
    stack = await make_stack(
        [
            upstream_provider(f"gpu-{i}", await nursery.start(fake.serve))
            for i, fake in enumerate(fakes)
        ]
    )
    body = {"model": ALIAS, "messages": BAD_MESSAGES}
    with trio.fail_after(GUARD_S):
        async with stack.http() as http:
            response = await http.post(
                "/v1/chat/completions", json=body, headers={"x-request-id": "caller-123"}
            )
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "caller-123"
    assert response.headers["x-iop-provider"] in {"gpu-0", "gpu-1"}
    assert _timing(response.headers["server-timing"])["upstream"] >= 400
    error = json.loads(response.content)["error"]
    assert error["message"] == invalid_report()
