"""An OpenAI Responses request as a chat completions request.

Rules:

1. `instructions` becomes the first message, role `system`. Input message roles
   `developer` and `system` become `system` (chat templates of open models know no
   `developer`), and system messages in a row are one (several templates accept one
   system message only); `user` and `assistant` stay.
2. Items become messages in order. An assistant's `message`, `function_call` and
   `custom_tool_call` items that follow one another are one assistant chat message (its
   text, then its calls), as chat completions has them. A `function_call`'s `arguments`
   must be a JSON object written as a string (blank is `{}`); anything else is refused
   naming `input[i].arguments` (the runtime would read a call no model made). A
   `reasoning` item's text (its `content`, else its `summary`) is the next assistant
   message's `reasoning_content`;
   reasoning nothing follows is left out (it answers nothing), and so is
   `encrypted_content` (sealed for OpenAI's models).
3. `function_call_output` and `custom_tool_call_output` items are `tool` messages; one
   whose `call_id` no earlier call item has is refused (the runtime would answer a call
   nobody made). Images an output returns travel in a user message after the run of
   tool messages (a tool message carries text only).
4. Tools as `responses_tools` maps them; `tool_choice` follows (`allowed_tools` keeps
   just the allowed tools, with its mode as the choice).
5. Anything that needs OpenAI's service or its models is refused with the field named:
   server-side tools and their call items, `item_reference` and `conversation` (state
   the Edge did not expand), a `compaction` item another service sealed (the Edge has
   made IOP's own readable, `iop_edge.core.responses.compaction`), reusable `prompt`s,
   `background` runs, files by id.
6. Settings with no chat meaning are dropped: `store`, `include`, `metadata`, `user`,
   `prompt_cache_key`, `client_metadata`, `safety_identifier`, `service_tier`,
   `truncation`, `text.verbosity`, `reasoning.summary`, `top_logprobs`,
   `max_tool_calls`, `previous_response_id` (the Edge has put the stored items in
   `input`). `reasoning.effort` becomes `reasoning_effort` where chat runtimes accept
   the value (low, medium, high).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
from msgspec import UNSET

from iop_node.protocols.chat_body import (
    ChatBody,
    ChatMessage,
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
from iop_node.protocols.responses_tools import UNSUPPORTED_TOOLS, Tool, ToolMap

__all__ = [
    "UNSUPPORTED",
    "ResponsesRequest",
    "read_responses_request",
    "read_tool_map",
    "responses_request_to_chat",
]

_STATE = "it refers to state kept by OpenAI's service; send the items themselves"

#: Item, content and tool types that cannot be translated, and why.
UNSUPPORTED: Final[dict[str, str]] = {
    **UNSUPPORTED_TOOLS,
    **{f"{name}_call": why for name, why in UNSUPPORTED_TOOLS.items()},
    **{f"{name}_call_output": why for name, why in UNSUPPORTED_TOOLS.items()},
    "shell_call_output": UNSUPPORTED_TOOLS["shell"],
    "item_reference": _STATE,
    "compaction": (
        "it is a compaction another service made, sealed for that service's models; "
        "IOP reads the compactions it made itself (POST /v1/responses/compact)"
    ),
    "mcp_list_tools": UNSUPPORTED_TOOLS["mcp"],
    "mcp_approval_request": UNSUPPORTED_TOOLS["mcp"],
    "mcp_approval_response": UNSUPPORTED_TOOLS["mcp"],
    "input_file": "files cannot be translated: the runtime reads text and images",
    "input_audio": "audio cannot be translated: the runtime reads text and images",
}

_EFFORTS: Final = frozenset({"low", "medium", "high"})


# --- the request as OpenAI defines it (unknown fields are skipped) -----------------------


class _Text(msgspec.Struct, frozen=True, tag_field="type", tag="input_text"):
    text: str


class _OutputText(msgspec.Struct, frozen=True, tag_field="type", tag="output_text"):
    text: str


class _Image(msgspec.Struct, frozen=True, tag_field="type", tag="input_image"):
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class _Refusal(msgspec.Struct, frozen=True, tag_field="type", tag="refusal"):
    refusal: str


_Content = str | list[_Text | _OutputText | _Image | _Refusal]


class _Head(msgspec.Struct, frozen=True):
    type: str = "message"


class _MessageItem(msgspec.Struct, frozen=True):
    role: str
    content: _Content


class _FunctionCall(msgspec.Struct, frozen=True):
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class _CustomCall(msgspec.Struct, frozen=True):
    call_id: str
    name: str
    input: str
    namespace: str | None = None


class _CallOutput(msgspec.Struct, frozen=True):
    call_id: str
    output: str | list[_Text | _OutputText | _Image]


class _Summary(msgspec.Struct, frozen=True):
    text: str


class _Reasoning(msgspec.Struct, frozen=True):
    summary: list[_Summary] = []
    content: list[_Summary] | None = None


class _FunctionChoice(msgspec.Struct, frozen=True, tag_field="type", tag="function"):
    name: str


class _CustomChoice(msgspec.Struct, frozen=True, tag_field="type", tag="custom"):
    name: str


class _AllowedTool(msgspec.Struct, frozen=True):
    name: str


class _AllowedTools(msgspec.Struct, frozen=True, tag_field="type", tag="allowed_tools"):
    mode: str
    tools: list[_AllowedTool]


class _ReasoningConfig(msgspec.Struct, frozen=True):
    effort: str | None = None


class _Format(msgspec.Struct, frozen=True):
    type: str = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class _TextConfig(msgspec.Struct, frozen=True):
    format: _Format | None = None


class _Request(msgspec.Struct, frozen=True):
    model: str
    input: str | list[msgspec.Raw] = []
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: str | _FunctionChoice | _CustomChoice | _AllowedTools | None = None
    parallel_tool_calls: bool | None = None
    reasoning: _ReasoningConfig | None = None
    text: _TextConfig | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None


class _Tools(msgspec.Struct, frozen=True):
    tools: list[Tool] | None = None


_decode_request: Final = msgspec.json.Decoder(_Request).decode
_decode_tools: Final = msgspec.json.Decoder(_Tools).decode
_decode_head: Final = msgspec.json.Decoder(_Head).decode
_ITEMS: Final[dict[str, msgspec.json.Decoder[Any]]] = {
    "message": msgspec.json.Decoder(_MessageItem),
    "function_call": msgspec.json.Decoder(_FunctionCall),
    "custom_tool_call": msgspec.json.Decoder(_CustomCall),
    "function_call_output": msgspec.json.Decoder(_CallOutput),
    "custom_tool_call_output": msgspec.json.Decoder(_CallOutput),
    "reasoning": msgspec.json.Decoder(_Reasoning),
}


def read_tool_map(body: bytes) -> ToolMap:
    """The tool map of a Responses request body (for a reply's translator given only the
    body: a run reads its request once, `read_responses_request`)."""
    try:
        return ToolMap(_decode_tools(body).tools)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise from_validation(exc, unsupported=UNSUPPORTED) from None


class ResponsesRequest:
    """A Responses request body read once, for both directions of a run: the request's
    translation to chat and the reply's translation back (which echoes the body and
    maps tool calls back through the same `tools`)."""

    __slots__ = ("body", "request", "tools")

    def __init__(self, body: bytes, request: _Request, tools: ToolMap) -> None:
        self.body = body
        self.request = request
        self.tools = tools


def read_responses_request(body: bytes) -> ResponsesRequest:
    """Read a Responses request body (its `model` already the served name);
    `TranslationError` names what cannot be translated."""
    try:
        request = _decode_request(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise from_validation(exc, unsupported=UNSUPPORTED) from None
    _refuse_state(request)
    return ResponsesRequest(body, request, ToolMap(request.tools))


# --- translation -------------------------------------------------------------------------


def responses_request_to_chat(body: bytes | ResponsesRequest) -> bytes:
    """The chat completions body for a Responses request (its body, or the body read by
    `read_responses_request`). `TranslationError` names what cannot be translated."""
    read = body if isinstance(body, ResponsesRequest) else read_responses_request(body)
    request, tools = read.request, read.tools
    messages: list[ChatMessage] = []
    if request.instructions:
        messages.append(ChatMessage(role="system", content=request.instructions))
    if isinstance(request.input, str):
        messages.append(ChatMessage(role="user", content=request.input))
    else:
        _Items(tools, messages).add_all(request.input)
    chat = chat_body(
        request.model,
        messages,
        stream=request.stream,
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
    )
    if tools.chat_tools:
        chat.tools = tools.chat_tools
    _tool_choice(request.tool_choice, tools, chat)
    if request.parallel_tool_calls is False:
        chat.parallel_tool_calls = False
    effort = request.reasoning.effort if request.reasoning else None
    if effort in _EFFORTS:
        chat.reasoning_effort = effort
    _response_format(request.text, chat)
    return encode(chat)


def _refuse_state(request: _Request) -> None:
    """Rule 5, for the request's own fields."""
    if request.background:
        raise TranslationError(
            "background responses need OpenAI's service to keep running them",
            param="background",
        )
    if request.conversation is not None:
        raise TranslationError(_STATE, param="conversation")
    if request.prompt is not None:
        raise TranslationError(
            "reusable prompts are kept by OpenAI's service; send the input itself",
            param="prompt",
        )


