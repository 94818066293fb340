"""Cached prompt tokens, from the runtime to the caller and the books (design §7).

A runtime with a prefix cache says how much of a prompt it did not compute: OpenAI's
`usage.prompt_tokens_details.cached_tokens` (vLLM, llama-server), Anthropic's
`cache_read_input_tokens`, Responses' `input_tokens_details.cached_tokens`, or only
llama.cpp's `timings.cache_n`. Whatever the caller's protocol, spoken natively by the
provider or translated by its Node, streamed or not, the caller reads the count in its
own protocol's field, and the Edge records it: the ledger's `cached_tokens`, `GET /usage`,
`iop_prompt_cache_tokens_total` and each provider's `cached_share` in the catalog.
"""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path
from typing import Any, Final

import anthropic
import psycopg
import pytest
import trio

from iop_edge.cli import main as edge_cli
from tests.adapters.fake_data import PROMPT_TOKENS
from tests.adapters.fake_protocols import CACHED_TOKENS
from tests.adapters.fake_upstream import CacheReport, FakeUpstream
from tests.e2e.postgres import PASSWORD_ENV
from tests.e2e.stack import Stack, edge_config, start_stack
from tests.e2e.upstreams import MakeStack, all_idle, upstream_provider
from tests.timing import GUARD_S

#: model -> the provider serving it: one speaking every protocol natively, one speaking
#: chat only (its Node translates Messages and Responses), one that is llama.cpp telling
#: its cache in `timings` alone.
PROVIDERS: Final = {"native-m": "native", "translated-m": "chat-only", "timings-m": "llama"}
MESSAGES: Final[list[Any]] = [{"role": "user", "content": "hello there"}]


async def _stack(nursery: trio.Nursery, make_stack: MakeStack) -> Stack:
    fakes = {
        "native": FakeUpstream(
            native=frozenset({"messages", "responses"}), cache=CacheReport(CACHED_TOKENS)
        ),
        "chat-only": FakeUpstream(cache=CacheReport(CACHED_TOKENS)),
        "llama": FakeUpstream(cache=CacheReport(CACHED_TOKENS, where="timings")),
    }
    providers = []
    for provider_id, fake in fakes.items():
        base_url = await nursery.start(fake.serve)
        protocols = ["chat", "messages", "responses"] if provider_id == "native" else ["chat"]
        providers.append(upstream_provider(provider_id, base_url, protocols=protocols))
    models = [{"id": model, "providers": {p: "fake-model"}} for model, p in PROVIDERS.items()]
    return await make_stack(providers, models=models)


async def _chat(stack: Stack, model: str, *, stream: bool) -> Any:
    """The usage the caller reads."""
    with trio.fail_after(GUARD_S):
        return await _chat_usage(stack, model, stream=stream)


async def _chat_usage(stack: Stack, model: str, *, stream: bool) -> Any:
    async with stack.client() as client:
        if not stream:
            reply = await client.chat.completions.create(model=model, messages=MESSAGES)
            return reply.usage
        chunks = await client.chat.completions.create(
            model=model, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        usage = None
        async for chunk in chunks:
            usage = chunk.usage or usage
        return usage


async def _messages(stack: Stack, model: str, *, stream: bool) -> Any:
    with trio.fail_after(GUARD_S):
        return await _messages_usage(stack, model, stream=stream)


async def _messages_usage(stack: Stack, model: str, *, stream: bool) -> Any:
    async with anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url, api_key="unused", max_retries=0
    ) as client:
        if not stream:
            reply = await client.messages.create(model=model, max_tokens=16, messages=MESSAGES)
            return reply.usage
        async with client.messages.stream(model=model, max_tokens=16, messages=MESSAGES) as events:
            return (await events.get_final_message()).usage


async def _responses(stack: Stack, model: str, *, stream: bool) -> Any:
    with trio.fail_after(GUARD_S):
        return await _responses_usage(stack, model, stream=stream)


