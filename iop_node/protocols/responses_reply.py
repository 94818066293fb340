"""A chat completion as an OpenAI Responses response object (non-stream), and the shapes
the Responses stream shares with it.

Rules:

1. The response is `resp_<request_id>`, its model the caller's alias. It echoes the
   request's settings as OpenAI's service does (`instructions`, `tools`, `tool_choice`,
   `previous_response_id`, `store`, ...), copied as the caller sent them, with the
   service's defaults for those it left out. A response the Edge stores (`stored`:
   `run.keep_output`) says `store: true`, as its caller asked: the body the Node got says
   `store: false`, since the Edge is the store and the runtime must keep nothing
   (design §14). The Edge also takes `previous_response_id` out of the body (it sends
   the whole conversation instead) and passes it beside it (`run.previous_response_id`),
   so the response echoes the id the caller sent.
2. Every member the Open Responses schema requires is present, `null` when it has no
   value: `completed_at` (set once the response completed), the penalties (`0.0`, the
   service's default), and each echoed function tool's `description`, `parameters` and
   `strict` (a tool that did not say has `null` there: IOP promises no strict
   schema adherence it was not asked for).
3. Output items come in the order a model produces them: `reasoning` (the runtime's
   `reasoning_content`, as `reasoning_text` content: it is the reasoning itself, not a
   summary), `message` (output text; a refusal as a `refusal` part), then one item per
   tool call. Item ids are `<kind>_<request_id>_<output index>`, so they are stable.
4. A tool call becomes the item its tool's kind asks for (`responses_tools`): a
   `function_call` (arguments as the runtime wrote them; none is `{}`), with its
   `namespace` when it has one, or a `custom_tool_call` whose `input` is the string the
   runtime passed as the one argument. `call_id` keeps the runtime's id unless it has
   none or repeats one (`call_<request_id>_<n>`).
5. `finish_reason` `length` makes the response `incomplete` (`max_output_tokens`), as
   does `content_filter` (`content_filter`); anything else is `completed`.
6. Usage: `input_tokens` is the runtime's prompt tokens (cached ones included, as in
   chat), `input_tokens_details.cached_tokens` the cached ones, `output_tokens_details
   .reasoning_tokens` the reasoning ones. A runtime that reports no usage gets the
   caller's fallback (`usage=`: the Node's estimate), never zeros it did not count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final, Literal

import msgspec
from msgspec import UNSET, UnsetType

from iop_node.protocols.chat_body import encode
from iop_node.protocols.chat_view import TokenUsage, named_calls, read_response
from iop_node.protocols.errors import ReplyTranslationError
from iop_node.protocols.responses_request import ResponsesRequest, read_tool_map
from iop_node.protocols.responses_tools import CallerTool, ToolMap

__all__ = [
    "CustomCallItem",
    "FunctionCallItem",
    "MessageItem",
    "OutputItem",
    "OutputText",
    "ReasoningItem",
    "ReasoningText",
    "Refusal",
    "ResponseShell",
    "ResponsesUsage",
    "Status",
    "call_id",
    "call_item",
    "closing_members",
    "custom_input",
    "echo_members",
    "failure",
    "item_id",
    "responses_response_from_chat",
    "status_of",
]

Status = Literal["in_progress", "completed", "incomplete", "failed"]


class _Cached(msgspec.Struct, frozen=True):
    cached_tokens: int
    cache_write_tokens: int = 0
    """A runtime caches prefixes by itself; nothing is written to a cache on request."""


class _Reasoning(msgspec.Struct, frozen=True):
    reasoning_tokens: int


class ResponsesUsage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int
    input_tokens_details: _Cached
    output_tokens: int
    output_tokens_details: _Reasoning
    total_tokens: int

    @classmethod
    def of(cls, usage: TokenUsage) -> ResponsesUsage:
        """Rule 6."""
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=_Cached(cached_tokens=usage.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=_Reasoning(reasoning_tokens=usage.reasoning_tokens),
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
        )


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class Refusal(msgspec.Struct, tag_field="type", tag="refusal"):
    refusal: str


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class MessageItem(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: Status
    role: str = "assistant"
    content: list[OutputText | Refusal]


class ReasoningItem(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText]


class FunctionCallItem(
    msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="type", tag="function_call"
):
    id: str
    status: Status
    call_id: str
    name: str
    arguments: str
    namespace: str | UnsetType = UNSET


class CustomCallItem(
    msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="type", tag="custom_tool_call"
):
    id: str
    call_id: str
    name: str
    input: str
    namespace: str | UnsetType = UNSET


OutputItem = MessageItem | ReasoningItem | FunctionCallItem | CustomCallItem


class _Error(msgspec.Struct, frozen=True):
    code: str
    message: str


class _Incomplete(msgspec.Struct, frozen=True):
    reason: str


#: What a Response echoes of its request (Rule 1), in order, with OpenAI's defaults.
_ECHO_DEFAULTS: Final[tuple[tuple[str, bytes], ...]] = (
    ("instructions", b"null"),
    ("max_output_tokens", b"null"),
    ("max_tool_calls", b"null"),
    ("metadata", b"{}"),
    ("parallel_tool_calls", b"true"),
    ("presence_penalty", b"0.0"),
    ("frequency_penalty", b"0.0"),
    ("previous_response_id", b"null"),
    ("prompt_cache_key", b"null"),
    ("reasoning", b'{"effort":null,"summary":null}'),
    ("safety_identifier", b"null"),
    ("service_tier", b'"default"'),
    ("store", b"true"),
    ("temperature", b"1.0"),
    ("text", b'{"format":{"type":"text"}}'),
    ("tool_choice", b'"auto"'),
    ("tools", b"[]"),
    ("top_logprobs", b"0"),
    ("top_p", b"1.0"),
    ("truncation", b'"disabled"'),
    ("user", b"null"),
)

#: The echoed fields of a request as the caller wrote them, each defaulting to OpenAI's
#: default: decoded from the request (the other fields are skipped), it encodes as the
#: echo.
_Echo = msgspec.defstruct(
    "_Echo",
    [(name, msgspec.Raw, msgspec.Raw(default)) for name, default in _ECHO_DEFAULTS],
    frozen=True,
)
_decode_echo: Final = msgspec.json.Decoder(_Echo).decode
_DEFAULT_ECHO: Final = _Echo()


_STORED: Final = msgspec.Raw(b"true")
_decode_any: Final = msgspec.json.Decoder().decode

#: The members the schema requires of a function tool (Rule 2), `null` unless given.
_FUNCTION_MEMBERS: Final = ("description", "parameters", "strict")


def _tool_echo(tools: msgspec.Raw) -> msgspec.Raw:
    """The echoed `tools` with every function tool's required members (Rule 2), those in
    a namespace too; as sent when none is missing."""
    try:
        listed = _decode_any(tools)
    except (msgspec.DecodeError, RecursionError):
        return tools
    if not isinstance(listed, list):
        return tools
    changed = False

    def complete(tool: Any) -> None:
        nonlocal changed
        if not isinstance(tool, dict):
            return
        if tool.get("type") == "function":
            for member in _FUNCTION_MEMBERS:
                if member not in tool:
                    tool[member] = None
                    changed = True
        for inner in tool.get("tools") or () if tool.get("type") == "namespace" else ():
            complete(inner)

    for tool in listed:
        complete(tool)
    return msgspec.Raw(encode(listed)) if changed else tools


def echo_members(
    body: bytes, *, stored: bool = False, previous_response_id: str | None = None
) -> bytes:
    """Rule 1's echo of a request body, encoded as the members that close a Response
    object (`,"instructions":...,"user":null}`): each field as the caller sent it, else
    OpenAI's default (Rule 2's for function tools); `store: true` when the response is
    `stored`; `previous_response_id` when the Edge passed it beside the body. A body that
    is not a JSON object echoes the defaults (its translation has refused it already)."""
    try:
        echo = _decode_echo(body)
    except (msgspec.DecodeError, RecursionError):  # a ValidationError is a DecodeError
        echo = _DEFAULT_ECHO
    changes: dict[str, msgspec.Raw] = {}
    if stored:
        changes["store"] = _STORED
    if previous_response_id:
        changes["previous_response_id"] = msgspec.Raw(encode(previous_response_id))
    tools = _tool_echo(echo.tools)
    if tools is not echo.tools:
        changes["tools"] = tools
    if changes:
        echo = msgspec.structs.replace(echo, **changes)
    return closing_members(encode(echo))


def closing_members(encoded: bytes) -> bytes:
    """The members of an encoded JSON object, written to close another object that has
    members of its own: `{"a":1}` -> `,"a":1}`, and `{}` -> `}`. With `opened[:-1]`
    (an encoded object without its `}`) in front, the two are one object."""
    if not encoded.startswith(b"{") or not encoded.endswith(b"}"):
        raise ValueError("not an encoded JSON object")
    inner = encoded[1:]
    return inner if inner == b"}" else b"," + inner


class _Response(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A Response object's own fields, in OpenAI's order; the echo follows them."""

    id: str
    object: str
    created_at: int
    completed_at: int | None
    status: Status
    background: bool
    error: _Error | None
    incomplete_details: _Incomplete | None
    model: str
    output: list[OutputItem]
    usage: ResponsesUsage | None