class _Items:
    """Rules 2 and 3: input items to chat messages, in one pass."""

    __slots__ = ("_calls", "_images", "_out", "_reasoning", "_tools")

    def __init__(self, tools: ToolMap, out: list[ChatMessage]) -> None:
        self._tools = tools
        self._out = out
        self._calls: set[str] = set()
        self._reasoning: list[str] = []
        self._images: list[Part] = []  # returned by tool outputs, sent after them

    def add_all(self, items: list[msgspec.Raw]) -> None:
        for i, raw in enumerate(items):
            path = f"input[{i}]"
            try:
                kind = _decode_head(raw).type
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise from_validation(exc, prefix=path, unsupported=UNSUPPORTED) from None
            decoder = _ITEMS.get(kind)
            if decoder is None:
                raise TranslationError(
                    f"item type '{kind}' cannot be translated for this provider: "
                    + UNSUPPORTED.get(kind, "it is not a type this translator knows"),
                    param=f"{path}.type",
                )
            try:
                item = decoder.decode(raw)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                # The item's type leads the message: a caller (an agent replaying its
                # history) sees which of its items did not read.
                error = from_validation(exc, prefix=path, unsupported=UNSUPPORTED)
                raise TranslationError(
                    f"a '{kind}' item: {error.reason}", param=error.param
                ) from None
            if not isinstance(item, _CallOutput):
                self._flush_images()
            self._add(item, path)
        self._flush_images()

    def _add(self, item: object, path: str) -> None:
        match item:
            case _MessageItem():
                self._message(item, path)
            case _FunctionCall():
                name = self._tools.chat_name(item.name, item.namespace)
                arguments = _call_arguments(item.arguments, f"{path}.arguments")
                self._call(item.call_id, name, arguments, path)
            case _CustomCall():
                name = self._tools.chat_name(item.name, item.namespace)
                self._call(item.call_id, name, encode({"input": item.input}).decode(), path)
            case _CallOutput():
                self._output(item, path)
            case _Reasoning():
                texts = [part.text for part in item.content or item.summary]
                self._reasoning.extend(text for text in texts if text)

    def _message(self, item: _MessageItem, path: str) -> None:
        role = item.role
        if role in ("developer", "system"):
            role = "system"
        elif role not in ("user", "assistant"):
            raise TranslationError(
                f"role '{role}' is not one of user, assistant, system, developer",
                param=f"{path}.role",
            )
        content = _content(item.content, f"{path}.content")
        last = self._out[-1] if self._out else None
        if role == "assistant":
            message = self._assistant()
            message.content = _joined(message.content, content)
        elif role == "system" and last is not None and last.role == "system":
            last.content = _joined(last.content, content)  # one system message, not several
        else:
            self._out.append(ChatMessage(role=role, content=content))

    def _assistant(self) -> ChatMessage:
        """The assistant message being built: the last one, unless something else has
        come since, or a new one (which takes any pending reasoning)."""
        last = self._out[-1] if self._out else None
        if last is not None and last.role == "assistant" and not self._reasoning:
            return last
        message = ChatMessage(role="assistant", content="")
        if self._reasoning:
            message.reasoning_content = "\n".join(self._reasoning)
            self._reasoning = []
        self._out.append(message)
        return message

    def _call(self, call_id: str, name: str, arguments: str, path: str) -> None:
        if call_id in self._calls:
            raise TranslationError(f"call_id '{call_id}' is used twice", param=f"{path}.call_id")
        self._calls.add(call_id)
        message = self._assistant()
        call = ChatToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))
        if isinstance(message.tool_calls, list):
            message.tool_calls.append(call)
        else:
            message.tool_calls = [call]

    def _output(self, item: _CallOutput, path: str) -> None:
        if item.call_id not in self._calls:
            raise TranslationError(
                f"output for call '{item.call_id}', which no earlier call item has as its call_id",
                param=f"{path}.call_id",
            )
        output = item.output
        if isinstance(output, str):
            text = output
        else:
            parts = (_part(part, f"{path}.output[{k}]") for k, part in enumerate(output))
            text, images = text_and_images(parts)
            self._images.extend(images)
        self._out.append(ChatMessage(role="tool", content=text, tool_call_id=item.call_id))

    def _flush_images(self) -> None:
        if self._images:
            self._out.append(ChatMessage(role="user", content=self._images))
            self._images = []