async def _responses_usage(stack: Stack, model: str, *, stream: bool) -> Any:
    async with stack.client() as client:
        if not stream:
            reply = await client.responses.create(model=model, input="hello there", store=False)
            return reply.usage
        events = await client.responses.create(
            model=model, input="hello there", store=False, stream=True
        )
        usage = None
        async for event in events:
            if event.type == "response.completed":
                usage = event.response.usage
        return usage


async def test_cached_tokens_reach_the_caller_and_the_books_in_every_protocol(
    nursery: trio.Nursery, make_stack: MakeStack, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = await _stack(nursery, make_stack)
    for stream in (False, True):
        for model in ("native-m", "translated-m"):
            chat = await _chat(stack, model, stream=stream)
            assert chat.prompt_tokens_details.cached_tokens == CACHED_TOKENS
            assert chat.prompt_tokens == PROMPT_TOKENS
            messages = await _messages(stack, model, stream=stream)
            assert messages.cache_read_input_tokens == CACHED_TOKENS, (model, stream)
            assert messages.input_tokens == PROMPT_TOKENS - CACHED_TOKENS
            responses = await _responses(stack, model, stream=stream)
            assert responses.input_tokens_details.cached_tokens == CACHED_TOKENS
            assert responses.input_tokens == PROMPT_TOKENS
        await _chat(stack, "timings-m", stream=stream)  # llama.cpp: `timings` only
        # A Messages caller of that runtime reads what its `timings` said too.
        messages = await _messages(stack, "timings-m", stream=stream)
        assert messages.cache_read_input_tokens == CACHED_TOKENS, stream
    await stack.wait_catalog(all_idle)  # every run has ended, so it is metered
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()

    with sqlite3.connect(stack.edge.ledger.path) as db:
        rows = db.execute(
            "SELECT model, protocol, prompt_tokens, cached_tokens, usage_source FROM usage"
        ).fetchall()
    assert len(rows) == 16
    assert {row[1:] for row in rows} >= {("chat", PROMPT_TOKENS, CACHED_TOKENS, "provider")}
    assert all(row[2:] == (PROMPT_TOKENS, CACHED_TOKENS, "provider") for row in rows), rows
    assert {(row[0], row[1]) for row in rows} == {
        (model, protocol)
        for model in ("native-m", "translated-m")
        for protocol in ("chat", "messages", "responses")
    } | {("timings-m", "chat"), ("timings-m", "messages")}

    async with stack.admin() as admin:
        report = (await admin.get("/usage", params={"group_by": "provider"})).json()
    by_provider = {row["provider"]: row for row in report["rows"]}
    assert by_provider["native"]["cached_tokens"] == 6 * CACHED_TOKENS
    assert by_provider["llama"]["cached_tokens"] == 4 * CACHED_TOKENS
    assert report["totals"]["cached_tokens"] == 16 * CACHED_TOKENS
    capsys.readouterr()
    command = ["usage", "--admin", stack.addresses.admin_url, "--group-by", "provider"]
    assert await trio.to_thread.run_sync(edge_cli, command) == 0
    lines = capsys.readouterr().out.splitlines()

    def cells(line: str) -> list[str]:
        return [cell.strip() for cell in re.split("[┃│]", line)[1:-1]]

    names = [f"{a} {b}".strip() for a, b in zip(cells(lines[2]), cells(lines[3]), strict=True)]
    [llama] = [cells(line) for line in lines if "llama" in line]
    assert llama[names.index("provider")] == "llama", lines
    assert llama[names.index("cached tokens")] == str(4 * CACHED_TOKENS), lines

    stack.edge.books.settle()  # the metrics of runs that ended are entered in batches
    registry = stack.edge.metrics.registry
    for model, provider in PROVIDERS.items():
        labels = {"model": model, "provider": provider}
        cached = registry.get_sample_value(
            "iop_prompt_cache_tokens_total", {**labels, "kind": "cached"}
        )
        prompt = registry.get_sample_value(
            "iop_prompt_cache_tokens_total", {**labels, "kind": "prompt"}
        )
        assert cached is not None and prompt is not None
        assert cached / prompt == pytest.approx(CACHED_TOKENS / PROMPT_TOKENS)

    catalog = await stack.catalog()
    shares = {p["id"]: p["cached_share"] for p in catalog["providers"]}
    assert shares == pytest.approx({p: CACHED_TOKENS / PROMPT_TOKENS for p in PROVIDERS.values()})


async def test_a_provider_that_reports_no_cache_has_no_share_and_records_zero(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream()
    base_url = await nursery.start(fake.serve)
    stack = await make_stack([upstream_provider("plain", base_url)])
    catalog = await stack.catalog()
    assert catalog["providers"][0]["cached_share"] is None  # never measured
    usage = await _chat(stack, "qwen-alias", stream=False)
    await stack.wait_catalog(all_idle)  # every run has ended, so it is metered
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    assert usage.prompt_tokens_details is None  # the runtime's own body, as it was
    with sqlite3.connect(stack.edge.ledger.path) as db:
        assert db.execute("SELECT cached_tokens FROM usage").fetchall() == [(0,)]
    catalog = await stack.catalog()
    assert catalog["providers"][0]["cached_share"] == 0.0


async def test_an_older_postgresql_ledger_gains_cached_tokens(
    nursery: trio.Nursery, tmp_path: Path, ledger_url: str
) -> None:
    """A table and index an Edge from before `cached_tokens` made: the column is added
    (0 for the old rows), the covering index is replaced by one that sums it too."""
    with psycopg.connect(ledger_url, password=os.environ[PASSWORD_ENV], autocommit=True) as db:
        db.execute(
            "CREATE TABLE iop_usage (time DOUBLE PRECISION NOT NULL, run_id TEXT NOT NULL, "
            "principal_ref TEXT NOT NULL, token_ref TEXT NOT NULL, alias TEXT, "
            "model TEXT NOT NULL, provider TEXT NOT NULL, node TEXT NOT NULL, "
            "prompt_tokens BIGINT NOT NULL, completion_tokens BIGINT NOT NULL, "
            "status BIGINT NOT NULL, latency_ms DOUBLE PRECISION NOT NULL, "
            "ttft_ms DOUBLE PRECISION, usage_source TEXT NOT NULL, protocol TEXT NOT NULL)"
        )
        db.execute(
            "CREATE INDEX iop_usage_by_principal ON iop_usage (principal_ref, token_ref, "
            "model, time) INCLUDE (prompt_tokens, completion_tokens, usage_source)"
        )
        db.execute(
            "INSERT INTO iop_usage VALUES (1, 'old', 'p', 't', NULL, 'qwen-alias', 'gpu', "
            "'node-1', 7, 2, 200, 1, NULL, 'provider', 'chat')"
        )
    fake = FakeUpstream(cache=CacheReport(CACHED_TOKENS))
    base_url = await nursery.start(fake.serve)
    text = edge_config(
        tmp_path / "state",
        providers=[upstream_provider("gpu", base_url)],
        models=[{"id": "qwen-alias", "providers": {"gpu": "fake-model"}}],
        edge_section={"ledger": ledger_url, "ledger_password_env": PASSWORD_ENV},
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("qwen-alias",))
    await _chat(stack, "qwen-alias", stream=False)
    await stack.wait_catalog(all_idle)
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    async with stack.admin() as admin:
        report = (await admin.get("/usage", params={"group_by": "provider"})).json()
    [row] = report["rows"]
    assert (row["requests"], row["prompt_tokens"], row["cached_tokens"]) == (
        2,
        7 + PROMPT_TOKENS,
        CACHED_TOKENS,
    )
    with psycopg.connect(ledger_url, password=os.environ[PASSWORD_ENV]) as db:
        cached = dict(db.execute("SELECT run_id, cached_tokens FROM iop_usage").fetchall())
        indexes = {
            name
            for (name,) in db.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = 'iop_usage'"
            ).fetchall()
        }
    assert cached["old"] == 0 and sorted(cached.values()) == [0, CACHED_TOKENS]
    assert "iop_usage_by_principal_tokens" in indexes and "iop_usage_by_principal" not in indexes
