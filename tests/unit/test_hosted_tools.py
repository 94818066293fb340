"""Which tools are hosted (only a vendor's service runs them), and a body without them."""

from __future__ import annotations

import json
from typing import Any

from schemas.hosted_tools import hosted_tool_types, may_offer_hosted_tools, without_hosted_tools

SHELL = {"type": "function", "name": "shell", "parameters": {"type": "object"}}
CODEX: dict[str, Any] = {
    "model": "m",
    "tools": [SHELL, {"type": "web_search", "external_web_access": False}, {"type": "local_shell"}],
    "tool_choice": "auto",
}
CLAUDE: dict[str, Any] = {
    "model": "m",
    "tools": [
        {"name": "Bash", "input_schema": {"type": "object"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        {"type": "computer_20250124", "name": "computer", "display_width_px": 1024},
        {"type": "bash_20250124", "name": "bash"},
    ],
    "tool_choice": {"type": "tool", "name": "web_search"},
}


def test_service_tools_are_hosted_and_client_tools_are_not() -> None:
    assert hosted_tool_types("responses", CODEX) == ["web_search"]
    assert hosted_tool_types("messages", CLAUDE) == ["web_search_20250305", "computer_20250124"]
    assert hosted_tool_types("chat", CODEX) == []  # chat has no hosted tools to leave out
    assert hosted_tool_types("responses", {"tools": "nonsense"}) == []


def test_a_body_without_them_keeps_everything_else() -> None:
    left = without_hosted_tools("responses", CODEX)
    assert left == {"model": "m", "tools": [SHELL, {"type": "local_shell"}], "tool_choice": "auto"}
    assert CODEX["tools"][1]["type"] == "web_search"  # the caller's body is not changed

    left = without_hosted_tools("messages", CLAUDE)
    assert [tool["name"] for tool in left["tools"]] == ["Bash", "bash"]
    assert "tool_choice" not in left  # it named a tool left out: the runtime chooses


def test_a_choice_among_allowed_tools_loses_the_hosted_ones() -> None:
    body = {
        "tools": [SHELL, {"type": "file_search"}],
        "tool_choice": {
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "shell"}, {"type": "file_search"}],
        },
    }
    left = without_hosted_tools("responses", body)
    assert left["tool_choice"]["tools"] == [{"type": "function", "name": "shell"}]
    only_hosted = {"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}
    assert without_hosted_tools("responses", only_hosted) == {}


def test_a_body_with_none_is_returned_as_it_is() -> None:
    body = {"model": "m", "tools": [SHELL]}
    assert without_hosted_tools("responses", body) is body
    assert not may_offer_hosted_tools(json.dumps(body).encode())
    assert may_offer_hosted_tools(json.dumps(CODEX).encode())
