"""Stored OpenAI Responses (design §14) through a real Edge + Node, with the `openai` SDK:
`store` and `previous_response_id` across an Edge restart and across replicas sharing a
PostgreSQL ledger, `GET` and `DELETE /v1/responses/{id}`, principals kept apart,
`store: false` keeping nothing, and the body a native runtime gets for a continuation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
import trio

from tests.e2e.postgres import PASSWORD_ENV
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


def _config(state_dir: Path, **edge_section: Any) -> str:
    return edge_config(
        state_dir,
        providers=[sim_provider("sim-1", capacity=4)],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
        openai_section=principals_section({"alice": ALICE, "bob": BOB}),
        edge_section=edge_section or None,
    )


async def _ask(stack: Stack, text: str, **kwargs: Any) -> Any:
    kwargs.setdefault("max_output_tokens", 4)
    async with stack.client(api_key=kwargs.pop("token", ALICE)) as client:
        return await client.responses.create(model="m", input=text, **kwargs)


async def test_a_conversation_goes_on_after_an_edge_restart(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    text = _config(tmp_path / "state")
    async with trio.open_nursery() as first_life:
        first = await start_stack(first_life, text, tmp_path / "edge.yaml", wait_models=("m",))
        one = await _ask(first, "The secret word is pineapple.")
        two = await _ask(first, "Remember it.", previous_response_id=one.id)
        first.edge.stop()
        first.kill_node()
    # a new Edge process on the same state_dir
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    alone = await _ask(stack, "What was the word?", store=False)
    three = await _ask(stack, "What was the word?", previous_response_id=two.id)
    # the runtime read the whole conversation: two earlier turns in and out, then this one
    assert three.usage.input_tokens > alone.usage.input_tokens + 2 * 4
    async with stack.client(api_key=ALICE) as client:
        again = await client.responses.retrieve(two.id)
        assert again.id == two.id and again.output_text == two.output_text
        streamed = await client.responses.create(
            model="m",
            input="And now?",
            previous_response_id=three.id,
            max_output_tokens=4,
            stream=True,
        )
        events = [event async for event in streamed]
        final = events[-1].response  # type: ignore[union-attr]
        stored = await client.responses.retrieve(final.id)  # stored before the stream ended
    assert stored.id == final.id and stored.output_text == final.output_text


async def test_another_principals_responses_do_not_exist_for_it(stack_store: Stack) -> None:
    mine = await _ask(stack_store, "hi")
    async with stack_store.client(api_key=BOB) as bob:
        with pytest.raises(openai.NotFoundError) as read:
            await bob.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError) as continued:
            await bob.responses.create(model="m", input="x", previous_response_id=mine.id)
        with pytest.raises(openai.NotFoundError):
            await bob.responses.delete(mine.id)
    assert isinstance(read.value.body, dict) and read.value.body["code"] == "response_not_found"
    assert continued.value.body == {
        "message": f"Previous response with id '{mine.id}' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
    async with stack_store.client(api_key=ALICE) as alice:
        assert (await alice.responses.retrieve(mine.id)).id == mine.id


async def test_delete_removes_it_and_store_false_keeps_nothing(stack_store: Stack) -> None:
    kept = await _ask(stack_store, "hi")
    unkept = await _ask(stack_store, "hi", store=False)
    async with stack_store.http() as http:
        deleted = await http.delete(
            f"/v1/responses/{kept.id}", headers={"authorization": f"Bearer {ALICE}"}
        )
    assert deleted.status_code == 200
    assert deleted.json() == {"id": kept.id, "object": "response", "deleted": True}
    async with stack_store.client(api_key=ALICE) as client:
        for gone in (kept.id, unkept.id):
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="m", input="x", previous_response_id=kept.id)


async def test_a_stored_responses_input_items_are_listed_a_page_at_a_time(
    stack_store: Stack,
) -> None:
    """The official SDK's `responses.input_items.list`: what the model read for that
    response (the earlier turn in and out, then its own input), newest first by default,
    each with an id a next page starts after; another principal's are not there."""
    one = await _ask(stack_store, "The secret word is pineapple.")
    two = await _ask(stack_store, "Remember it.", previous_response_id=one.id)
    async with stack_store.client(api_key=ALICE) as client:
        newest = await client.responses.input_items.list(two.id)
        assert [item.type for item in newest.data] == ["message", "message", "message"]
        said = [item.content[0].text for item in newest.data]  # type: ignore[union-attr]
        assert said[0] == "Remember it." and said[2] == "The secret word is pineapple."
        assert said[1] == one.output_text
        first = await client.responses.input_items.list(two.id, order="asc", limit=2)
        assert [item.id for item in first.data] == [item.id for item in newest.data][::-1][:2]
        assert first.has_more
        rest = await client.responses.input_items.list(
            two.id, order="asc", limit=2, after=first.data[-1].id
        )
        assert [item.id for item in rest.data] == [newest.data[0].id] and not rest.has_more
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.input_items.list(two.id, limit=1000)
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "limit"
    async with stack_store.client(api_key=BOB) as bob:
        with pytest.raises(openai.NotFoundError):
            await bob.responses.input_items.list(two.id)


