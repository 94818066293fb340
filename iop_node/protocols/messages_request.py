"""An Anthropic Messages request as a chat completions request.

Rules:

1. Content is never dropped silently. A block chat completions can carry is translated;
   one it cannot (a server-side tool's block, a PDF, a file reference) is a
   `TranslationError` naming it. The exceptions are stated here: `redacted_thinking`
   (reasoning encrypted for Anthropic's own models, meaningless to any other) and
   `cache_control` markers (a runtime caches prefixes by itself) are left out.
2. `system` (a string, or text blocks as Claude Code sends them) becomes the first
   message, role `system`; a `system` message inside `messages` (a beta Claude Code
   uses) stays a system message where it is.
3. An assistant turn is one chat message: its text blocks are the content, its
   `thinking` blocks the `reasoning_content`, its `tool_use` blocks the `tool_calls`
   (arguments: `input` as JSON, byte for byte).
4. A user turn's `tool_result` blocks become `tool` messages, first and in order, since
   chat completions needs them right after the assistant's calls; the turn's other
   blocks, and images a tool returned (a tool message carries text only), follow as one
   user message. A result with `is_error` says so in its text ("Error: ..."), the one
   way a chat message can. A result for a call no earlier assistant turn made is
   refused: the runtime would answer a question nobody asked.
5. Custom tools become function tools (`input_schema` as `parameters`, untouched).
   Anthropic's server tools and Anthropic-defined client tools (`bash_...`,
   `text_editor_...`) are refused: their schemas and behaviour live inside Anthropic's
   service and models.
6. Settings with no chat equivalent that change no content are dropped: `thinking`,
   `context_management`, `output_config`, `metadata`, `service_tier`, `container`.
   A chat runtime's reasoning is configured by its operator (template, server flags),
   and per-request knobs differ per runtime. `top_k` passes on: vLLM, SGLang and
   llama.cpp take it as an extension of chat completions.
"""

from __future__ import annotations

from typing import Final

import msgspec
from msgspec import UNSET

from iop_node.protocols.chat_body import (
    ChatBody,
    ChatFunction,
    ChatMessage,
    ChatTool,
    ChatToolCall,
    FunctionCall,
    ImagePart,
    ImageURL,
    Part,
    TextPart,
    chat_body,
    encode,
    text_and_images,
    text_or_parts,
)
from iop_node.protocols.errors import TranslationError, from_validation

__all__ = ["messages_request_to_chat"]

_SERVER_BLOCK = "a server-side tool's block, and the runtime runs no server-side tools"

#: Content block types Anthropic defines that have no chat completions equivalent.
UNSUPPORTED_BLOCKS: Final[dict[str, str]] = {
    **dict.fromkeys(
        (
            "server_tool_use",
            "web_search_tool_result",
            "web_fetch_tool_result",
            "code_execution_tool_result",
            "bash_code_execution_tool_result",
            "text_editor_code_execution_tool_result",
            "tool_search_tool_result",
            "mcp_tool_use",
            "mcp_tool_result",
            "container_upload",
        ),
        _SERVER_BLOCK,
    ),
    "search_result": "search result blocks have no chat completions equivalent",
}

#: Prefixes of Anthropic tool `type`s, and why each cannot run on another runtime.
_TOOL_TYPES: Final[tuple[tuple[str, str], ...]] = (
    ("web_search_", "a server-side tool, and the runtime runs no server-side tools"),
    ("web_fetch_", "a server-side tool, and the runtime runs no server-side tools"),
    ("code_execution_", "a server-side tool, and the runtime runs no server-side tools"),
    ("tool_search_tool_", "a server-side tool, and the runtime runs no server-side tools"),
    ("mcp_toolset", "MCP connectors run inside Anthropic's service"),
    ("bash_", "an Anthropic-defined tool: its schema is known only to Anthropic's models"),
    ("text_editor_", "an Anthropic-defined tool: its schema is known only to Anthropic's models"),
    ("computer_", "an Anthropic-defined tool: its schema is known only to Anthropic's models"),
    ("memory_", "an Anthropic-defined tool: its schema is known only to Anthropic's models"),
)


# --- the request as Anthropic defines it (unknown fields are skipped) --------------------


class _Base64Source(msgspec.Struct, frozen=True, tag_field="type", tag="base64"):
    media_type: str
    data: str


class _URLSource(msgspec.Struct, frozen=True, tag_field="type", tag="url"):
    url: str


class _FileSource(msgspec.Struct, frozen=True, tag_field="type", tag="file"):
    file_id: str


