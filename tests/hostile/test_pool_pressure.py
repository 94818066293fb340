"""One principal against the pool's shares: a burst built to outrun a daily budget over
two replicas, and a few huge requests built to take the slots from many small ones
(design §15). Neither gets more than its share."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx2
import psycopg
import trio
import yaml

from iop_edge.runtime.metering.usage_ledger.ledger_postgres import TABLE
from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.postgres import PASSWORD_ENV
from tests.e2e.stack import Stack, edge_config, principals_section, sim_provider, start_stack
from tests.e2e.upstreams import posts, upstream_provider
from tests.timing import GUARD_S

ALICE = "sk-alice-burst-not-a-secret"
HOG = "sk-hog-not-a-secret"
SMALL = "sk-small-not-a-secret"
BUDGET = 600
MAX_TOKENS = 40


def _with_principals(text: str, principals: list[dict[str, Any]]) -> str:
    config = yaml.safe_load(text)
    config["principals"] = principals
    return yaml.safe_dump(config, sort_keys=False)


def _body(protocol: str, stream: bool) -> tuple[str, dict[str, Any]]:
    ask = [{"role": "user", "content": "spend"}]
    if protocol == "chat":
        body = {"model": "m", "messages": ask, "max_tokens": MAX_TOKENS, "stream": stream}
        return "/v1/chat/completions", body
    if protocol == "messages":
        return "/v1/messages", {"model": "m", "messages": ask, "max_tokens": MAX_TOKENS,
                                "stream": stream}  # fmt: skip
    body = {"model": "m", "input": "spend", "max_output_tokens": MAX_TOKENS, "stream": stream}
    return "/v1/responses", body


async def test_a_burst_over_two_replicas_in_every_protocol_spends_the_budget_once(
    nursery: trio.Nursery, tmp_path: Path, ledger_url: str
) -> None:
    """Chat, Messages and Responses, streamed and not, some streams left after their
    first event, all at once over two Edges sharing the ledger: what the ledger meters
    for the principal passes its daily budget by one request per replica at most, and
    every refusal is a 429."""
    stacks: list[Stack] = []
    for name in ("a", "b"):
        text = edge_config(
            tmp_path / name,
            providers=[sim_provider("sim-1", capacity=8)],
            models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
            openai_section=principals_section({"alice": ALICE}),
            edge_section={"ledger": ledger_url, "ledger_password_env": PASSWORD_ENV},
        )
        text = _with_principals(text, [{"ref": "alice", "tokens_per_day": BUDGET}])
        stacks.append(
            await start_stack(nursery, text, tmp_path / f"{name}.yaml", wait_models=("m",))
        )
    statuses: list[tuple[int, int]] = []  # (replica, status)

    async def one(index: int) -> None:
        replica = index % 2
        stream = index % 4 >= 2
        path, body = _body(("chat", "messages", "responses")[index % 3], stream)
        headers = {"Authorization": f"Bearer {ALICE}"}
        async with (
            stacks[replica].http() as http,
            http.stream("POST", path, json=body, headers=headers) as response,
        ):
            statuses.append((replica, response.status_code))
            if response.status_code != 200 or not stream:
                await response.aread()
                return
            async for _ in response.aiter_lines():
                if index % 3 == 0:
                    return  # the caller leaves after the first line it reads

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as burst:
            for index in range(48):
                burst.start_soon(one, index)
        for stack in stacks:
            await stack.wait_catalog(lambda c: all(p["in_flight"] == 0 for p in c["providers"]))
            await stack.edge.ledger.wait_flushed()
    with psycopg.connect(ledger_url, password=os.environ[PASSWORD_ENV]) as connection:
        rows = connection.execute(
            f"SELECT prompt_tokens + completion_tokens FROM {TABLE} "
            "WHERE principal_ref = 'alice' AND status = 200"
        ).fetchall()
    metered = [int(tokens) for (tokens,) in rows]
    assert {status for _, status in statuses} == {200, 429}, statuses
    assert {replica for replica, status in statuses if status == 200} == {0, 1}
    assert sum(metered) <= BUDGET + 2 * max(metered), metered


async def test_a_few_huge_requests_do_not_take_the_slot_from_many_small_ones(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """One slot; a principal keeps four huge requests (1,000 tokens each) in front of
    another's six small ones (16 tokens). Served by work, the small ones all go after the
    huge one that was first in line and before the rest: the six of them together are
    less work than one huge request. Served by turns, they would alternate."""
    release = trio.Event()

    async def hold(_: int) -> None:
        await release.wait()

    fake = FakeUpstream(pace=hold)
    base_url = await nursery.start(fake.serve)
    text = edge_config(
        tmp_path / "state",
        providers=[upstream_provider("gpu", base_url, capacity=1)],
        models=[{"id": "m", "providers": {"gpu": "fake-model"}}],
        openai_section=principals_section({"hog": HOG, "small": SMALL}),
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))

    async def ask(http: httpx2.AsyncClient, who: str, max_tokens: int) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": who}],
                "max_tokens": max_tokens, "stream": True}  # fmt: skip
        token = HOG if who == "hog" else SMALL
        response = await http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}
        )
        assert response.status_code == 200, response.text

    def queued(count: int) -> Any:
        return lambda catalog: catalog["models"][0]["queued"] == count

    with trio.fail_after(GUARD_S):
        async with stack.http() as http, trio.open_nursery() as callers:
            callers.start_soon(ask, http, "hog", 1_000)  # takes the slot, held upstream
            await fake.wait_for(lambda: fake.requests_total == 1)
            for _ in range(3):
                callers.start_soon(ask, http, "hog", 1_000)
            await stack.wait_catalog(queued(3))
            for _ in range(6):
                callers.start_soon(ask, http, "small", 16)
            await stack.wait_catalog(queued(9))
            release.set()
    order = [body["messages"][0]["content"] for body in posts(fake)]
    assert order == ["hog", "hog", *["small"] * 6, "hog", "hog"], order
