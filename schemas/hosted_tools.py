"""Hosted tools: tools a vendor's service runs, which no runtime behind IOP can run.

Codex offers OpenAI's `web_search` unless told not to, and a Messages request may offer
Anthropic's server tools (`web_search_20250305`, ...). A runtime that speaks the
caller's protocol natively gets them as they are (it says itself what it can run). A
run the Node translates to chat completions cannot carry them: chat has no such tools,
and a model offered one by name would call a tool nobody runs.

Rules:

1. Hosted, in a Responses request: `tools[].type` of a tool OpenAI's service runs
   (`web_search*`, `file_search`, `code_interpreter`, `image_generation`, `mcp`,
   `tool_search`) or of computer use (`computer`, `computer_use_preview`). In a
   Messages request: Anthropic's server tools (`web_search_*`, `web_fetch_*`,
   `code_execution_*`, `tool_search_tool_*`, `mcp_toolset`) and computer use
   (`computer_*`). Tools the caller's own client runs (Codex's `local_shell`, `shell`,
   `apply_patch`; Anthropic's `bash_*`, `text_editor_*`) are not hosted: leaving them
   out would take away what the agent relies on, so a translated run still refuses them.
2. A translated run leaves hosted tools out (the model's `generation.hosted_tools:
   drop`, the default): the rest of the request runs, the response carries the header
   `iop-dropped-tools` naming the types left out, and the Node logs it. With
   `hosted_tools: refuse` the run is refused with a 400 naming the tool, as a runtime
   would.
3. A `tool_choice` that names a tool left out is left out too (the runtime chooses).

Pure: the Edge (the header) and the Node (the run) read the same lists.
"""

from __future__ import annotations

import re
from typing import Any, Final, Literal

__all__ = [
    "DROPPED_TOOLS_HEADER",
    "RESPONSES_SERVICE_TOOLS",
    "HostedTools",
    "hosted_tool_types",
    "may_offer_hosted_tools",
    "without_hosted_tools",
]

#: What a model does with hosted tools in a translated run (`generation.hosted_tools`).
HostedTools = Literal["drop", "refuse"]
#: The response header naming the hosted tool types a translated run left out.
DROPPED_TOOLS_HEADER: Final = "iop-dropped-tools"

#: The Responses tool types OpenAI's service runs (Rule 1).
RESPONSES_SERVICE_TOOLS: Final = (
    "web_search",
    "web_search_preview",
    "web_search_2025_08_26",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "image_generation",
    "mcp",
    "tool_search",
)
_RESPONSES_HOSTED: Final = frozenset({*RESPONSES_SERVICE_TOOLS, "computer", "computer_use_preview"})
_MESSAGES_HOSTED_PREFIXES: Final = (
    "web_search_",
    "web_fetch_",
    "code_execution_",
    "tool_search_tool_",
    "mcp_toolset",
    "computer_",
)


#: Every hosted type's name begins with one of these (a quick look before a body is read).
_ANY_HOSTED: Final = re.compile(
    rb'"(?:web_search|web_fetch_|file_search|code_interpreter|code_execution_|image_generation'
    rb"|mcp|tool_search|computer)"
)


def may_offer_hosted_tools(body: bytes) -> bool:
    """False when the raw request `body` cannot offer a hosted tool (none of their names
    is in it), so most requests are not read a second time to find out."""
    return _ANY_HOSTED.search(body) is not None


def _hosted_type(protocol: str, tool: object) -> str | None:
    if not isinstance(tool, dict):
        return None
    kind = tool.get("type")
    if not isinstance(kind, str):
        return None
    if protocol == "responses":
        return kind if kind in _RESPONSES_HOSTED else None
    if protocol == "messages":
        return kind if kind.startswith(_MESSAGES_HOSTED_PREFIXES) else None
    return None


def hosted_tool_types(protocol: str, body: dict[str, Any]) -> list[str]:
    """The hosted tool types `body` offers (Rule 1), each once, in order."""
    tools = body.get("tools")
    found: list[str] = []
    for tool in tools if isinstance(tools, list) else ():
        kind = _hosted_type(protocol, tool)
        if kind is not None and kind not in found:
            found.append(kind)
    return found


def without_hosted_tools(protocol: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body` without its hosted tools, and without a `tool_choice` naming one (Rules 2,
    3); `body` itself when it offers none. The caller's dict is never changed."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return body
    kept = [tool for tool in tools if _hosted_type(protocol, tool) is None]
    if len(kept) == len(tools):
        return body
    dropped_names = {
        tool.get("name")
        for tool in tools
        if _hosted_type(protocol, tool) is not None and isinstance(tool, dict)
    }
    out = {key: value for key, value in body.items() if key != "tools"}
    if kept:
        out["tools"] = kept
    choice = out.get("tool_choice")
    if isinstance(choice, dict):
        allowed = choice.get("tools")
        if choice.get("type") == "allowed_tools" and isinstance(allowed, list):
            still = [tool for tool in allowed if _hosted_type(protocol, tool) is None]
            out["tool_choice"] = {**choice, "tools": still}
            if not still:
                del out["tool_choice"]
        elif _hosted_type(protocol, choice) is not None or (
            choice.get("type") == "tool" and choice.get("name") in dropped_names
        ):
            del out["tool_choice"]
    if not kept and "tool_choice" in out:
        del out["tool_choice"]
    return out
