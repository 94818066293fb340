"""A chat completion as an OpenAI Responses response object (non-stream), and the shapes
the Responses stream shares with it.

Rules:

1. The response is `resp_<request_id>`, its model the caller's alias. It echoes the
   request's settings (`schemas.responses_echo`): as the caller sent them, with OpenAI's
   defaults, `store: true` for a response the Edge stores (`stored`: `run.keep_output`;
   the body the Node got says `store: false`, since the Edge is the store and the
   runtime must keep nothing, design §14), and the `previous_response_id` the Edge took
   out of the body and passed beside it (`run.previous_response_id`).
2. Every member the Open Responses schema requires is present, `null` when it has no
   value: `completed_at` is set once the response completed; the echo's own are
   `responses_echo`'s.
3. Output items come in the order a model produces them: `reasoning` (the runtime's
   `reasoning_content`, as `reasoning_text` content: it is the reasoning itself, not a
   summary), `message` (output text; a refusal as a `refusal` part), then one item per
   tool call. Item ids are `<kind>_<request_id>_<output index>`, so they are stable.
4. A tool call becomes the item its tool's kind asks for (`responses_tools`): a
   `function_call` (arguments as the runtime wrote them, which must be a JSON object:
   anything else is a `ReplyTranslationError`, the runtime's fault; none is `{}`), with its
   `namespace` when it has one, or a `custom_tool_call` whose `input` is the string the
   runtime passed as the one argument. `call_id` keeps the runtime's id unless it has
   none or repeats one (`call_<request_id>_<n>`). A call in an `incomplete` response
   (the output limit cut it) is not checked: its arguments are what came before the cut,
   marked `incomplete`, as OpenAI gives them (a caller raises the limit and asks again).
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
from schemas.protocols import response_error
from schemas.responses_echo import closing_members, echo_members
from schemas.responses_usage import CachedTokens, ReasoningTokens, ResponsesUsage

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
    "Status",
    "call_id",
    "call_item",
    "closing_members",
    "custom_input",
    "echo_members",
    "failure",
    "item_id",
    "responses_response_from_chat",
    "responses_usage",
    "status_of",
]

Status = Literal["in_progress", "completed", "incomplete", "failed"]


def responses_usage(usage: TokenUsage) -> ResponsesUsage:
    """Rule 6."""
    return ResponsesUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=CachedTokens(cached_tokens=usage.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=ReasoningTokens(reasoning_tokens=usage.reasoning_tokens),
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
            usage=responses_usage(usage) if usage is not None else None,
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
    """A failed response's `error` (`schemas.protocols.response_error`)."""
    kind, text = response_error(code, message)
    return _Error(code=kind, message=text)


_decode_any: Final = msgspec.json.Decoder().decode


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


_check_object: Final = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def _check_arguments(arguments: str, param: str) -> None:
    """Rule 3: a function call's arguments are a JSON object (a caller parses them)."""
    try:
        _check_object(arguments)
    except (msgspec.DecodeError, RecursionError):
        raise ReplyTranslationError(
            "the runtime called a tool with arguments that are not a JSON object: "
            f"{arguments!r:.200}",
            param=param,
        ) from None


def call_item(
    tool: CallerTool, item_id: str, call_id: str, arguments: str, *, param: str, status: Status
) -> FunctionCallItem | CustomCallItem:
    """Rule 4."""
    namespace = tool.namespace if tool.namespace is not None else UNSET
    cut = status == "incomplete"
    if tool.custom:
        try:
            given = custom_input(arguments, param)
        except ReplyTranslationError:
            if not cut:
                raise
            given = arguments
        return CustomCallItem(
            id=item_id, call_id=call_id, name=tool.name, input=given, namespace=namespace
        )
    if arguments.strip() and not cut:
        _check_arguments(arguments, param)
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
        calls = list(named_calls(message))
        cut = choice is not None and choice.finish_reason == "length"
        for position, call in enumerate(calls, 1):
            tool = shell.tools.caller(call.name)
            output.append(
                call_item(
                    tool,
                    item_id("ctc" if tool.custom else "fc", request_id, len(output)),
                    call_id(call.id, request_id, call.n, used),
                    call.arguments,
                    param=call.arguments_param,
                    status="incomplete" if cut and position == len(calls) else "completed",
                )
            )
    counts = response.tokens() or usage or TokenUsage()
    return shell.body(status, output, counts, incomplete=incomplete)
