"""`core.responses.compaction`: IOP's compaction items seal a summary and read back; in an input
they become the summary as a user message, the items they replace dropped."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from iop_edge.core.responses.compaction import (
    SUMMARY_INSTRUCTION,
    SUMMARY_PREFIX,
    CompactionUnreadable,
    compacted_output,
    compaction_item,
    ends_with_trigger,
    expand,
    seal,
    summary_request,
    summary_text,
    unseal,
)


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def _parts(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _assistant(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }


def _call() -> dict[str, Any]:
    return {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"}


def test_a_summary_is_sealed_versioned_and_reads_back() -> None:
    summary = "We fixed `main.py`; next: run the tests. Ünïcode kept."
    content = seal(summary)
    assert content.startswith("iopc1.") and summary not in content
    assert unseal(content) == summary
    assert unseal("gAAAAABo-openai-sealed") is None  # another service's: not IOP's to read


@pytest.mark.parametrize(
    ("mangle", "why"),
    [
        (lambda c: c[:-3], "digest"),
        (lambda c: c.replace("iopc1.YS", "iopc1.Yi", 1), "digest"),
        (lambda c: c + ".x", "3"),
        (lambda c: "iopc1.%%%.%%%", "base64url"),
    ],
)
def test_a_damaged_iop_compaction_is_refused_saying_why(mangle: Any, why: str) -> None:
    with pytest.raises(CompactionUnreadable, match=why):
        unseal(mangle(seal("a summary")))


def test_an_input_without_compaction_is_the_same_list() -> None:
    items: list[Any] = [_user("hi"), _assistant("hello"), msgspec.Raw(b'{"type":"message"}')]
    assert expand(items) is items


def test_the_last_compaction_replaces_all_but_the_user_messages_before_it() -> None:
    old = compaction_item("cmp_1", "first summary")
    new = compaction_item("cmp_2", "second summary")
    items: list[Any] = [
        _user("one"),
        _assistant("a"),
        msgspec.Raw(msgspec.json.encode(old)),  # stored items are JSON
        _call(),
        _user("two"),
        new,
        _assistant("after"),
        _user("three"),
    ]
    expanded = expand(items)
    assert expanded == [
        _user("one"),
        _user("two"),
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": f"{SUMMARY_PREFIX}\n\nsecond summary"}],
        },
        _assistant("after"),
        _user("three"),
    ]


def test_another_services_compaction_is_left_alone_and_a_damaged_one_named() -> None:
    foreign = {"type": "compaction", "id": "cmp_x", "encrypted_content": "gAAAA-sealed"}
    assert expand([_user("a"), foreign]) == [_user("a"), foreign]
    broken = compaction_item("cmp_3", "s")
    broken["encrypted_content"] = broken["encrypted_content"][:-2]
    with pytest.raises(CompactionUnreadable, match="does not match its digest") as raised:
        expand([_user("a"), broken])
    assert raised.value.index == 1


def test_a_trigger_counts_last_only_and_is_dropped_from_a_conversation() -> None:
    trigger = {"type": "compaction_trigger"}
    assert ends_with_trigger([_user("a"), trigger])
    assert not ends_with_trigger([trigger, _user("a")]) and not ends_with_trigger([])
    stored = msgspec.Raw(b'{"type":"compaction_trigger","id":"ct_1"}')
    assert expand([_user("a"), stored, _user("b")]) == [_user("a"), _user("b")]


def test_the_summary_turn_and_the_compacted_output() -> None:
    earlier = compaction_item("cmp_1", "old")
    conversation = expand([_user("one"), earlier, _assistant("a"), _call(), _user("two")])
    turn = summary_request(conversation)
    assert turn[:-1] == conversation
    assert turn[-1]["role"] == "user" and turn[-1]["content"][0]["text"] == SUMMARY_INSTRUCTION
    item = compaction_item("cmp_2", "new")
    # the user's own messages stay, the old summary does not: the new one covers it
    one, two, last = compacted_output(conversation, item, "msg_r")
    assert last == item
    assert one == {"id": "msg_r_0", "status": "completed", **_parts("one")}
    assert two == {"id": "msg_r_1", "status": "completed", **_parts("two")}
    assert item["type"] == "compaction" and unseal(item["encrypted_content"]) == "new"


def test_the_summary_is_the_text_of_the_output_messages() -> None:
    response = {
        "id": "resp_1",
        "output": [
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
            {"type": "message", "content": [{"type": "output_text", "text": " The summary. "}]},
        ],
    }
    assert summary_text(msgspec.json.encode(response)) == "The summary."
    assert summary_text(b'{"id":"r","output":[]}') == ""
    assert summary_text(b"not json") == ""
