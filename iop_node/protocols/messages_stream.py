"""A chat completion stream as an Anthropic Messages stream, chunk by chunk.

`MessagesStream` is a pure state machine, one per run: `feed` takes one chat chunk (the
`data:` payload) and returns the Messages events it completes, already framed
(`event: NAME\\ndata: {...}\\n\\n`); `finish` closes the message; `fail` ends it with an
`error` event. The rules are the ones gateways that translate in the middle get wrong:

1. Exactly one `message_start`, first, before anything else (on the first chunk, or at
   `finish`/`fail` if the runtime said nothing at all).
2. One content block is open at a time. Reasoning (`reasoning_content` or `reasoning`)
   goes in a `thinking` block, text in a `text` block, each tool call in its own
   `tool_use` block: a switch of kind (or a new tool call) closes the open block and
   opens the next index. Thinking never lands in a text block; a tool call never
   arrives as text.
3. Tool-call argument fragments are relayed as `input_json_delta` as they arrive, never
   held back to the end and never dropped. A call whose name has not arrived yet keeps
   its fragments until it has one (`content_block_start` needs the name). A runtime
   that repeats the name or id in every fragment does not get them doubled. A call
   that sent no arguments at all gets `{}` (an empty input is no JSON to parse).
   Parallel calls are told apart by the chat `tool_calls[].index`; a fragment for a
   call whose block was already closed (an upstream interleaving two calls'
   arguments, which no runtime we know does) cannot be placed in a Messages stream and
   is a `ReplyTranslationError`, not a silent loss.
   A call's block closes only on arguments that form a JSON object (Messages carries
   `input` as one, as the whole reply's `tool_input` checks): fragments that do not
   are a `ReplyTranslationError` when the block would close, so the stream ends with an
   `error` event, never with a `message_stop` after invalid `partial_json`; except the
   call the output limit cut, closed by `finish` as it stands (`max_tokens`: an
   incomplete `tool_use`, as Anthropic ends such a stream).
4. `finish` closes the open block, then `message_delta` (stop reason as
   `chat_view.stop_reason` maps it, usage) and `message_stop`. Usage is the runtime's
   own numbers when it reported them in a chunk; `finish(usage)` is the fallback (an
   estimate) for a runtime that did not. `message_start` carries the prompt's tokens as
   far as they are known before the runtime answers (`input_tokens`: the caller's
   count or estimate), and `message_delta` the input counts again, the runtime's, which
   the SDKs put in place of the first.
5. Empty strings open nothing: a runtime's first chunk (`"role": "assistant",
   "content": ""`) does not make an empty text block.
6. Events carry every member Anthropic's SDKs declare always present, as the whole
   message does (`messages_reply` Rule 5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from iop_node.protocols.chat_body import encode, sse_event
from iop_node.protocols.chat_stream import ChatStreamTranslator, StreamedCall
from iop_node.protocols.chat_view import TokenUsage, stop_reason
from iop_node.protocols.messages_reply import (
    DIRECT,
    AnthropicUsage,
    DeltaUsage,
    DirectCaller,
    Message,
    TextBlock,
    ThinkingBlock,
    tool_input,
    tool_use_id,
)
from schemas.protocols import error_body

__all__ = ["MessagesStream", "message_start"]


# --- events ------------------------------------------------------------------------------


class _MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: Message


class _ToolUseStart(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, str]
    caller: DirectCaller = DIRECT


class _BlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: TextBlock | ThinkingBlock | _ToolUseStart


class _TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class _ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class _JsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class _BlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: _TextDelta | _ThinkingDelta | _JsonDelta


class _BlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class _Stop(msgspec.Struct):
    stop_reason: str
    stop_sequence: str | None
    stop_details: None = None
    container: None = None


class _MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: _Stop
    usage: DeltaUsage


_MESSAGE_STOP: Final = sse_event("message_stop", b'{"type":"message_stop"}')

#: IOP failure codes that are a load signal: Anthropic's `overloaded_error` (529).
_OVERLOADED: Final = frozenset({"busy", "upstream_busy"})


def _event(name: str, event: msgspec.Struct) -> bytes:
    return sse_event(name, encode(event))


def message_start(reply_model: str, request_id: str, counts: TokenUsage) -> bytes:
    """The framed `message_start` of a reply to `request_id`: no content yet, the
    prompt's tokens as `counts` has them (Rule 1). A native stream that began without one
    gets this one too (`iop_node.adapters.native` Rule 7)."""
    usage = AnthropicUsage.of(
        TokenUsage(prompt_tokens=counts.prompt_tokens, cached_tokens=counts.cached_tokens)
    )
    message = Message(id=f"msg_{request_id}", model=reply_model, content=[], usage=usage)
    return _event("message_start", _MessageStart(message=message))


# --- state -------------------------------------------------------------------------------

Kind = Literal["text", "thinking", "tool_use"]


@dataclass(slots=True)
class _Call(StreamedCall):
    """One tool call of the stream (Rule 3)."""

    index: int | None = None  # its content block, once open
    sent: bool = False  # some argument bytes went out
    arguments: list[str] = field(default_factory=list)  # what went out, checked at the close


class MessagesStream(ChatStreamTranslator[_Call]):
    """Translates one run's chat stream into Messages events (module docstring); the
    stream is read, tool-call fragments included, as `chat_stream` says."""

    _PROTOCOL = "Messages"
    _CONTAINER = "block"

    def __init__(self, reply_model: str, request_id: str, *, input_tokens: int = 0) -> None:
        super().__init__(request_id)
        self._model = reply_model
        self._input_tokens = input_tokens
        """What `message_start` reports before the runtime's usage is known (an estimate
        the caller may pass; the final `message_delta` carries the real count)."""
        self._next_index = 0
        self._open_kind: Kind | None = None
        self._open_index = 0
        self._streaming: _Call | None = None

    def finish(self, usage: TokenUsage | None = None) -> bytes:
        """The closing events (Rule 4). `usage` counts only when the runtime reported
        none in its chunks."""
        out = self._start_if_silent()
        self._check_calls_named()
        self._close(out, cut=self._finish_reason == "length")
        self._ended = True
        reason, sequence = stop_reason(
            self._finish_reason, called_tools=bool(self._calls), matched=self._matched
        )
        counts = self._usage or usage or TokenUsage()
        delta = _MessageDelta(
            delta=_Stop(stop_reason=reason, stop_sequence=sequence),
            usage=DeltaUsage.of(counts),
        )
        out.append(_event("message_delta", delta))
        out.append(_MESSAGE_STOP)
        return b"".join(out)

    def fail(self, message: str, code: str) -> bytes:
        """An `error` event for a failure after the stream began (Anthropic's shape: the
        SDKs raise it as an API error). Nothing follows it."""
        self._check_live()
        self._ended = True
        status = 529 if code in _OVERLOADED else 500
        return sse_event(
            "error",
            error_body("messages", status, message, code=code, request_id=self._request_id),
        )

    # --- blocks ---------------------------------------------------------------------------

    def _start(self, out: list[bytes]) -> None:
        self._started = True
        counts = self._usage or TokenUsage(prompt_tokens=self._input_tokens)
        out.append(message_start(self._model, self._request_id, counts))

    def _open(
        self, kind: Kind, block: TextBlock | ThinkingBlock | _ToolUseStart, out: list[bytes]
    ) -> int:
        self._close(out)
        index = self._next_index
        self._next_index += 1
        self._open_kind, self._open_index = kind, index
        out.append(_event("content_block_start", _BlockStart(index=index, content_block=block)))
        return index

    def _close(self, out: list[bytes], *, cut: bool = False) -> None:
        if self._open_kind is None:
            return
        call = self._streaming
        if call is not None:
            if not call.sent:
                self._arguments(call, "{}", out)
            # Rule 3: what went out as `partial_json` must add up to the `input` object,
            # unless the output limit cut it (`cut`).
            tool_input(
                "".join(call.arguments),
                f"choices[0].delta.tool_calls[{call.position}].function.arguments",
                cut=cut,
            )
            call.closed = True
            self._streaming = None
        out.append(_event("content_block_stop", _BlockStop(index=self._open_index)))
        self._open_kind = None

    def _say(
        self, thinking: str | None, content: str | None, refusal: str | None, out: list[bytes]
    ) -> None:
        """A delta's text, in the order a model produces it (Rule 2)."""
        if thinking:
            self._text("thinking", thinking, out)
        if content:
            self._text("text", content, out)
        if refusal:
            self._text("text", refusal, out)

    def _text(self, kind: Literal["text", "thinking"], text: str, out: list[bytes]) -> None:
        if self._open_kind != kind:
            block = TextBlock(text="") if kind == "text" else ThinkingBlock(thinking="")
            self._open(kind, block, out)
        delta = _TextDelta(text=text) if kind == "text" else _ThinkingDelta(thinking=text)
        out.append(_event("content_block_delta", _BlockDelta(index=self._open_index, delta=delta)))

    # --- tool calls -----------------------------------------------------------------------

    def _new_call(self, position: int) -> _Call:
        return _Call(position=position)

    def _streaming_call(self) -> _Call | None:
        return self._streaming

    def _open_call(self, call: _Call, out: list[bytes]) -> None:
        assert call.name is not None
        identifier = tool_use_id(call.id, self._request_id, call.position, self._ids)
        start = _ToolUseStart(id=identifier, name=call.name, input={})
        call.index = self._open("tool_use", start, out)
        self._streaming = call

    def _arguments(self, call: _Call, text: str, out: list[bytes]) -> None:
        call.sent = True
        call.arguments.append(text)
        assert call.index is not None
        delta = _BlockDelta(index=call.index, delta=_JsonDelta(partial_json=text))
        out.append(_event("content_block_delta", delta))
