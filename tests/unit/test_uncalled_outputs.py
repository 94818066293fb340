"""`core.responses.uncalled_outputs`: a tool output without a `call_id` (Codex's thread
goal) becomes a user message after the run of outputs it sits in; a conversation without
one is passed on as the very same list."""

from __future__ import annotations

from typing import Any

import msgspec

from iop_edge.core.responses.uncalled_outputs import rewrite


def _call(call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "exec_command", "arguments": "{}"}


def _output(call_id: str, output: Any = "ok") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


#: What Codex 0.171 sends after its `create_goal` tool ran (its rollout's item, trimmed).
GOAL: dict[str, Any] = {
    "type": "function_call_output",
    "id": "fco_1",
    "name": "goal_objective",
    "namespace": "agent",
    "output": "count to three",
}
USER = {"type": "message", "role": "user", "content": "go"}


def _text_message(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def test_a_conversation_without_one_is_the_same_list() -> None:
    items: list[Any] = [USER, _call("c1"), _output("c1"), msgspec.Raw(b'{"type":"message"}')]
    assert rewrite(items) is items


def test_codex_goal_becomes_a_labelled_user_message_after_the_outputs() -> None:
    items: list[Any] = [USER, _call("c1"), _output("c1"), GOAL]
    assert rewrite(items) == [
        USER,
        _call("c1"),
        _output("c1"),
        _text_message("agent.goal_objective:\ncount to three"),
    ]


def test_one_between_parallel_outputs_goes_after_them_in_order() -> None:
    second = {**GOAL, "name": "goal_budget", "namespace": None, "call_id": ""}
    items: list[Any] = [
        _call("c1"),
        _call("c2"),
        _output("c1"),
        GOAL,
        _output("c2"),
        second,
        {"type": "message", "role": "assistant", "content": "done"},
    ]
    assert rewrite(items) == [
        _call("c1"),
        _call("c2"),
        _output("c1"),
        _output("c2"),
        _text_message("agent.goal_objective:\ncount to three"),
        _text_message("goal_budget:\ncount to three"),
        {"type": "message", "role": "assistant", "content": "done"},
    ]


def test_stored_items_are_read_and_parts_kept() -> None:
    parts = [
        {"type": "input_text", "text": "see"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
    ]
    stored = msgspec.Raw(
        msgspec.json.encode({"type": "custom_tool_call_output", "call_id": None, "output": parts})
    )
    called = msgspec.Raw(msgspec.json.encode(_output("c1", "has _call_output in its text")))
    assert rewrite([called, stored]) == [
        called,
        {"type": "message", "role": "user", "content": parts},
    ]


def test_a_named_one_with_parts_leads_with_its_label() -> None:
    item = {**GOAL, "output": [{"type": "input_text", "text": "count"}]}
    assert rewrite([item]) == [
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "agent.goal_objective:"},
                {"type": "input_text", "text": "count"},
            ],
        }
    ]


def test_an_unreadable_stored_item_is_left_for_the_translator_to_name() -> None:
    broken = msgspec.Raw(b'{"type": "function_call_output", "output": ')
    items: list[Any] = [broken]
    assert rewrite(items) is items