async def test_input_items_keep_their_ids_and_say_which_earlier_response_is_gone(
    stack_store: Stack,
) -> None:
    """An item the caller sent without an id is listed under one id in every later
    response's list, never another item's; once an earlier response of the chain is
    deleted, the list says so rather than that the response itself is missing."""
    one = await _ask(stack_store, "The secret word is pineapple.")
    two = await _ask(stack_store, "Remember it.", previous_response_id=one.id)
    async with stack_store.client(api_key=ALICE) as client:
        [first_input] = (await client.responses.input_items.list(one.id)).data
        listed = (await client.responses.input_items.list(two.id, order="asc")).data
        assert listed[0].id == first_input.id  # the same item, by the same id
        outputs = {item.id for item in one.output} | {item.id for item in two.output}
        generated = [listed[0].id, listed[2].id]
        assert not outputs & set(generated)
        assert len({item.id for item in listed}) == len(listed)
        await client.responses.delete(one.id)
        assert (await client.responses.retrieve(two.id)).id == two.id
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.input_items.list(two.id)
    assert gone.value.code == "previous_response_not_found"
    assert f"continues response '{one.id}', which is no longer stored" in gone.value.message


@pytest.fixture
async def stack_store(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    return await start_stack(
        nursery, _config(tmp_path / "state"), tmp_path / "edge.yaml", wait_models=("m",)
    )


async def test_a_native_runtime_is_sent_the_conversation_without_state(
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
        first = await client.responses.create(model="m", input="hi", instructions="Be brief.")
        await client.responses.create(model="m", input="more", previous_response_id=first.id)
    bodies = [msgspec.json.decode(r.body) for r in fake.requests if r.path == "/v1/responses"]
    assert [body.get("store") for body in bodies] == [False, False]
    sent = bodies[1]
    assert "previous_response_id" not in sent and "instructions" not in sent
    assert sent["input"][0] == {"type": "message", "role": "user", "content": "hi"}
    assert sent["input"][1]["type"] == "message" and sent["input"][1]["role"] == "assistant"
    assert sent["input"][1]["content"][0]["text"] == first.output_text
    assert sent["input"][-1] == {"type": "message", "role": "user", "content": "more"}
    assert len(sent["input"]) == 3


async def test_replicas_sharing_a_postgresql_ledger_share_conversations(
    nursery: trio.Nursery, tmp_path: Path, ledger_url: str
) -> None:
    shared = {"ledger": ledger_url, "ledger_password_env": PASSWORD_ENV}
    one = await start_stack(
        nursery,
        _config(tmp_path / "one", **shared),
        tmp_path / "one.yaml",
        wait_models=("m",),
    )
    two = await start_stack(
        nursery,
        _config(tmp_path / "two", **shared),
        tmp_path / "two.yaml",
        wait_models=("m",),
    )
    first = await _ask(one, "The secret word is pineapple.")
    second = await _ask(two, "Remember it.", previous_response_id=first.id)
    async with two.client(api_key=ALICE) as client:
        assert (await client.responses.retrieve(first.id)).id == first.id
    async with one.client(api_key=BOB) as client:
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(second.id)
    async with one.client(api_key=ALICE) as client:
        await client.responses.delete(second.id)
    async with two.client(api_key=ALICE) as client:
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(second.id)