class ResponseShell:
    """What every Response object of one run shares: id, time, model, the echo (encoded
    once per run)."""

    __slots__ = ("_clock", "_echo", "created_at", "id", "model", "tools")

    def __init__(
        self,
        reply_model: str,
        request_id: str,
        request: bytes | ResponsesRequest,
        clock: Callable[[], float],
        *,
        stored: bool = False,
        previous_response_id: str | None = None,
    ) -> None:
        """`stored`: the Edge stores the response; `previous_response_id`: the one the
        caller continues, which the Edge took out of the body (Rule 1)."""
        self.id = f"resp_{request_id}"
        self.model = reply_model
        self._clock = clock
        self.created_at = int(clock())
        if isinstance(request, ResponsesRequest):
            self.tools: ToolMap = request.tools
            body = request.body
        else:
            self.tools = read_tool_map(request)
            body = request
        self._echo = echo_members(body, stored=stored, previous_response_id=previous_response_id)

    def body(
        self,
        status: Status,
        output: list[OutputItem],
        usage: TokenUsage | None,
        *,
        error: _Error | None = None,
        incomplete: str | None = None,
    ) -> bytes:
        """The response object, encoded, its fields as OpenAI orders them."""
        response = _Response(
            id=self.id,
            object="response",
            created_at=self.created_at,
            completed_at=int(self._clock()) if status == "completed" else None,
            status=status,
            background=False,
            error=error,
            incomplete_details=_Incomplete(incomplete) if incomplete else None,
            model=self.model,
            output=output,
            usage=ResponsesUsage.of(usage) if usage is not None else None,
        )
        return encode(response)[:-1] + self._echo


