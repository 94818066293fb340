"""A pool shared by principals, end to end (design §15): allow-lists, rate limits and
budgets with their codes and headers, concurrency caps that queue, live refresh of
limits, budgets across a restart, and what `/usage` and `/metrics` show.

Real Edge and Node on 127.0.0.1 port 0, called with the official clients.
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest
import trio
import yaml

from iop_edge.runtime.runs.limits import LedgerTotals
from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.postgres import PASSWORD_ENV
from tests.e2e.stack import Stack, edge_config, sim_provider, start_stack
from tests.e2e.upstreams import upstream_provider
from tests.timing import GUARD_S

TOKENS = {"alice": "sk-alice-not-a-secret", "bob": "sk-bob-not-a-secret"}


def principal_tokens() -> list[dict[str, str]]:
    return [
        {
            "token_ref": f"{name}-key",
            "principal_ref": name,
            "token_hash_sha256": hashlib.sha256(token.encode()).hexdigest(),
        }
        for name, token in TOKENS.items()
    ]


def shared_config(
    state_dir: Path,
    principals: list[dict[str, Any]],
    *,
    capacity: int = 4,
    adapter: dict[str, Any] | None = None,
    dispatch: dict[str, Any] | None = None,
) -> str:
    """Two models on one sim provider, two callers, and `principals`."""
    text = edge_config(
        state_dir,
        providers=[
            sim_provider(
                "sim-1",
                capacity=capacity,
                served="sim-small",
                adapter=adapter or {"ttft_ms": 5, "tokens_per_second": 2000},
            )
        ],
        models=[
            {"id": "chat-small", "providers": {"sim-1": "sim-small"}},
            {"id": "internal-big", "providers": {"sim-1": "sim-small"}},
        ],
        openai_section={"principal_tokens": principal_tokens()},
        dispatch=dispatch,
    )
    config = yaml.safe_load(text)
    config["principals"] = principals
    return yaml.safe_dump(config, sort_keys=False)


async def start(
    nursery: trio.Nursery, tmp_path: Path, principals: list[dict[str, Any]], **options: Any
) -> Stack:
    text = shared_config(tmp_path, principals, **options)
    return await start_stack(
        nursery, text, tmp_path / "edge.yaml", wait_models=("chat-small", "internal-big")
    )


def ask(model: str = "chat-small", max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
    }


async def chat(stack: Stack, who: str, **body: Any) -> httpx2.Response:
    async with stack.http() as http:
        return await http.post(
            "/v1/chat/completions",
            json=ask(**body),
            headers={"Authorization": f"Bearer {TOKENS[who]}"},
        )


# --- allow-lists -----------------------------------------------------------------------------


async def test_a_model_outside_the_allow_list_does_not_exist_for_the_caller(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await start(nursery, tmp_path, [{"ref": "bob", "models": ["chat-*"]}])
    denied = await chat(stack, "bob", model="internal-big")
    unknown = await chat(stack, "bob", model="no-such-model")
    assert denied.status_code == unknown.status_code == 404
    assert denied.json() == {
        "error": {**unknown.json()["error"], "message": "The model 'internal-big' does not exist"}
    }
    assert denied.json()["error"]["code"] == "model_not_found"
    assert (await chat(stack, "alice", model="internal-big")).status_code == 200
    assert (await chat(stack, "bob", model="chat-small")).status_code == 200

    async with stack.client(api_key=TOKENS["bob"]) as client:
        assert [model.id async for model in client.models.list()] == ["chat-small"]
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("internal-big")
    async with stack.client(api_key=TOKENS["alice"]) as client:
        assert sorted([model.id async for model in client.models.list()]) == [
            "chat-small",
            "internal-big",
        ]
    async with anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url, api_key=TOKENS["bob"], max_retries=0
    ) as claude:
        page = await claude.models.list()
        assert [model.id for model in page.data] == ["chat-small"]
        with pytest.raises(anthropic.NotFoundError):
            await claude.messages.create(
                model="internal-big",
                max_tokens=4,
                messages=[{"role": "user", "content": "hello"}],
            )


# --- rate limits ---------------------------------------------------------------------------


async def test_requests_per_minute_answer_429_with_openais_headers(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await start(nursery, tmp_path, [{"ref": "alice", "requests_per_minute": 2}])
    async with stack.client(api_key=TOKENS["alice"]) as client:
        first = await client.chat.completions.with_raw_response.create(**ask())
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-reset-requests"].endswith("s")
        assert "x-ratelimit-limit-tokens" not in first.headers  # only the limits set
        await client.chat.completions.create(**ask())
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(**ask())
    refused = caught.value.response
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_requests"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(refused.headers["retry-after"]) <= 30
    # Another principal is not limited by alice's limit.
    assert (await chat(stack, "bob")).status_code == 200


async def test_requests_that_failed_upstream_do_not_count_against_the_limit(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A caller retrying a provider's 500 spends none of its `requests_per_minute`: only
    the request that was answered counts (design §15)."""
    upstream = FakeUpstream(status=500, error_message="CUDA error")
    base_url = await nursery.start(upstream.serve)
    config = yaml.safe_load(
        edge_config(
            tmp_path,
            providers=[upstream_provider("gpu", base_url, served="gpu-model")],
            models=[{"id": "chat-small", "providers": {"gpu": "gpu-model"}}],
            openai_section={"principal_tokens": principal_tokens()},
        )
    )
    config["principals"] = [{"ref": "alice", "requests_per_minute": 2}]
    stack = await start_stack(
        nursery,
        yaml.safe_dump(config, sort_keys=False),
        tmp_path / "edge.yaml",
        wait_models=("chat-small",),
    )
    async with stack.client(api_key=TOKENS["alice"]) as client:
        for stream in (False, True, False, True, False):
            with pytest.raises(openai.InternalServerError) as caught:
                await client.chat.completions.create(**ask(), stream=stream)
            assert caught.value.status_code == 502
        assert upstream.requests_total == 5
        upstream.status = 200  # the runtime is back
        answered = await client.chat.completions.with_raw_response.create(**ask())
        assert answered.headers["x-ratelimit-remaining-requests"] == "1"
        await client.chat.completions.create(**ask())
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(**ask())
    assert refused.value.code == "rate_limit_requests"


