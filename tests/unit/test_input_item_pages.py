"""A stored response's input items as OpenAI lists them (`core.responses.input_item_pages`)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from iop_edge.core.responses.input_item_pages import PageRequestInvalid, item_page
from iop_edge.core.responses.response_chain import StoredTurn


def _raw(item: dict[str, Any]) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(item))


FIRST = StoredTurn(
    id="resp_first",
    previous_id=None,
    input_items=[msgspec.Raw(b'{"role": "user", "content": "hi"}')],
    output_items=[
        _raw(
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_first_0",
                "content": [{"type": "output_text", "text": "yo"}],
            }
        )
    ],
)
SECOND = StoredTurn(
    id="resp_abc",
    previous_id="resp_first",
    input_items=[_raw({"type": "function_call_output", "call_id": "c1", "output": "42"})],
    output_items=[_raw({"type": "message", "role": "assistant", "id": "msg_abc_0"})],
)
CHAIN = [FIRST, SECOND]


def _page(**query: str) -> Any:
    return json.loads(item_page(CHAIN, query))


def test_every_item_has_an_id_that_is_the_same_on_every_read_and_messages_are_listed_whole() -> (
    None
):
    page = _page(order="asc")
    assert [item["id"] for item in page["data"]] == [
        "msg_in_first_0",
        "msg_first_0",
        "fco_in_abc_0",
    ]
    assert page["data"][0] == {
        "id": "msg_in_first_0",
        "role": "user",
        "content": [{"type": "input_text", "text": "hi"}],
        "type": "message",
    }
    assert _page(order="asc") == page
    assert (page["first_id"], page["last_id"], page["has_more"]) == (
        "msg_in_first_0",
        "fco_in_abc_0",
        False,
    )


def test_an_item_keeps_its_id_in_every_later_responses_list_and_names_no_other() -> None:
    """The first turn's input is the same item, by the same id, listed under either
    response; no generated id is the id of an output item of the chain."""
    alone = json.loads(item_page([FIRST], {"order": "asc"}))
    assert [item["id"] for item in alone["data"]] == ["msg_in_first_0"]
    later = [item["id"] for item in _page(order="asc")["data"]]
    assert later[0] == "msg_in_first_0"
    outputs = {"msg_first_0", "msg_abc_0"}
    assert not outputs & ({*later} - {"msg_first_0"})


def test_newest_first_by_default_and_a_page_starts_after_the_id_given() -> None:
    first = _page(limit="2")
    assert [item["id"] for item in first["data"]] == ["fco_in_abc_0", "msg_first_0"]
    assert first["has_more"] is True
    rest = _page(limit="2", after="msg_first_0")
    assert [item["id"] for item in rest["data"]] == ["msg_in_first_0"]
    assert rest["has_more"] is False


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"order": "up"}, "order"),
        ({"limit": "0"}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"after": "msg_nope"}, "after"),
    ],
)
def test_a_query_the_list_cannot_take_names_its_parameter(
    query: dict[str, str], param: str
) -> None:
    with pytest.raises(PageRequestInvalid) as refused:
        item_page(CHAIN, query)
    assert refused.value.param == param