class _TextSource(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    data: str


_ImageSource = _Base64Source | _URLSource | _FileSource
_DocumentSource = _Base64Source | _URLSource | _FileSource | _TextSource


class _Text(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    text: str


class _Image(msgspec.Struct, frozen=True, tag_field="type", tag="image"):
    source: _ImageSource


class _Document(msgspec.Struct, frozen=True, tag_field="type", tag="document"):
    source: _DocumentSource


class _ToolUse(msgspec.Struct, frozen=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: msgspec.Raw


class _ToolResult(msgspec.Struct, frozen=True, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[_Text | _Image | _Document] | None = None
    is_error: bool = False


class _Thinking(msgspec.Struct, frozen=True, tag_field="type", tag="thinking"):
    thinking: str


class _RedactedThinking(msgspec.Struct, frozen=True, tag_field="type", tag="redacted_thinking"):
    pass


_Block = _Text | _Image | _Document | _ToolUse | _ToolResult | _Thinking | _RedactedThinking


class _Message(msgspec.Struct, frozen=True):
    role: str
    content: str | list[_Block]


class _Tool(msgspec.Struct, frozen=True):
    name: str
    type: str | None = None
    description: str | None = None
    input_schema: msgspec.Raw = msgspec.Raw()
    """Raw (passed on untouched); msgspec admits no union with Raw, so empty is unset."""
    strict: bool | None = None


class _Choice(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    disable_parallel_tool_use: bool = False


class _Auto(_Choice, frozen=True, tag="auto"):
    pass


class _Any(_Choice, frozen=True, tag="any"):
    pass


class _None(_Choice, frozen=True, tag="none"):
    pass


class _Named(_Choice, frozen=True, kw_only=True, tag="tool"):
    name: str


class _Request(msgspec.Struct, frozen=True):
    model: str
    messages: list[_Message]
    max_tokens: int | None = None
    system: str | list[_Text] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[_Tool] | None = None
    tool_choice: _Auto | _Any | _None | _Named | None = None
    mcp_servers: list[msgspec.Raw] | None = None


_decode: Final = msgspec.json.Decoder(_Request).decode


# --- translation -------------------------------------------------------------------------


def messages_request_to_chat(body: bytes) -> bytes:
    """The chat completions body for a Messages request body (its `model` already the
    served name). `TranslationError` names what cannot be translated."""
    try:
        request = _decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise from_validation(exc, unsupported=UNSUPPORTED_BLOCKS) from None
    if request.mcp_servers:
        raise TranslationError(
            "MCP connectors run inside Anthropic's service; the runtime has none",
            param="mcp_servers",
        )
    messages: list[ChatMessage] = []
    if request.system:
        system = request.system
        text = system if isinstance(system, str) else "\n".join(b.text for b in system)
        messages.append(ChatMessage(role="system", content=text))
    calls: set[str] = set()
    for i, message in enumerate(request.messages):
        path = f"messages[{i}]"
        if message.role == "user":
            _user(message.content, path, calls, messages)
        elif message.role == "assistant":
            messages.append(_assistant(message.content, path, calls))
        elif message.role == "system":
            messages.append(ChatMessage(role="system", content=_text_only(message.content, path)))
        else:
            raise TranslationError(
                f"role '{message.role}' is not one of user, assistant, system",
                param=f"{path}.role",
            )
    chat = chat_body(
        request.model,
        messages,
        stream=request.stream,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
    )
    if request.top_k is not None:
        chat.top_k = request.top_k
    if request.stop_sequences:
        chat.stop = request.stop_sequences
    if request.tools:
        chat.tools = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.tools)]
    _tool_choice(request.tool_choice, chat)
    return encode(chat)


def _user(content: str | list[_Block], path: str, calls: set[str], out: list[ChatMessage]) -> None:
    """Rule 4: tool results first, as tool messages; then the rest as one user message."""
    if isinstance(content, str):
        out.append(ChatMessage(role="user", content=content))
        return
    parts: list[Part] = []
    for j, block in enumerate(content):
        where = f"{path}.content[{j}]"
        match block:
            case _ToolResult():
                if block.tool_use_id not in calls:
                    raise TranslationError(
                        f"tool_result for '{block.tool_use_id}', which no earlier assistant "
                        "turn's tool_use block has as its id",
                        param=f"{where}.tool_use_id",
                    )
                text, images = _tool_result(block, where)
                out.append(ChatMessage(role="tool", content=text, tool_call_id=block.tool_use_id))
                parts.extend(images)
            case _Text() | _Image() | _Document():
                parts.append(_part(block, where))
            case _:
                raise TranslationError(
                    f"a user turn cannot hold a '{_tag(block)}' block", param=f"{where}.type"
                )
    if parts or not content:
        out.append(ChatMessage(role="user", content=text_or_parts(parts)))


def _assistant(content: str | list[_Block], path: str, calls: set[str]) -> ChatMessage:
    """Rule 3: one assistant message of text, reasoning and tool calls."""
    if isinstance(content, str):
        return ChatMessage(role="assistant", content=content)
    texts: list[str] = []
    thinking: list[str] = []
    tool_calls: list[ChatToolCall] = []
    for j, block in enumerate(content):
        where = f"{path}.content[{j}]"
        match block:
            case _Text():
                texts.append(block.text)
            case _Thinking():
                thinking.append(block.thinking)
            case _RedactedThinking():
                pass  # Rule 1: encrypted for Anthropic's models only
            case _ToolUse():
                arguments = bytes(block.input)
                if not arguments.lstrip().startswith(b"{"):
                    raise TranslationError(
                        "a tool_use block's input must be a JSON object", param=f"{where}.input"
                    )
                if block.id in calls:
                    raise TranslationError(
                        f"tool_use id '{block.id}' is used twice", param=f"{where}.id"
                    )
                calls.add(block.id)
                tool_calls.append(
                    ChatToolCall(
                        id=block.id,
                        function=FunctionCall(name=block.name, arguments=arguments.decode()),
                    )
                )
            case _:
                raise TranslationError(
                    f"an assistant turn cannot hold a '{_tag(block)}' block",
                    param=f"{where}.type",
                )
    message = ChatMessage(role="assistant", content="\n".join(texts))
    if thinking:
        message.reasoning_content = "\n".join(thinking)
    if tool_calls:
        message.tool_calls = tool_calls
    return message


def _tool_result(block: _ToolResult, path: str) -> tuple[str, list[Part]]:
    """A tool result's text, and the images it returned (they travel in a user message)."""
    content = block.content
    images: list[Part] = []
    if isinstance(content, str):
        text = content
    else:
        parts = (_part(inner, f"{path}.content[{k}]") for k, inner in enumerate(content or ()))
        text, images = text_and_images(parts)
    return (f"Error: {text}" if block.is_error else text), images


def _part(block: _Text | _Image | _Document, path: str) -> Part:
    match block:
        case _Text():
            return TextPart(text=block.text)
        case _Image(source=_Base64Source(media_type=media_type, data=data)):
            return ImagePart(image_url=ImageURL(url=f"data:{media_type};base64,{data}"))
        case _Image(source=_URLSource(url=url)):
            return ImagePart(image_url=ImageURL(url=url))
        case _Document(source=_TextSource(data=data)):
            return TextPart(text=data)
        case _Document():
            raise TranslationError(
                "only plain-text documents can be translated: the runtime reads no PDF",
                param=f"{path}.source.type",
            )
        case _:
            raise TranslationError(
                "a file reference needs Anthropic's Files API; send the image inline",
                param=f"{path}.source.type",
            )


def _text_only(content: str | list[_Block], path: str) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, block in enumerate(content):
        if not isinstance(block, _Text):
            raise TranslationError(
                f"a system turn holds text blocks only, not '{_tag(block)}'",
                param=f"{path}.content[{j}].type",
            )
        texts.append(block.text)
    return "\n".join(texts)


def _tool(tool: _Tool, path: str) -> ChatTool:
    """Rule 5."""
    if tool.type not in (None, "custom"):
        reason = next(
            (why for prefix, why in _TOOL_TYPES if tool.type.startswith(prefix)),
            "only custom tools (a name and an input_schema) can be translated",
        )
        raise TranslationError(
            f"tool type '{tool.type}' cannot be translated for this provider: {reason}",
            param=f"{path}.type",
        )
    if bytes(tool.input_schema) in (b"", b"null"):
        raise TranslationError("a custom tool needs an input_schema", param=f"{path}.input_schema")
    function = ChatFunction(
        name=tool.name,
        description=tool.description if tool.description is not None else UNSET,
        parameters=tool.input_schema,
        strict=tool.strict if tool.strict is not None else UNSET,
    )
    return ChatTool(function=function)


def _tool_choice(choice: _Auto | _Any | _None | _Named | None, chat: ChatBody) -> None:
    match choice:
        case None:
            return
        case _Auto():
            chat.tool_choice = "auto"
        case _Any():
            chat.tool_choice = "required"
        case _None():
            chat.tool_choice = "none"
        case _Named(name=name):
            chat.tool_choice = {"type": "function", "function": {"name": name}}
    if choice.disable_parallel_tool_use:
        chat.parallel_tool_calls = False


def _tag(block: msgspec.Struct) -> str:
    return str(block.__struct_config__.tag)
