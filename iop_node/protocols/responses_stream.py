"""A chat completion stream as an OpenAI Responses stream, chunk by chunk.

`ResponsesStream` is a pure state machine, one per run: `feed` takes one chat chunk (the
`data:` payload) and returns the Responses events it completes, already framed
(`event: NAME\\ndata: {...}\\n\\n`); `finish` closes the response; `fail` ends it with
`response.failed`; `final_response` is the response object the stream ended with (the
Edge stores it for `store: true`). Every event carries `sequence_number`, counting from
0; `output_index`, `content_index` and `item_id` agree across an item's events. The rules
are the ones gateways that translate in the middle get wrong:

1. Exactly one `response.created`, then one `response.in_progress`, before anything else
   (on the first chunk, or at `finish`/`fail` if the runtime said nothing at all).
2. One output item is open at a time. Reasoning goes in a `reasoning` item
   (`reasoning_text` content), text in a `message` item (`output_text` part; a refusal
   in a `refusal` part of the same item), each tool call in its own item: a switch of
   kind, or a new tool call, closes the open item (its `.done` events, then
   `response.output_item.done`) and adds the next. Reasoning never lands in a text part.
3. Text is sent once: as `output_text.delta` while it streams, and whole in the `.done`
   events and the final object, which are built from the same pieces, never by
   appending a final copy to the deltas.
4. Function-call argument fragments are relayed as `function_call_arguments.delta` as
   they arrive (a call whose name has not come yet keeps them until it has one; a
   repeated name is not doubled; a call with no arguments gets `{}`). A custom tool's
   input is a string inside the chat arguments' JSON, so it is sent whole when its call
   closes (`custom_tool_call_input.delta`, then `.done`). Parallel calls are told apart
   by the chat `tool_calls[].index`; a fragment for a call already closed (an upstream
   that interleaves calls' arguments, which no runtime we know does) is a
   `ReplyTranslationError`.
5. `finish` closes the open item, then `response.completed` (or `response.incomplete`
   for `length` / `content_filter`) with the whole response and its usage: the
   runtime's own numbers when it reported them in a chunk; `finish(usage)` is the
   fallback (an estimate) for one that did not.
6. Empty strings open nothing.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec

from iop_node.protocols.chat_body import encode, sse_head
from iop_node.protocols.chat_stream import ChatStreamTranslator, StreamedCall
from iop_node.protocols.chat_view import TokenUsage
from iop_node.protocols.errors import ReplyTranslationError
from iop_node.protocols.responses_reply import (
    CustomCallItem,
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    Refusal,
    ResponseShell,
    Status,
    call_id,
    call_item,
    failure,
    item_id,
    status_of,
)
from iop_node.protocols.responses_request import ResponsesRequest
from iop_node.protocols.responses_tools import CallerTool

__all__ = ["ResponsesStream"]


# --- events ------------------------------------------------------------------------------


class _Event(msgspec.Struct, kw_only=True, tag_field="type"):
    sequence_number: int


class _Lifecycle(_Event, kw_only=True):
    response: msgspec.Raw
    """The response object, encoded once (a stream's last one is also its final response)."""


class _ItemEvent(_Event, kw_only=True):
    output_index: int
    item: OutputItem


class _InItem(_Event, kw_only=True):
    """An event about the content of one item, named by both its id and its index."""

    item_id: str
    output_index: int


class _InPart(_InItem, kw_only=True):
    """An event about one content part of an item."""

    content_index: int


class _PartEvent(_InPart, kw_only=True):
    part: OutputText | Refusal | ReasoningText


class _Delta(_InPart, kw_only=True):
    delta: str


class _TextDelta(_Delta, kw_only=True, tag="response.output_text.delta"):
    logprobs: list[Any] = []


class _RefusalDelta(_Delta, kw_only=True, tag="response.refusal.delta"):
    pass


class _ReasoningDelta(_Delta, kw_only=True, tag="response.reasoning_text.delta"):
    pass


_DELTAS: Final[dict[str, type[_Delta]]] = {
    "output_text": _TextDelta,
    "refusal": _RefusalDelta,
    "reasoning_text": _ReasoningDelta,
}


class _TextDone(_InPart, kw_only=True, tag="response.output_text.done"):
    text: str
    logprobs: list[Any] = []


class _RefusalDone(_InPart, kw_only=True, tag="response.refusal.done"):
    refusal: str


class _ReasoningDone(_InPart, kw_only=True, tag="response.reasoning_text.done"):
    text: str


class _ArgumentsDelta(_InItem, kw_only=True, tag="response.function_call_arguments.delta"):
    delta: str


class _ArgumentsDone(_InItem, kw_only=True, tag="response.function_call_arguments.done"):
    name: str
    arguments: str


class _InputDelta(_InItem, kw_only=True, tag="response.custom_tool_call_input.delta"):
    delta: str


class _InputDone(_InItem, kw_only=True, tag="response.custom_tool_call_input.done"):
    input: str


def _lifecycle(name: str) -> type[_Lifecycle]:
    return msgspec.defstruct(  # type: ignore[return-value]
        "_Lifecycle", [], bases=(_Lifecycle,), kw_only=True, tag=name
    )


def _item_event(name: str) -> type[_ItemEvent]:
    return msgspec.defstruct(  # type: ignore[return-value]
        "_ItemEvent", [], bases=(_ItemEvent,), kw_only=True, tag=name
    )


def _part_event(name: str) -> type[_PartEvent]:
    return msgspec.defstruct(  # type: ignore[return-value]
        "_PartEvent", [], bases=(_PartEvent,), kw_only=True, tag=name
    )


_CREATED: Final = _lifecycle("response.created")
_IN_PROGRESS: Final = _lifecycle("response.in_progress")
_COMPLETED: Final = _lifecycle("response.completed")
_INCOMPLETE: Final = _lifecycle("response.incomplete")
_FAILED: Final = _lifecycle("response.failed")
_ITEM_ADDED: Final = _item_event("response.output_item.added")
_ITEM_DONE: Final = _item_event("response.output_item.done")
_PART_ADDED: Final = _part_event("response.content_part.added")
_PART_DONE: Final = _part_event("response.content_part.done")

PartKind = Literal["output_text", "refusal", "reasoning_text"]


@functools.cache
def _event_head(kind: type[_Event]) -> bytes:
    """An event type's framing up to its data, made once per type (`sse_head`)."""
    return sse_head(str(kind.__struct_config__.tag))


# --- state -------------------------------------------------------------------------------


@dataclass(slots=True)
class _Call(StreamedCall):
    """One tool call of the stream (Rule 4)."""

    tool: CallerTool | None = None
    output_index: int | None = None  # its item, once added
    item_id: str = ""
    call_id: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Item:
    """The open output item."""

    kind: Literal["message", "reasoning", "call"]
    output_index: int
    item_id: str
    parts: list[OutputText | Refusal | ReasoningText] = field(default_factory=list)
    part: PartKind | None = None  # the open content part
    pieces: list[str] = field(default_factory=list)  # its text so far
    call: _Call | None = None


class ResponsesStream(ChatStreamTranslator[_Call]):
    """Translates one run's chat stream into Responses events (module docstring); the
    stream is read, tool-call fragments included, as `chat_stream` says."""

    _PROTOCOL = "Responses"
    _CONTAINER = "item"

    def __init__(
        self,
        reply_model: str,
        request_id: str,
        request: bytes | ResponsesRequest,
        *,
        clock: Callable[[], float] = time.time,
        stored: bool = False,
        previous_response_id: str | None = None,
    ) -> None:
        """`stored`: the Edge stores the response, which then says `store: true`;
        `previous_response_id`: the one the caller continues (`responses_reply` Rule 1)."""
        super().__init__(request_id)
        self._shell = ResponseShell(
            reply_model,
            request_id,
            request,
            clock,
            stored=stored,
            previous_response_id=previous_response_id,
        )
        self._sequence = 0
        self._output: list[OutputItem] = []  # closed items, by output index
        self._open: _Item | None = None
        self._final: bytes | None = None

    def finish(self, usage: TokenUsage | None = None) -> bytes:
        """The closing events (Rule 5). `usage` counts only when the runtime reported
        none in its chunks."""
        out = self._start_if_silent()
        self._check_calls_named()
        status, incomplete = status_of(self._finish_reason)
        self._close(out, "incomplete" if status == "incomplete" else "completed")
        self._ended = True
        counts = self._usage or usage or TokenUsage()
        self._final = self._shell.body(status, self._output, counts, incomplete=incomplete)
        kind = _COMPLETED if status == "completed" else _INCOMPLETE
        response = msgspec.Raw(self._final)
        out.append(self._emit(kind(sequence_number=self._next(), response=response)))
        return b"".join(out)

    def fail(self, message: str, code: str) -> bytes:
        """`response.failed` for a failure after the stream began, with the items output
        so far (the open one `incomplete`). Nothing follows it."""
        out = self._start_if_silent()
        output = list(self._output)
        if self._open is not None:
            try:
                output.append(self._snapshot(self._open, "incomplete"))
            except ReplyTranslationError:
                pass  # a custom call whose input cannot be read: the failure says enough
        self._ended = True
        self._final = self._shell.body("failed", output, self._usage, error=failure(message, code))
        response = msgspec.Raw(self._final)
        out.append(self._emit(_FAILED(sequence_number=self._next(), response=response)))
        return b"".join(out)

    def final_response(self) -> bytes:
        """The response object the stream ended with (after `finish` or `fail`)."""
        if self._final is None:
            raise RuntimeError("the Responses stream has not ended")
        return self._final

    # --- events ---------------------------------------------------------------------------

    def _next(self) -> int:
        number = self._sequence
        self._sequence += 1
        return number

    @staticmethod
    def _emit(event: _Event) -> bytes:
        return _event_head(type(event)) + encode(event) + b"\n\n"

    def _start(self, out: list[bytes]) -> None:
        self._started = True
        body = msgspec.Raw(self._shell.body("in_progress", [], None))
        out.append(self._emit(_CREATED(sequence_number=self._next(), response=body)))
        out.append(self._emit(_IN_PROGRESS(sequence_number=self._next(), response=body)))

    # --- items ----------------------------------------------------------------------------

    def _add(
        self, kind: Literal["message", "reasoning", "call"], prefix: str, out: list[bytes]
    ) -> _Item:
        self._close(out, "completed")
        index = len(self._output)
        item = _Item(
            kind=kind, output_index=index, item_id=item_id(prefix, self._request_id, index)
        )
        self._open = item
        return item

    def _close(self, out: list[bytes], status: Status) -> None:
        """Close the open item: its part's `.done` events, then `output_item.done`."""
        item = self._open
        if item is None:
            return
        self._close_part(item, out)
        call = item.call
        if call is not None:
            self._close_call(item, call, out, status)
        done = self._snapshot(item, status)
        out.append(
            self._emit(
                _ITEM_DONE(sequence_number=self._next(), output_index=item.output_index, item=done)
            )
        )
        self._output.append(done)
        self._open = None

    def _snapshot(self, item: _Item, status: Status) -> OutputItem:
        """The item as it stands (its open part included)."""
        parts = list(item.parts)
        if item.part is not None:
            parts.append(_part(item.part, "".join(item.pieces)))
        if item.kind == "message":
            content = [part for part in parts if not isinstance(part, ReasoningText)]
            return MessageItem(id=item.item_id, status=status, content=content)
        if item.kind == "reasoning":
            texts = [part for part in parts if isinstance(part, ReasoningText)]
            return ReasoningItem(id=item.item_id, content=texts)
        call = item.call
        assert call is not None and call.tool is not None
        return call_item(
            call.tool,
            item.item_id,
            call.call_id,
            "".join(call.arguments),
            param=f"choices[0].delta.tool_calls[{call.position}].function.arguments",
            status=status,
        )

    # --- text -----------------------------------------------------------------------------

    def _say(
        self, thinking: str | None, content: str | None, refusal: str | None, out: list[bytes]
    ) -> None:
        """A delta's text, in the order a model produces it (Rule 2)."""
        if thinking:
            self._text("reasoning", "reasoning_text", thinking, out)
        if content:
            self._text("message", "output_text", content, out)
        if refusal:
            self._text("message", "refusal", refusal, out)

    def _text(
        self, kind: Literal["message", "reasoning"], part: PartKind, text: str, out: list[bytes]
    ) -> None:
        item = self._open
        if item is None or item.kind != kind:
            item = self._add(kind, "msg" if kind == "message" else "rs", out)
            added: OutputItem = (
                MessageItem(id=item.item_id, status="in_progress", content=[])
                if kind == "message"
                else ReasoningItem(id=item.item_id, content=[])
            )
            out.append(
                self._emit(
                    _ITEM_ADDED(
                        sequence_number=self._next(), output_index=item.output_index, item=added
                    )
                )
            )
        if item.part != part:
            self._close_part(item, out)
            item.part = part
            out.append(
                self._emit(
                    _PART_ADDED(
                        sequence_number=self._next(),
                        item_id=item.item_id,
                        output_index=item.output_index,
                        content_index=len(item.parts),
                        part=_part(part, ""),
                    )
                )
            )
        item.pieces.append(text)
        event = _DELTAS[part](
            sequence_number=self._next(),
            item_id=item.item_id,
            output_index=item.output_index,
            content_index=len(item.parts),
            delta=text,
        )
        out.append(self._emit(event))

    def _close_part(self, item: _Item, out: list[bytes]) -> None:
        if item.part is None:
            return
        text = "".join(item.pieces)
        seq, item_id_, output_index, index = (
            self._next(),
            item.item_id,
            item.output_index,
            len(item.parts),
        )
        done: _Event
        if item.part == "output_text":
            done = _TextDone(
                sequence_number=seq,
                item_id=item_id_,
                output_index=output_index,
                content_index=index,
                text=text,
            )
        elif item.part == "refusal":
            done = _RefusalDone(
                sequence_number=seq,
                item_id=item_id_,
                output_index=output_index,
                content_index=index,
                refusal=text,
            )
        else:
            done = _ReasoningDone(
                sequence_number=seq,
                item_id=item_id_,
                output_index=output_index,
                content_index=index,
                text=text,
            )
        out.append(self._emit(done))
        whole = _part(item.part, text)
        part_done = _PART_DONE(
            sequence_number=self._next(),
            item_id=item_id_,
            output_index=output_index,
            content_index=index,
            part=whole,
        )
        out.append(self._emit(part_done))
        item.parts.append(whole)
        item.part = None
        item.pieces = []

    # --- tool calls -----------------------------------------------------------------------

    def _new_call(self, position: int) -> _Call:
        return _Call(position=position)

    def _streaming_call(self) -> _Call | None:
        return self._open.call if self._open is not None else None

    def _open_call(self, call: _Call, out: list[bytes]) -> None:
        assert call.name is not None
        tool = call.tool = self._shell.tools.caller(call.name)
        item = self._add("call", "ctc" if tool.custom else "fc", out)
        item.call = call
        call.output_index = item.output_index
        call.item_id = item.item_id
        call.call_id = call_id(call.id, self._request_id, call.position, self._ids)
        namespace = tool.namespace if tool.namespace is not None else msgspec.UNSET
        added: OutputItem
        if tool.custom:
            added = CustomCallItem(
                id=call.item_id, call_id=call.call_id, name=tool.name, input="", namespace=namespace
            )
        else:
            added = FunctionCallItem(
                id=call.item_id,
                status="in_progress",
                call_id=call.call_id,
                name=tool.name,
                arguments="",
                namespace=namespace,
            )
        out.append(
            self._emit(
                _ITEM_ADDED(
                    sequence_number=self._next(), output_index=item.output_index, item=added
                )
            )
        )

    def _arguments(self, call: _Call, text: str, out: list[bytes]) -> None:
        call.arguments.append(text)
        assert call.tool is not None and call.output_index is not None
        if not call.tool.custom:  # a custom tool's input is sent whole at the close
            event = _ArgumentsDelta(
                sequence_number=self._next(),
                item_id=call.item_id,
                output_index=call.output_index,
                delta=text,
            )
            out.append(self._emit(event))

    def _close_call(self, item: _Item, call: _Call, out: list[bytes], status: Status) -> None:
        """`status`: `incomplete` when the output limit cut the call (Rule 5)."""
        assert call.tool is not None and call.output_index is not None
        call.closed = True
        if not "".join(call.arguments).strip() and not call.tool.custom:
            self._arguments(call, "{}", out)
        done = self._snapshot(item, status)
        item_id_, output_index = call.item_id, call.output_index
        if isinstance(done, CustomCallItem):
            if done.input:
                delta = _InputDelta(
                    sequence_number=self._next(),
                    item_id=item_id_,
                    output_index=output_index,
                    delta=done.input,
                )
                out.append(self._emit(delta))
            finished: _Event = _InputDone(
                sequence_number=self._next(),
                item_id=item_id_,
                output_index=output_index,
                input=done.input,
            )
        else:
            assert isinstance(done, FunctionCallItem)
            finished = _ArgumentsDone(
                sequence_number=self._next(),
                item_id=item_id_,
                output_index=output_index,
                name=done.name,
                arguments=done.arguments,
            )
        out.append(self._emit(finished))


def _part(kind: PartKind, text: str) -> OutputText | Refusal | ReasoningText:
    if kind == "output_text":
        return OutputText(text=text)
    if kind == "refusal":
        return Refusal(refusal=text)
    return ReasoningText(text=text)
