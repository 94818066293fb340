"""Continuing a stored Responses conversation (iop_edge.core.responses.response_chain): the order of
turns, broken chains, and the body sent on in place of `previous_response_id`."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from iop_edge.core.responses.response_chain import (
    MAX_CHAIN,
    ChainBroken,
    StoredTurn,
    continue_body,
    conversation,
    order_chain,
    read_final_response,
    read_response_id,
)


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def _answer(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }


def _turn(response_id: str, previous: str | None, asked: str, said: str) -> StoredTurn:
    return StoredTurn(
        id=response_id,
        previous_id=previous,
        input_items=[msgspec.Raw(msgspec.json.encode(_user(asked)))],
        output_items=[msgspec.Raw(msgspec.json.encode(_answer(said)))],
    )


def test_a_chain_is_ordered_oldest_first_and_spelled_out_in_turn_order() -> None:
    turns = {
        "r1": _turn("r1", None, "hi", "hello"),
        "r2": _turn("r2", "r1", "and?", "more"),
        "r3": _turn("r3", "r2", "last", "done"),
        "other": _turn("other", None, "unrelated", "x"),
    }
    chain = order_chain("r3", turns)
    assert [turn.id for turn in chain] == ["r1", "r2", "r3"]
    items = conversation(chain, [_user("now")])
    # the stored items go on as the JSON they were stored as, the new ones as they came
    assert all(isinstance(item, msgspec.Raw) for item in items[:-1])
    assert msgspec.json.decode(msgspec.json.encode(items)) == [
        _user("hi"),
        _answer("hello"),
        _user("and?"),
        _answer("more"),
        _user("last"),
        _answer("done"),
        _user("now"),
    ]


def test_an_unknown_tip_and_a_missing_link_are_both_broken_chains() -> None:
    with pytest.raises(ChainBroken, match="Previous response with id 'nope' not found"):
        order_chain("nope", {})
    turns = {"r2": _turn("r2", "r1", "q", "a")}
    with pytest.raises(ChainBroken, match="continues response 'r1', which is no longer stored"):
        order_chain("r2", turns)


def test_a_chain_that_comes_back_to_itself_is_refused() -> None:
    turns = {"r1": _turn("r1", "r2", "q", "a"), "r2": _turn("r2", "r1", "q", "a")}
    with pytest.raises(ChainBroken, match="continues itself"):
        order_chain("r2", turns)


def test_an_overlong_chain_is_refused() -> None:
    turns = {
        f"r{i}": _turn(f"r{i}", f"r{i - 1}" if i else None, "q", "a") for i in range(MAX_CHAIN + 1)
    }
    with pytest.raises(ChainBroken, match=f"more than {MAX_CHAIN}"):
        order_chain(f"r{MAX_CHAIN}", turns)
    assert len(order_chain(f"r{MAX_CHAIN - 1}", turns)) == MAX_CHAIN


def test_the_body_sent_on_carries_the_conversation_and_no_state() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "input": "now",
        "previous_response_id": "r1",
        "instructions": "be brief",
        "store": True,
    }
    continue_body(body, [_user("hi"), _answer("hello"), _user("now")])
    assert body == {
        "model": "m",
        "input": [_user("hi"), _answer("hello"), _user("now")],
        "instructions": "be brief",  # the request's own instructions, never the old ones
        "store": False,
    }


def test_a_final_response_is_read_for_its_id_and_output() -> None:
    data = msgspec.json.encode(
        {"id": "resp_1", "object": "response", "status": "completed", "output": [_answer("x")]}
    )
    response_id, output = read_final_response(data)
    assert response_id == "resp_1"
    assert [msgspec.json.decode(item) for item in output] == [_answer("x")]
    assert read_response_id(data) == "resp_1"
    for bad in (b"[]", b'{"output": []}', b'{"id": 3}', b"not json"):
        with pytest.raises(ValueError, match=r"not a Responses object|no `id`"):
            read_final_response(bad)
        with pytest.raises(ValueError, match=r"not a Responses object|no `id`"):
            read_response_id(bad)
