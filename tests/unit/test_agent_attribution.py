"""Claude Code's attribution block, removed from a Messages body before the run so a
runtime's prompt cache can hit (`generation.strip_agent_attribution`): exactly that
block, never anything else."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from iop_edge.http.protocols.messages import strip_attribution

FIXTURES = Path(__file__).parents[1] / "protocols" / "fixtures"
AGENT = {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}


def _body(*system: Any) -> dict[str, Any]:
    return {"model": "m", "system": list(system), "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("name", ["claude_code_first_turn", "claude_code_tool_result"])
def test_the_block_claude_code_sends_is_removed(name: str) -> None:
    body = json.loads((FIXTURES / f"{name}.json").read_text())
    before = copy.deepcopy(body)
    assert strip_attribution(body)
    assert body["system"] == before["system"][1:]
    assert {key: value for key, value in body.items() if key != "system"} == {
        key: value for key, value in before.items() if key != "system"
    }


@pytest.mark.parametrize(
    "text",
    [
        "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=sdk-cli; cch=36ee5;",
        "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch=fa690;",
        "x-anthropic-billing-header: cc_version=2.1.197.0df; cc_entrypoint=sdk-cli;",
    ],
)
def test_every_version_of_the_shape_is_removed(text: str) -> None:
    body = _body({"type": "text", "text": text}, AGENT)
    assert strip_attribution(body)
    assert body["system"] == [AGENT]


def test_a_system_of_the_block_alone_is_removed_whole() -> None:
    body = _body({"type": "text", "text": "x-anthropic-billing-header: cch=00000;"})
    assert strip_attribution(body)
    assert "system" not in body


@pytest.mark.parametrize(
    "first",
    [
        # more text than the header: the caller's content
        {"type": "text", "text": "x-anthropic-billing-header: cch=1;\nYou are terse."},
        {"type": "text", "text": "x-anthropic-billing-header: cch=1; and more"},
        {"type": "text", "text": "x-anthropic-billing-header:"},
        {"type": "text", "text": "x-anthropic-billing-header: cc version=1;"},
        {"type": "text", "text": " x-anthropic-billing-header: cch=1;"},
        {"type": "text", "text": "X-Anthropic-Billing-Header: cch=1;"},
        # another key on the block
        {"type": "text", "text": "x-anthropic-billing-header: cch=1;", "cache_control": {}},
        {"type": "image", "text": "x-anthropic-billing-header: cch=1;"},
        {"type": "text", "text": ["x-anthropic-billing-header: cch=1;"]},
        "x-anthropic-billing-header: cch=1;",
    ],
)
def test_anything_else_stays(first: Any) -> None:
    body = _body(first, AGENT)
    before = copy.deepcopy(body)
    assert not strip_attribution(body)
    assert body == before


def test_only_the_first_block_and_only_a_list_system_is_looked_at() -> None:
    header = {"type": "text", "text": "x-anthropic-billing-header: cch=1;"}
    second = _body(AGENT, header)
    assert not strip_attribution(second) and second["system"] == [AGENT, header]
    text = {"model": "m", "system": header["text"], "messages": []}
    assert not strip_attribution(text) and text["system"] == header["text"]
    in_a_message = {"model": "m", "messages": [{"role": "user", "content": [header]}]}
    assert not strip_attribution(in_a_message)
    assert not strip_attribution({"model": "m", "system": [], "messages": []})