def status_of(finish_reason: str | None) -> tuple[Status, str | None]:
    """Rule 5: the response's status and, when incomplete, why."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "content_filter":
        return "incomplete", "content_filter"
    return "completed", None


def failure(message: str, code: str) -> _Error:
    """A failed response's `error`: OpenAI's code for a load signal, `server_error` for
    the rest; IOP's own code leads the message."""
    kind = "rate_limit_exceeded" if code in ("busy", "upstream_busy") else "server_error"
    return _Error(code=kind, message=f"{code}: {message}")


def custom_input(arguments: str, param: str) -> str:
    """The string a custom tool's call passes (Rule 4): the one argument's value."""
    if not arguments.strip():
        return ""
    try:
        value = _decode_any(arguments)
    except msgspec.DecodeError:
        value = None
    if isinstance(value, dict):
        if isinstance(value.get("input"), str):
            return str(value["input"])
        strings = [item for item in value.values() if isinstance(item, str)]
        if len(value) == 1 and len(strings) == 1:
            return strings[0]
    elif isinstance(value, str):
        return value
    raise ReplyTranslationError(
        f"the runtime called a custom tool without its one string argument: {arguments!r:.200}",
        param=param,
    )


def call_item(
    tool: CallerTool, item_id: str, call_id: str, arguments: str, *, param: str, status: Status
) -> FunctionCallItem | CustomCallItem:
    """Rule 4."""
    namespace = tool.namespace if tool.namespace is not None else UNSET
    if tool.custom:
        return CustomCallItem(
            id=item_id,
            call_id=call_id,
            name=tool.name,
            input=custom_input(arguments, param),
            namespace=namespace,
        )
    return FunctionCallItem(
        id=item_id,
        status=status,
        call_id=call_id,
        name=tool.name,
        arguments=arguments if arguments.strip() else "{}",
        namespace=namespace,
    )


def call_id(runtime_id: str | None, request_id: str, n: int, used: set[str]) -> str:
    """Rule 4."""
    chosen = runtime_id if runtime_id and runtime_id not in used else f"call_{request_id}_{n}"
    used.add(chosen)
    return chosen


def item_id(kind: str, request_id: str, output_index: int) -> str:
    """Rule 3."""
    return f"{kind}_{request_id}_{output_index}"


def responses_response_from_chat(
    chat: bytes,
    *,
    reply_model: str,
    request_id: str,
    request: bytes | ResponsesRequest,
    usage: TokenUsage | None = None,
    clock: Callable[[], float] = time.time,
    stored: bool = False,
    previous_response_id: str | None = None,
) -> bytes:
    """The Responses response object for a whole chat completion; `request` is the
    caller's request (its body, or the body as the run read it) echoed, and read for its
    tools. `usage` counts only when the runtime's reply has none (Rule 6). `clock` dates
    it. `stored`, `previous_response_id`: Rule 1."""
    shell = ResponseShell(
        reply_model,
        request_id,
        request,
        clock,
        stored=stored,
        previous_response_id=previous_response_id,
    )
    response = read_response(chat)
    choice = response.first()
    message = choice.said if choice is not None else None
    status, incomplete = status_of(choice.finish_reason if choice is not None else None)
    output: list[OutputItem] = []
    if message is not None:
        if message.thinking:
            output.append(
                ReasoningItem(
                    id=item_id("rs", request_id, len(output)),
                    content=[ReasoningText(text=message.thinking)],
                )
            )
        parts: list[OutputText | Refusal] = []
        if message.content:
            parts.append(OutputText(text=message.content))
        if message.refusal:
            parts.append(Refusal(refusal=message.refusal))
        if parts:
            output.append(
                MessageItem(
                    id=item_id("msg", request_id, len(output)),
                    status="incomplete" if status == "incomplete" else "completed",
                    content=parts,
                )
            )
        used: set[str] = set()
        for call in named_calls(message):
            tool = shell.tools.caller(call.name)
            output.append(
                call_item(
                    tool,
                    item_id("ctc" if tool.custom else "fc", request_id, len(output)),
                    call_id(call.id, request_id, call.n, used),
                    call.arguments,
                    param=call.arguments_param,
                    status="completed",
                )
            )
    counts = response.usage.tokens() if response.usage is not None else usage or TokenUsage()
    return shell.body(status, output, counts, incomplete=incomplete)
