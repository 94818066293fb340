"""What both stream translators read of a chat stream: its chunks, and its tool calls
put together from their fragments.

`ChatStreamTranslator` is the half `MessagesStream` and `ResponsesStream` share; each
says in its own events what it is told (`_start`, `_say`, `_open_call`, `_arguments`).
The rules of reading are the same for both protocols, so they live here once:

1. The start events come first, once: on the first chunk, or at the end if the runtime
   said nothing at all (`_start_if_silent`).
2. A chunk of text only that the relay has read already (`ReadChunk`) is not decoded
   again; any other chunk is read whole. The runtime's usage, when a chunk carries it,
   replaces what was known; the finish reason (and vLLM's matched stop string) is kept
   for the end.
3. Tool calls are told apart by the chat `tool_calls[].index`; a fragment without one
   (some runtimes leave it out) belongs to the call of its id, else to the call being
   streamed. A runtime that repeats the name or id in every fragment does not get them
   doubled.
4. A call's block or item opens once its name is known (the opening event needs it);
   argument fragments that came before are held until then, then relayed in order, and
   every later one as it arrives: never held back to the end, never dropped.
5. A fragment for a call whose block or item was already closed (an upstream
   interleaving two calls' arguments, which no runtime we know does) cannot be placed
   in either protocol's stream: a `ReplyTranslationError`, not a silent loss. So is a
   call that never said which tool it calls, at the end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

from iop_node.protocols.chat_view import (
    ChatChunk,
    ReadChunk,
    TokenUsage,
    ToolCallDelta,
    read_chunk,
    text_delta,
)
from iop_node.protocols.errors import ReplyTranslationError

__all__ = ["ChatStreamTranslator", "StreamedCall"]


@dataclass(slots=True)
class StreamedCall:
    """One tool call of a stream, as its fragments have told it so far (Rules 3-5)."""

    position: int  # the chat `tool_calls[].index`
    id: str | None = None
    name: str | None = None
    opened: bool = False  # its block or item has begun
    closed: bool = False
    held: list[str] = field(default_factory=list)  # fragments before the name came


CallT = TypeVar("CallT", bound=StreamedCall)


class ChatStreamTranslator(ABC, Generic[CallT]):
    """Reads one run's chat stream for a protocol's translator (module docstring)."""

    _PROTOCOL: ClassVar[str]
    """The caller protocol, as its errors name it ("Messages")."""
    _CONTAINER: ClassVar[str]
    """What a tool call is sent in ("block")."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self._started = False
        self._ended = False
        self._calls: dict[int, CallT] = {}
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
                self._start(out)
            self._say(text.thinking, text.content, text.refusal, out)
            return b"".join(out)
        view: ChatChunk = read_chunk(chunk)
        counts = view.tokens()
        if counts is not None:
            self._usage = counts
        if not self._started:
            self._start(out)
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

    # --- what each protocol says ------------------------------------------------------------

    @abstractmethod
    def _start(self, out: list[bytes]) -> None:
        """The start events (Rule 1); sets `_started`."""

    @abstractmethod
    def _say(
        self, thinking: str | None, content: str | None, refusal: str | None, out: list[bytes]
    ) -> None:
        """A delta's text, in the order a model produces it."""

    @abstractmethod
    def _new_call(self, position: int) -> CallT:
        """A call first seen at chat index `position`."""

    @abstractmethod
    def _streaming_call(self) -> CallT | None:
        """The call whose block or item is open, if any."""

    @abstractmethod
    def _open_call(self, call: CallT, out: list[bytes]) -> None:
        """Begin a named call's block or item (Rule 4)."""

    @abstractmethod
    def _arguments(self, call: CallT, text: str, out: list[bytes]) -> None:
        """Relay an argument fragment of an open call."""

    # --- the shared reading -----------------------------------------------------------------

    def _check_live(self) -> None:
        if self._ended:
            raise RuntimeError(f"the {self._PROTOCOL} stream has already ended")

    def _start_if_silent(self) -> list[bytes]:
        """The events an end begins with: the start, when the runtime said nothing (Rule 1)."""
        self._check_live()
        out: list[bytes] = []
        if not self._started:
            self._start(out)
        return out

    def _check_calls_named(self) -> None:
        """Rule 5, at the end: every call said which tool it calls."""
        for call in self._calls.values():
            if call.name is None:
                raise ReplyTranslationError(
                    f"the runtime's tool call {call.position} never said which tool it calls",
                    param=f"choices[0].delta.tool_calls[{call.position}].function.name",
                )

    def _tool(self, fragment: ToolCallDelta, param: str, out: list[bytes]) -> None:
        """Rules 3-5 for one fragment."""
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
                    f"call began; a {self._PROTOCOL} stream cannot reopen its {self._CONTAINER}",
                    param=f"{param}.function.arguments",
                )
            return
        if not call.opened:
            if call.name is None:
                if arguments:
                    call.held.append(arguments)
                return
            streaming = self._streaming_call()
            try:
                self._open_call(call, out)
            except ReplyTranslationError as exc:
                if streaming is None or streaming is call:
                    raise
                raise ReplyTranslationError(
                    f"the runtime began tool call {call.position} before the arguments of "
                    f"tool call {streaming.position} formed a JSON object; a {self._PROTOCOL} "
                    f"stream carries one call's arguments at a time ({exc.reason})",
                    param=exc.param,
                ) from None
            call.opened = True
            held, call.held = call.held, []
            for piece in held:
                self._arguments(call, piece, out)
        if arguments:
            self._arguments(call, arguments, out)

    def _call_for(self, fragment: ToolCallDelta) -> CallT:
        """The call a fragment belongs to (Rule 3)."""
        position = fragment.index
        if position is None:
            if fragment.id:
                for known in self._calls.values():
                    if known.id == fragment.id:
                        return known
                position = len(self._calls)
            else:
                streaming = self._streaming_call()
                if streaming is not None:
                    return streaming
                position = max(self._calls) if self._calls else 0
        call = self._calls.get(position)
        if call is None:
            call = self._calls[position] = self._new_call(position)
        return call
