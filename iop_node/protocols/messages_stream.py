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
4. `finish` closes the open block, then `message_delta` (stop reason as
   `chat_view.stop_reason` maps it, usage) and `message_stop`. Usage is the runtime's
   own numbers when it reported them in a chunk; `finish(usage)` is the fallback (an
   estimate) for a runtime that did not.
5. Empty strings open nothing: a runtime's first chunk (`"role": "assistant",
   "content": ""`) does not make an empty text block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from iop_node.protocols.chat_body import encode, sse_event
from iop_node.protocols.chat_view import (
    ChatChunk,
    ReadChunk,
    TokenUsage,
    ToolCallDelta,
    read_chunk,
    stop_reason,
    text_delta,
)
from iop_node.protocols.errors import ReplyTranslationError
from iop_node.protocols.messages_reply import (
    AnthropicUsage,
    Message,
    TextBlock,
    ThinkingBlock,
    tool_use_id,
)
from schemas.protocols import error_body

__all__ = ["MessagesStream"]


# --- events ------------------------------------------------------------------------------


class _MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: Message


class _ToolUseStart(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, str]


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


class _MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: _Stop
    usage: AnthropicUsage


_MESSAGE_STOP: Final = sse_event("message_stop", b'{"type":"message_stop"}')

#: IOP failure codes that are a load signal: Anthropic's `overloaded_error` (529).
_OVERLOADED: Final = frozenset({"busy", "upstream_busy"})


def _event(name: str, event: msgspec.Struct) -> bytes:
    return sse_event(name, encode(event))


# --- state -------------------------------------------------------------------------------

Kind = Literal["text", "thinking", "tool_use"]


@dataclass(slots=True)
class _Call:
    """One tool call of the stream (Rule 3)."""

    position: int  # the chat `tool_calls[].index`
    id: str | None = None
    name: str | None = None
    index: int | None = None  # its content block, once open
    closed: bool = False
    sent: bool = False  # some argument bytes went out
    held: list[str] = field(default_factory=list)  # fragments before the name came


class MessagesStream:
    """Translates one run's chat stream into Messages events (module docstring)."""

    def __init__(self, reply_model: str, request_id: str, *, input_tokens: int = 0) -> None:
        self._model = reply_model
        self._request_id = request_id
        self._input_tokens = input_tokens
        """What `message_start` reports before the runtime's usage is known (an estimate
        the caller may pass; the final `message_delta` carries the real count)."""
        self._started = False
        self._ended = False
        self._next_index = 0
        self._open_kind: Kind | None = None
        self._open_index = 0
        self._open_call: _Call | None = None
        self._calls: dict[int, _Call] = {}
        self._ids: set[str] = set()
        self._finish_reason: str | None = None
        self._matched: str | int | None = None
        self._usage: TokenUsage | None = None

    @property
    def usage(self) -> TokenUsage | None:
        """The last usage the runtime reported in a chunk."""
        return self._usage

    def feed(self, chunk: bytes, read: ReadChunk | None = None) -> bytes:
        """The events one chat chunk (the `data:` payload) completes, possibly none.
        `read` is the relay's reading of it, if it has one: a chunk of text only is then
        not decoded again. After a `ReplyTranslationError` the stream can only `fail`."""
        self._check_live()
        out: list[bytes] = []
        text = text_delta(read) if read is not None else None
        if text is not None:
            if not self._started:
                out.append(self._start())
            self._say(text.thinking, text.content, text.refusal, out)
            return b"".join(out)
        view: ChatChunk = read_chunk(chunk)
        if view.usage is not None:
            self._usage = view.usage.tokens()
        if not self._started:
            out.append(self._start())
        choice = view.first()
        if choice is None:
            return b"".join(out)
        delta = choice.said
        if delta is not None:
            self._say(delta.thinking, delta.content, delta.refusal, out)
            for k, call in enumerate(delta.tool_calls or ()):
                self._tool(call, f"choices[0].delta.tool_calls[{k}]", out)
        if choice.finish_reason:
            self._finish_reason = choice.finish_reason
            self._matched = choice.stop_reason
        return b"".join(out)

    def finish(self, usage: TokenUsage | None = None) -> bytes:
        """The closing events (Rule 4). `usage` counts only when the runtime reported
        none in its chunks."""
        self._check_live()
        out: list[bytes] = []
        if not self._started:
            out.append(self._start())
        for call in self._calls.values():
            if call.name is None:
                raise ReplyTranslationError(
                    f"the runtime's tool call {call.position} never said which tool it calls",
                    param=f"choices[0].delta.tool_calls[{call.position}].function.name",
                )
        self._close(out)
        self._ended = True
        reason, sequence = stop_reason(
            self._finish_reason, called_tools=bool(self._calls), matched=self._matched
        )
        counts = self._usage or usage or TokenUsage()
        delta = _MessageDelta(
            delta=_Stop(stop_reason=reason, stop_sequence=sequence),
            usage=AnthropicUsage.of(counts),
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
        return sse_event("error", error_body("messages", status, message, code=code))

    # --- blocks ---------------------------------------------------------------------------

    def _check_live(self) -> None:
        if self._ended:
            raise RuntimeError("the Messages stream has already ended")

    def _start(self) -> bytes:
        self._started = True
        counts = self._usage or TokenUsage(prompt_tokens=self._input_tokens)
        usage = AnthropicUsage.of(
            TokenUsage(prompt_tokens=counts.prompt_tokens, cached_tokens=counts.cached_tokens)
        )
        message = Message(id=f"msg_{self._request_id}", model=self._model, content=[], usage=usage)
        return _event("message_start", _MessageStart(message=message))

    def _open(
        self, kind: Kind, block: TextBlock | ThinkingBlock | _ToolUseStart, out: list[bytes]
    ) -> int:
        self._close(out)
        index = self._next_index
        self._next_index += 1
        self._open_kind, self._open_index = kind, index
        out.append(_event("content_block_start", _BlockStart(index=index, content_block=block)))
        return index

    def _close(self, out: list[bytes]) -> None:
        if self._open_kind is None:
            return
        call = self._open_call
        if call is not None:
            if not call.sent:
                self._arguments(call, "{}", out)
            call.closed = True
            self._open_call = None
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

    def _tool(self, fragment: ToolCallDelta, param: str, out: list[bytes]) -> None:
        call = self._call_for(fragment)
        function = fragment.function
        if call.id is None and fragment.id:
            call.id = fragment.id
        if call.name is None and function is not None and function.name:
            call.name = function.name
        arguments = function.arguments if function is not None else None
        if call.closed:
            if arguments:
                raise ReplyTranslationError(
                    f"the runtime sent arguments for tool call {call.position} after another "
                    "call began; a Messages stream cannot reopen its block",
                    param=f"{param}.function.arguments",
                )
            return
        if call.index is None:
            if call.name is None:
                if arguments:
                    call.held.append(arguments)
                return
            identifier = tool_use_id(call.id, self._request_id, call.position, self._ids)
            start = _ToolUseStart(id=identifier, name=call.name, input={})
            call.index = self._open("tool_use", start, out)
            self._open_call = call
            held, call.held = call.held, []
            for piece in held:
                self._arguments(call, piece, out)
        if arguments:
            self._arguments(call, arguments, out)

    def _call_for(self, fragment: ToolCallDelta) -> _Call:
        """The call a fragment belongs to: by its chat index; without one (some runtimes
        leave it out), by its id, else the call being streamed."""
        position = fragment.index
        if position is None:
            if fragment.id:
                for known in self._calls.values():
                    if known.id == fragment.id:
                        return known
                position = len(self._calls)
            elif self._open_call is not None:
                return self._open_call
            else:
                position = max(self._calls) if self._calls else 0
        call = self._calls.get(position)
        if call is None:
            call = self._calls[position] = _Call(position=position)
        return call

    def _arguments(self, call: _Call, text: str, out: list[bytes]) -> None:
        call.sent = True
        assert call.index is not None
        delta = _BlockDelta(index=call.index, delta=_JsonDelta(partial_json=text))
        out.append(_event("content_block_delta", delta))