async def test_tokens_per_minute_count_the_requests_own_bound(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await start(nursery, tmp_path, [{"ref": "alice", "tokens_per_minute": 300}])
    admitted = await chat(stack, "alice", max_tokens=200)
    assert admitted.status_code == 200
    assert admitted.headers["x-ratelimit-limit-tokens"] == "300"
    assert int(admitted.headers["x-ratelimit-remaining-tokens"]) < 100  # 200 + the prompt
    # The run used 200 output tokens at most: settled, what it did not use came back, but
    # another 200 do not fit in what is left this minute.
    refused = await chat(stack, "alice", max_tokens=200)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_tokens"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "retry-after" in refused.headers


async def test_the_daily_budget_survives_a_restart(nursery: trio.Nursery, tmp_path: Path) -> None:
    principals = [{"ref": "alice", "tokens_per_day": 30}]
    text = shared_config(tmp_path, principals)
    config_path = tmp_path / "edge.yaml"
    async with trio.open_nursery() as first:
        stack = await start_stack(first, text, config_path, wait_models=("chat-small",))
        assert (await chat(stack, "alice", max_tokens=30)).status_code == 200
        refused = await chat(stack, "alice", max_tokens=1)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "budget_exceeded"
        await stack.edge.ledger.wait_flushed()
        first.cancel_scope.cancel()  # the Edge and its Node are gone
    # Same state_dir, a new Edge: today's usage is read from the ledger before it serves.
    stack = await start_stack(nursery, text, config_path, wait_models=("chat-small",))
    again = await chat(stack, "alice", max_tokens=1)
    assert again.status_code == 429
    assert again.json()["error"]["code"] == "budget_exceeded"
    assert again.headers["x-ratelimit-limit-tokens"] == "30"
    assert again.headers["x-ratelimit-remaining-tokens"] == "0"
    assert int(again.headers["retry-after"]) > 0
    assert (await chat(stack, "bob", max_tokens=1)).status_code == 200


# --- concurrency ---------------------------------------------------------------------------


async def test_max_concurrent_queues_instead_of_refusing(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    slow = {"ttft_ms": 5, "tokens_per_second": 100}
    stack = await start(
        nursery, tmp_path, [{"ref": "alice", "max_concurrent": 1}], capacity=4, adapter=slow
    )
    statuses: list[int] = []
    peak = 0

    async def one() -> None:
        statuses.append((await chat(stack, "alice", max_tokens=20)).status_code)

    async def watch() -> None:
        nonlocal peak
        while True:
            load = stack.edge.scheduler.principal_load().get("alice")
            if load is not None:
                peak = max(peak, load.in_flight)
            await stack.edge.wait_pool_change()

    async with trio.open_nursery() as inner:
        inner.start_soon(watch)
        async with trio.open_nursery() as callers:
            for _ in range(3):
                callers.start_soon(one)
        inner.cancel_scope.cancel()
    assert statuses == [200, 200, 200]
    assert peak == 1


async def test_a_request_max_concurrent_held_past_the_queue_timeout_is_counted_refused(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The refusal is the scheduler's, once the wait ends: `/principals` counts it with
    the limits' own, as `/metrics` does."""
    slow = {"ttft_ms": 5, "tokens_per_second": 20}  # the first run holds its slot 3 s
    stack = await start(
        nursery,
        tmp_path,
        [{"ref": "alice", "max_concurrent": 1}],
        adapter=slow,
        dispatch={"queue_timeout_ms": 300},
    )
    async with trio.open_nursery() as load:
        load.start_soon(partial(chat, stack, "alice", max_tokens=60))
        await stack.wait_catalog(lambda c: c["providers"][0]["in_flight"] == 1)
        refused = await chat(stack, "alice")
        load.cancel_scope.cancel()
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "concurrency_limit"
    async with stack.admin() as admin:
        report = (await admin.get("/principals")).json()
    [alice] = [p for p in report["principals"] if p["principal_ref"] == "alice"]
    assert alice["rejected"] == {"max_concurrent": 1}


# --- refresh -------------------------------------------------------------------------------


async def test_limits_change_live_and_keep_their_counts(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    slow = {"ttft_ms": 5, "tokens_per_second": 50}
    stack = await start(
        nursery, tmp_path, [{"ref": "alice", "requests_per_minute": 3}], adapter=slow
    )
    async with trio.open_nursery() as load:
        # A run in flight while the limits change: it is neither cut nor restarted.
        async def long_run() -> None:
            response = await chat(stack, "alice", max_tokens=25)
            assert response.status_code == 200

        load.start_soon(long_run)
        await stack.wait_catalog(lambda c: c["providers"][0]["in_flight"] == 1)
        candidate = shared_config(
            tmp_path, [{"ref": "alice", "requests_per_minute": 4}], adapter=slow
        )
        async with stack.admin() as admin:
            response = await admin.post(
                "/refresh", json={"mode": "apply", "config_yaml": candidate}
            )
        report = response.json()
        assert response.status_code == 200, report
        assert report["outcome"] == "applied"
        assert report["live_paths"] == ["principals[alice].requests_per_minute"]
        assert report["restart_required_paths"] == []
    # One request before the refresh counted: 4 - 1 - this one.
    after = await chat(stack, "alice")
    assert after.headers["x-ratelimit-limit-requests"] == "4"
    assert after.headers["x-ratelimit-remaining-requests"] == "2"


# --- visibility ----------------------------------------------------------------------------


async def test_usage_and_metrics_show_each_principal_against_its_limits(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await start(
        nursery,
        tmp_path,
        [
            {"ref": "alice", "requests_per_minute": 1, "max_concurrent": 2, "weight": 2},
            {"ref": "*", "models": ["chat-*"], "tokens_per_day": 100_000},
        ],
    )
    assert (await chat(stack, "alice")).status_code == 200
    assert (await chat(stack, "alice")).status_code == 429
    assert (await chat(stack, "bob", max_tokens=8)).status_code == 200
    await stack.edge.ledger.wait_flushed()
    async with stack.admin() as admin:
        usage = (await admin.get("/usage", params={"group_by": "principal_ref"})).json()
        metrics = (await admin.get("/metrics")).text
        page = (await admin.get("/principals")).json()  # what the pool page draws
    standings = {row["principal_ref"]: row for row in usage["principals"]["principals"]}
    alice, bob = standings["alice"], standings["bob"]
    assert alice["limited_by"] == "alice"
    assert (alice["requests_per_minute"], alice["requests_remaining"]) == (1, 0)
    assert (alice["max_concurrent"], alice["weight"]) == (2, 2.0)
    assert alice["rejected"] == {"requests_per_minute": 1}
    assert (bob["limited_by"], bob["models"]) == ("*", ["chat-*"])
    assert bob["tokens_today"] > 8
    assert bob["budget_remaining"] == 100_000 - bob["tokens_today"]
    assert usage["principals"]["replicas"] == 1
    assert {row["principal_ref"] for row in page["principals"]} == {"alice", "bob"}
    assert (
        'iop_principal_rejections_total{limit="requests_per_minute",principal_ref="alice"} 1.0'
        in (metrics)
    )
    assert 'iop_principal_queue_wait_seconds_count{principal_ref="bob"} 1.0' in metrics


async def test_anthropic_callers_get_anthropics_rate_limit_headers(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await start(nursery, tmp_path, [{"ref": "alice", "requests_per_minute": 5}])
    async with anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url, api_key=TOKENS["alice"], max_retries=0
    ) as claude:
        raw = await claude.messages.with_raw_response.create(
            model="chat-small", max_tokens=4, messages=[{"role": "user", "content": "hello"}]
        )
    assert raw.headers["anthropic-ratelimit-requests-limit"] == "5"
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "4"
    assert raw.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    assert "x-ratelimit-limit-requests" not in raw.headers


# --- several Edges -------------------------------------------------------------------------


async def test_replicas_share_budgets_and_split_per_minute_limits(
    nursery: trio.Nursery, tmp_path: Path, ledger_url: str
) -> None:
    principals = [{"ref": "alice", "requests_per_minute": 10, "tokens_per_day": 30}]
    stacks = []
    for name in ("a", "b"):
        config = yaml.safe_load(shared_config(tmp_path / name, principals))
        config["edge"] |= {"ledger": ledger_url, "ledger_password_env": PASSWORD_ENV}
        text = yaml.safe_dump(config, sort_keys=False)
        stacks.append(
            await start_stack(nursery, text, tmp_path / f"{name}.yaml", wait_models=("chat-small",))
        )
    a, b = stacks
    for stack in stacks:  # the roster's next heartbeat, now: each sees two replicas
        await stack.edge.roster.read()
    assert a.edge.limiter.replicas == b.edge.limiter.replicas == 2

    first = await chat(a, "alice", max_tokens=30)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "5"  # half of 10 on each replica
    with trio.fail_after(GUARD_S):
        await a.edge.ledger.wait_flushed()
    # b reads the shared ledger (every BUDGET_SYNC_S while replicas share it; now here):
    # alice's budget is spent on a, so b refuses her too.
    await b.edge.limiter.read_ledger(LedgerTotals(b.edge.ledger))
    refused = await chat(b, "alice", max_tokens=1)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "budget_exceeded"
    assert (await chat(b, "bob", max_tokens=1)).status_code == 200


async def test_a_burst_over_two_replicas_overshoots_the_budget_by_one_request_at_most(
    nursery: trio.Nursery, tmp_path: Path, ledger_url: str
) -> None:
    """Both Edges reserve against one counter in the shared ledger: a burst spread over
    them spends the budget once, not once per replica (limits Rule 7)."""
    budget = 400
    principals = [{"ref": "alice", "tokens_per_day": budget}]
    stacks = []
    for name in ("a", "b"):
        config = yaml.safe_load(shared_config(tmp_path / name, principals, capacity=8))
        config["edge"] |= {"ledger": ledger_url, "ledger_password_env": PASSWORD_ENV}
        text = yaml.safe_dump(config, sort_keys=False)
        stacks.append(
            await start_stack(nursery, text, tmp_path / f"{name}.yaml", wait_models=("chat-small",))
        )
    answers: list[tuple[str, httpx2.Response]] = []

    async def one(name: str, stack: Stack) -> None:
        answers.append((name, await chat(stack, "alice", max_tokens=20)))

    async with trio.open_nursery() as burst:
        for index in range(40):
            burst.start_soon(one, "ab"[index % 2], stacks[index % 2])
    admitted = [(name, answer) for name, answer in answers if answer.status_code == 200]
    refused = [answer for _, answer in answers if answer.status_code != 200]
    assert refused and all(answer.status_code == 429 for answer in refused)
    assert {answer.json()["error"]["code"] for answer in refused} == {"budget_exceeded"}
    assert {name for name, _ in admitted} == {"a", "b"}  # both replicas served the burst
    sizes = [answer.json()["usage"]["total_tokens"] for _, answer in admitted]
    # At most the one request that crossed the line, across both replicas.
    assert sum(sizes) <= budget + max(sizes), sizes