def _content(content: _Content, path: str) -> str | list[Part]:
    if isinstance(content, str):
        return content
    return text_or_parts([_part(part, f"{path}[{k}]") for k, part in enumerate(content)])


def _joined(before: str | list[Part], after: str | list[Part]) -> str | list[Part]:
    """Two contents of one assistant message as one."""
    if not before:
        return after
    if isinstance(before, str) and isinstance(after, str):
        return f"{before}\n{after}"
    first = [TextPart(text=before)] if isinstance(before, str) else before
    second = [TextPart(text=after)] if isinstance(after, str) else after
    return [*first, *second]


def _part(part: _Text | _OutputText | _Image | _Refusal, path: str) -> Part:
    match part:
        case _Text(text=text) | _OutputText(text=text):
            return TextPart(text=text)
        case _Refusal(refusal=text):
            return TextPart(text=text)
        case _Image(image_url=str() as url):
            detail = part.detail if part.detail is not None else UNSET
            return ImagePart(image_url=ImageURL(url=url, detail=detail))
        case _:
            raise TranslationError(
                "an image by file_id needs OpenAI's Files API; send image_url (a URL or a "
                "data URL) instead",
                param=f"{path}.file_id",
            )


def _tool_choice(
    choice: str | _FunctionChoice | _CustomChoice | _AllowedTools | None,
    tools: ToolMap,
    chat: ChatBody,
) -> None:
    match choice:
        case None:
            return
        case "auto" | "none" | "required":
            chat.tool_choice = choice
        case str():
            raise TranslationError(
                f"tool_choice '{choice}' is not one of auto, none, required", param="tool_choice"
            )
        case _FunctionChoice(name=name) | _CustomChoice(name=name):
            chat.tool_choice = {"type": "function", "function": {"name": name}}
        case _AllowedTools(mode=mode, tools=allowed):
            if mode not in ("auto", "required"):
                raise TranslationError(
                    f"mode '{mode}' is not one of auto, required", param="tool_choice.mode"
                )
            names = {tool.name for tool in allowed}
            chat.tools = [t for t in tools.chat_tools if t.function.name in names]
            chat.tool_choice = mode


def _response_format(text: _TextConfig | None, chat: ChatBody) -> None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return
    if fmt.type == "json_object":
        chat.response_format = {"type": "json_object"}
    elif fmt.type == "json_schema":
        schema: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema or {}}
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        if fmt.description is not None:
            schema["description"] = fmt.description
        chat.response_format = {"type": "json_schema", "json_schema": schema}
    else:
        raise TranslationError(
            f"text format '{fmt.type}' is not one of text, json_object, json_schema",
            param="text.format.type",
        )


_check_object: Final = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def _call_arguments(arguments: str, param: str) -> str:
    """Rule 2: a `function_call`'s arguments, checked to be a JSON object."""
    if not arguments.strip():
        return "{}"
    try:
        _check_object(arguments)
    except (msgspec.DecodeError, RecursionError):
        raise TranslationError(
            f"a function_call's arguments must be a JSON object as a string, not {arguments!r:.80}",
            param=param,
        ) from None
    return arguments
