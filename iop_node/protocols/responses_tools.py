"""The tools of a Responses request, as chat function tools and back.

A Responses request can offer three kinds of tool a chat runtime can call, and the reply
translator must turn each chat tool call back into the item its caller expects, so the
mapping lives in one place, built from the request by both directions:

1. `function`: a chat function of the same name; its calls are `function_call` items.
2. `custom` (freeform input, optionally constrained by a grammar, as Codex's
   `apply_patch`): a chat function with one string argument, `input`, whose description
   carries the grammar; its calls are `custom_tool_call` items whose `input` is that
   string.
3. `namespace` (a group of function and custom tools, as Codex's `multi_agent_v1`): each
   member is a chat function named `<namespace>__<name>`; its calls carry the member's
   own name and the `namespace` again.

Every other type is a tool OpenAI's service runs (`web_search`, `file_search`,
`code_interpreter`, `mcp`, ...) or one built into OpenAI's models (`local_shell`,
`shell`, `apply_patch`, `computer`): a chat runtime has neither, so the request is
refused with the tool named. Those OpenAI's service runs (Codex offers `web_search`
unless its config says `web_search = "disabled"`) are left out of a translated run
before it gets here, unless the model refuses them (`schemas.hosted_tools`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgspec
from msgspec import UNSET

from iop_node.protocols.chat_body import ChatFunction, ChatTool
from iop_node.protocols.errors import TranslationError
from schemas.hosted_tools import RESPONSES_SERVICE_TOOLS

__all__ = [
    "NAMESPACE_SEPARATOR",
    "UNSUPPORTED_TOOLS",
    "CallerTool",
    "CustomTool",
    "FunctionTool",
    "NamespaceTool",
    "Tool",
    "ToolMap",
]

NAMESPACE_SEPARATOR: Final = "__"

_SERVICE = "a tool OpenAI's service runs, and the runtime runs no server-side tools"
_BUILT_IN = "a tool built into OpenAI's models; offer it as a function tool instead"

#: Tool types (and item types of their calls) that only OpenAI's service or models have.
UNSUPPORTED_TOOLS: Final[dict[str, str]] = {
    **dict.fromkeys(RESPONSES_SERVICE_TOOLS, _SERVICE + ' (Codex: set web_search = "disabled")'),
    **dict.fromkeys(
        ("local_shell", "shell", "apply_patch", "computer", "computer_use_preview"), _BUILT_IN
    ),
}


class _Format(msgspec.Struct, frozen=True):
    type: str = "text"
    syntax: str | None = None
    definition: str | None = None


class FunctionTool(msgspec.Struct, frozen=True, tag_field="type", tag="function"):
    name: str
    description: str | None = None
    parameters: msgspec.Raw = msgspec.Raw()
    strict: bool | None = None


class CustomTool(msgspec.Struct, frozen=True, tag_field="type", tag="custom"):
    name: str
    description: str | None = None
    format: _Format | None = None


class NamespaceTool(msgspec.Struct, frozen=True, tag_field="type", tag="namespace"):
    name: str
    tools: list[FunctionTool | CustomTool]
    description: str | None = None


Tool = FunctionTool | CustomTool | NamespaceTool


@dataclass(frozen=True, slots=True)
class CallerTool:
    """What a chat tool call is in the caller's terms."""

    name: str
    namespace: str | None = None
    custom: bool = False


_EMPTY_OBJECT: Final = msgspec.Raw(b'{"type":"object","properties":{}}')


#: A custom tool's one string argument (Rule 2).
_CUSTOM_PARAMETERS: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The tool's whole input."}},
    "required": ["input"],
    "additionalProperties": False,
}


def _custom_description(tool: CustomTool, namespace: str | None) -> str:
    text = tool.description or ""
    fmt = tool.format
    if fmt is not None and fmt.type == "grammar" and fmt.definition:
        text += (
            f"\n\nThe input must follow this {fmt.syntax or 'formal'} grammar:\n{fmt.definition}"
        )
    return _in_namespace(text, namespace)


def _in_namespace(text: str, namespace: str | None) -> str:
    return text if namespace is None else f"[{namespace}] {text}".rstrip()


class ToolMap:
    """The chat tools for a request's `tools`, and each chat name's caller tool."""

    __slots__ = ("_by_chat", "chat_tools")

    def __init__(self, tools: list[Tool] | None) -> None:
        self.chat_tools: list[ChatTool] = []
        self._by_chat: dict[str, CallerTool] = {}
        for i, tool in enumerate(tools or ()):
            if isinstance(tool, NamespaceTool):
                description = tool.description
                for j, member in enumerate(tool.tools):
                    self._add(member, f"tools[{i}].tools[{j}]", tool.name, description)
            else:
                self._add(tool, f"tools[{i}]", None, None)

    @staticmethod
    def chat_name(name: str, namespace: str | None) -> str:
        return name if not namespace else f"{namespace}{NAMESPACE_SEPARATOR}{name}"

    def caller(self, chat_name: str) -> CallerTool:
        """The caller's tool for a chat call's name; a name the request never offered (a
        model that invents a tool) is a plain function call, for the caller to refuse."""
        found = self._by_chat.get(chat_name)
        return found if found is not None else CallerTool(chat_name)

    def __contains__(self, chat_name: str) -> bool:
        return chat_name in self._by_chat

    def _add(
        self,
        tool: FunctionTool | CustomTool,
        path: str,
        namespace: str | None,
        namespace_description: str | None,
    ) -> None:
        name = self.chat_name(tool.name, namespace)
        if name in self._by_chat:
            raise TranslationError(
                f"two tools are offered to the runtime as '{name}'", param=f"{path}.name"
            )
        if isinstance(tool, CustomTool):
            self._by_chat[name] = CallerTool(tool.name, namespace, custom=True)
            function = ChatFunction(
                name=name,
                description=_custom_description(tool, namespace),
                parameters=_CUSTOM_PARAMETERS,
            )
        else:
            self._by_chat[name] = CallerTool(tool.name, namespace)
            unset = bytes(tool.parameters) in (b"", b"null")
            parameters = _EMPTY_OBJECT if unset else tool.parameters
            description = tool.description
            if namespace is not None:
                description = _in_namespace(description or namespace_description or "", namespace)
            function = ChatFunction(
                name=name,
                description=description if description is not None else UNSET,
                parameters=parameters,
                strict=tool.strict if tool.strict is not None else UNSET,
            )
        self.chat_tools.append(ChatTool(function=function))
