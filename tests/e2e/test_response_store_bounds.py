"""The Responses store's bounds and failures as a caller sees them, through a real Edge +
Node with the `openai` SDK: a principal at its byte share, or a store whose database
fails, is answered with `store: false` (body, final stream event,
`x-iop-response-stored`), counted in `iop_responses_unstored_total`, while other
principals store as before, and PostgreSQL down is answered the same way; a
conversation past its byte bound is a 400; an upstream
that reuses Responses ids cannot make stored responses collide."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
import trio

from iop_edge.core.configuration.ledger_url import parse_ledger_url
from iop_edge.runtime.metering.ledger import SQLITE_FILE
from iop_edge.runtime.metering.response_store import ConversationTooLarge, ResponseStore
from iop_edge.runtime.metering.response_store_postgres import PostgresResponses
from schemas.config import ResponsesSection
from tests.adapters.fake_protocols import responses_response
from tests.e2e.postgres import PASSWORD_ENV, Postgres
from tests.e2e.stack import (
    Stack,
    edge_config,
    principals_section,
    sim_provider,
    start_native_upstream,
    start_stack,
)

ALICE = "alice-token-for-tests"
BOB = "bob-token-for-tests"
#: About 10 KB of input: each stored response takes a little more than that.
LONG_INPUT = "lorem ipsum " * 850


def _config(state_dir: Path, **responses: Any) -> str:
    return edge_config(
        state_dir,
        providers=[sim_provider("sim-1", capacity=4)],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
        openai_section=principals_section({"alice": ALICE, "bob": BOB}),
        edge_section={"responses": responses} if responses else None,
    )


async def _stack(nursery: trio.Nursery, tmp_path: Path, **responses: Any) -> Stack:
    text = _config(tmp_path / "state", **responses)
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


async def _ask(stack: Stack, token: str, text: str, **kwargs: Any) -> tuple[Any, str | None]:
    """A non-stream Responses request: the response and its `x-iop-response-stored`."""
    async with stack.client(api_key=token) as client:
        raw = await client.responses.with_raw_response.create(
            model="m", input=text, max_output_tokens=4, **kwargs
        )
    return raw.parse(), raw.headers.get("x-iop-response-stored")


async def _ask_streaming(stack: Stack, token: str, text: str) -> tuple[Any, Any]:
    """A stream: the `response.created` event's response and the final one's."""
    async with stack.client(api_key=token) as client:
        created = completed = None
        stream = await client.responses.create(
            model="m", input=text, max_output_tokens=4, stream=True
        )
        async for event in stream:
            if event.type == "response.created":
                created = event.response
            elif event.type in ("response.completed", "response.incomplete"):
                completed = event.response
    assert created is not None and completed is not None
    return created, completed


async def _unstored(stack: Stack, reason: str) -> float:
    async with stack.admin() as admin:
        text = (await admin.get("/metrics")).text
    line = f'iop_responses_unstored_total{{reason="{reason}"}} '
    [value] = [row[len(line) :] for row in text.splitlines() if row.startswith(line)]
    return float(value)


async def test_a_principal_at_its_share_is_answered_unstored_and_others_store_as_before(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path, max_bytes_per_principal=40_000)
    kept: list[str] = []
    while True:  # alice fills her share
        response, stored = await _ask(stack, ALICE, LONG_INPUT)
        if stored == "false":
            break
        assert stored == "true" and response.store is True
        kept.append(response.id)
        assert len(kept) < 10, "the share was never reached"
    assert len(kept) == 3
    assert response.store is False  # the body says what happened too
    assert response.output_text  # answered: storing is a side effect, never a refusal
    async with stack.client(api_key=ALICE) as client:
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response.id)
        assert (await client.responses.retrieve(kept[0])).id == kept[0]
    created, completed = await _ask_streaming(stack, ALICE, LONG_INPUT)
    assert created.store is True  # said before the store was tried
    assert completed.store is False  # the stream's final word
    # bob's responses are stored as ever, and metered
    answer, stored = await _ask(stack, BOB, LONG_INPUT)
    assert (stored, answer.store) == ("true", True)
    _, bob_streamed = await _ask_streaming(stack, BOB, "hi")
    assert bob_streamed.store is True
    async with stack.client(api_key=BOB) as client:
        assert (await client.responses.retrieve(bob_streamed.id)).id == bob_streamed.id
    assert await _unstored(stack, "principal_full") == 2
    # deleting makes room again
    async with stack.client(api_key=ALICE) as client:
        await client.responses.delete(kept[0])
    _, stored = await _ask(stack, ALICE, LONG_INPUT)
    assert stored == "true"


async def test_a_store_whose_database_fails_says_store_false_and_the_runs_are_metered(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path)
    _, stored = await _ask(stack, ALICE, "hi")
    assert stored == "true"
    path = tmp_path / "state" / SQLITE_FILE
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE responses RENAME TO hidden")
    answer, stored = await _ask(stack, ALICE, "more")
    assert (stored, answer.store) == ("false", False)
    _, completed = await _ask_streaming(stack, ALICE, "more")
    assert completed.store is False
    assert await _unstored(stack, "unavailable") == 2
    with trio.fail_after(10):
        await stack.edge.ledger.wait_flushed()
    with sqlite3.connect(path) as db:
        [(metered,)] = db.execute("SELECT COUNT(*) FROM usage WHERE status = 200")
    assert metered == 3


async def test_a_conversation_past_its_byte_bound_is_a_clear_400(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path, max_conversation_bytes=30_000)
    previous = None
    for _ in range(3):
        response, _ = await _ask(stack, ALICE, LONG_INPUT, previous_response_id=previous)
        previous = response.id
    async with stack.client(api_key=ALICE) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model="m", input="and?", max_output_tokens=4, previous_response_id=previous
            )
    assert refused.value.code == "conversation_too_large"
    assert "edge.responses.max_conversation_bytes" in refused.value.message
    # Every other way of loading the conversation says the same.
    async with stack.client(api_key=ALICE) as client:
        with pytest.raises(openai.BadRequestError) as counted:
            await client.responses.input_tokens.count(
                model="m", input="and?", previous_response_id=previous
            )
        with pytest.raises(openai.BadRequestError) as listed:
            await client.responses.input_items.list(previous)
    assert counted.value.code == listed.value.code == "conversation_too_large"
    assert counted.value.param == "previous_response_id"


async def test_an_upstream_that_reuses_ids_cannot_make_stored_responses_collide(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fake, native = await start_native_upstream(nursery, "responses")
    text = edge_config(
        tmp_path / "state",
        providers=[native],
        models=[{"id": "m", "providers": {"native": "fake-model"}}],
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    async with stack.client() as client:
        first = await client.responses.create(model="m", input="one")
        second = await client.responses.create(
            model="m", input="two", previous_response_id=first.id
        )
        third = await client.responses.create(
            model="m", input="three", previous_response_id=second.id, stream=True
        )
        third_id = ""
        async for event in third:
            if event.type in ("response.completed", "response.incomplete"):
                third_id = event.response.id
        # the fake upstream answers every request with one id
        upstream_id = msgspec.json.decode(responses_response("fake-model", 1))["id"]
        ids = [first.id, second.id, third_id]
        assert len(set(ids)) == 3 and upstream_id not in ids
        for response_id in ids:
            assert (await client.responses.retrieve(response_id)).id == response_id
        await client.responses.create(model="m", input="four", previous_response_id=third_id)
    sent = msgspec.json.decode(fake.requests[-1].body)
    said = [item["content"] for item in sent["input"] if item.get("role") == "user"]
    assert said == ["one", "two", "three", "four"]  # every turn, none overwritten


async def test_postgresql_down_is_answered_store_false_and_stored_again_once_back(
    nursery: trio.Nursery, tmp_path: Path, ledger_url: str, postgres_server: Postgres
) -> None:
    text = edge_config(
        tmp_path / "state",
        providers=[sim_provider("sim-1", capacity=4)],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
        openai_section=principals_section({"alice": ALICE}),
        edge_section={"ledger": ledger_url, "ledger_password_env": PASSWORD_ENV},
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    _, stored = await _ask(stack, ALICE, "hi")
    assert stored == "true"
    await trio.to_thread.run_sync(postgres_server.stop)
    try:
        for _ in range(2):
            answer, stored = await _ask(stack, ALICE, "while it is down")
            assert (stored, answer.store) == ("false", False)
            _, completed = await _ask_streaming(stack, ALICE, "while it is down")
            assert completed.store is False
        assert await _unstored(stack, "unavailable") == 4
    finally:
        await trio.to_thread.run_sync(postgres_server.start)
    answer, stored = await _ask(stack, ALICE, "back")
    assert (stored, answer.store) == ("true", True)
    async with stack.client(api_key=ALICE) as client:
        assert (await client.responses.retrieve(answer.id)).id == answer.id


def _final(response_id: str, text: str) -> bytes:
    return msgspec.json.encode(
        {"id": response_id, "object": "response", "output": [{"type": "message", "text": text}]}
    )


async def test_the_postgresql_store_keeps_the_same_bounds(ledger_url: str) -> None:
    """The byte bounds' queries in PostgreSQL: a principal's share counted in the
    database, the least recently used evicted past the total, a conversation's bytes,
    an id never overwritten."""
    now = [1_000.0]
    one = len(_final("r00", "x" * 1_000)) + len(b"[]")
    policy = ResponsesSection(
        max_bytes=6 * one, max_bytes_per_principal=3 * one, max_conversation_bytes=2 * one
    )
    backend = PostgresResponses(parse_ledger_url(ledger_url), PASSWORD_ENV)
    store = ResponseStore(backend, policy, clock=lambda: now[0])
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)

        async def keep(principal: str, number: int, previous: str | None = None) -> str | None:
            now[0] += 1
            return await store.keep(
                principal, _final(f"r{number:02d}", "x" * 1_000), [], previous_id=previous
            )

        for number in range(3):
            assert await keep("a", number, f"r{number - 1:02d}" if number else None) is None
        assert await keep("a", 3) == "principal_full"
        assert await store.delete("a", "r02")
        assert await keep("a", 3, "r01") is None  # counted again in the database: room
        assert await keep("b0", 3) == "id_conflict"  # a's id: never overwritten
        assert len(await store.conversation("a", "r01")) == 2
        with pytest.raises(ConversationTooLarge):
            await store.conversation("a", "r03")  # three turns: past two turns' bytes
        for number in range(4, 10):  # b's puts pass the total: the oldest go first
            assert await keep(f"b{number % 2}", number) is None
        assert await store.read("a", "r00") is None
        assert await store.read("b1", "r09") is not None
        assert store.statistics().bytes <= 6 * one
        nursery.cancel_scope.cancel()
