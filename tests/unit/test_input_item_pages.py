"""A stored response's input items as OpenAI lists them (`core.responses.input_item_pages`)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from iop_edge.core.responses.input_item_pages import PageRequestInvalid, item_page

ITEMS = [
    msgspec.Raw(b'{"role": "user", "content": "hi"}'),
    {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "content": [{"type": "output_text", "text": "yo"}],
    },
    {"type": "function_call_output", "call_id": "c1", "output": "42"},
]


def _page(**query: str) -> Any:
    return json.loads(item_page(ITEMS, "resp_abc", query))


def test_every_item_has_an_id_that_is_the_same_on_every_read_and_messages_are_listed_whole() -> (
    None
):
    page = _page(order="asc")
    assert [item["id"] for item in page["data"]] == ["msg_abc_0", "msg_1", "fco_abc_2"]
    assert page["data"][0] == {
        "id": "msg_abc_0",
        "role": "user",
        "content": [{"type": "input_text", "text": "hi"}],
        "type": "message",
    }
    assert _page(order="asc") == page
    assert (page["first_id"], page["last_id"], page["has_more"]) == (
        "msg_abc_0",
        "fco_abc_2",
        False,
    )


def test_newest_first_by_default_and_a_page_starts_after_the_id_given() -> None:
    first = _page(limit="2")
    assert [item["id"] for item in first["data"]] == ["fco_abc_2", "msg_1"]
    assert first["has_more"] is True
    rest = _page(limit="2", after="msg_1")
    assert [item["id"] for item in rest["data"]] == ["msg_abc_0"] and rest["has_more"] is False


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
        item_page(ITEMS, "resp_abc", query)
    assert refused.value.param == param
