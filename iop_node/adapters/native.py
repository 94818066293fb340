"""A caller protocol's reply relayed as the upstream wrote it, but for the model name
(design §14, native first): what an adapter does to each event of a native Messages or
Responses stream, and to a native non-stream body. What differs between the protocols
is their `NativeForm` (`iop_node.protocols.native`), which the run's translator gives.

Rules:
1. Bytes pass through. The protocol's reader (the form's: `iop_node.protocols
   .MessagesNative`, `ResponsesNative`) writes the caller's alias where the protocol
   puts the model (and, for a Responses run the Edge stores, `store: true`: Rule 5)
   and reads the usage; it parses only the few events that carry them, named by their
   SSE event name.
   Everything else is relayed untouched.
2. Events leave framed as the protocol frames them, `event: NAME\\ndata: JSON\\n\\n`. An
   upstream that leaves the `event:` line out is read by the data's `type`. Data an
   upstream spread over several `data:` lines (valid SSE: the decoder joined them with
   line breaks) leaves as several `data:` lines too, so the caller's decoder joins it
   back.
3. A stream has ended well at its protocol's last event (the form's `ends`:
   `message_stop`; `response.completed` or `response.incomplete`). An in-band error (`error`,
   `response.failed`, or an event with no name and no `type` that holds an `error`, as
   OpenAI-style servers send one) raises `InBandError` with the upstream's message: the
   events before it were relayed, the error itself is for the run's failure to carry (the
   Edge words it in the caller's protocol). So does a whole (non-stream) body that is an
   error (`type: error`, or an `error` object in a body that is not the protocol's
   reply); a body that is neither the protocol's reply (the form's `answers`: Messages'
   `type: message`, Responses' `object: response`) nor an error is `NotAnObject`, as
   a body that is no JSON object is.
4. Each delta event counts as one output token, for the estimate of a stream whose usage
   never came (a cut stream): engines stream about a token per event, and no delta is
   parsed to count it.
5. `keep_output`: the object of the Responses stream's last event, as the caller saw it,
   is kept for `run_done.response` (the Edge stores it). The caller asked for `store:
   true` and the runtime was sent `store: false` (the Edge is the store): the reply's
   `store` says true again, and its `id` is IOP's `resp_<request id>` (the Edge stores it
   under that id), never the upstream's.
6. `hold_tail`: the events that tell the caller its reply is whole (the form's `tail`:
   `message_delta` and `message_stop`; `response.completed`, `response.incomplete`) are
   held back, not returned, for the run's end to carry (`run_done.tail`, written by the Edge once it
   recorded the end: a caller may hang up the moment it reads them). An event that is not
   one of them, after some were held, takes them out with it, in order, so nothing is
   reordered and the held part stays one event or two. A stream that breaks off
   `release`s them as ordinary events.
7. A stream begins with the protocol's opening event (the form's `opens`: Messages'
   `message_start`). An upstream whose stream begins with another event (llama.cpp's
   server does, now and then, under load) gets the form's `opening` written ahead of
   it: the caller's SDK reads a conformant stream, and the upstream's usage still
   counts where it comes.

Pure: no I/O. The adapter feeds events from its SSE decoder and sends what comes out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import msgspec

from iop_node import tracing
from iop_node.protocols import TokenUsage
from iop_node.protocols.native import NativeForm, NativeReader
from schemas.wire import Run, Usage

__all__ = ["InBandError", "NativeReply", "NotAnObject"]


class NotAnObject(ValueError):
    """An event's data, or a body, is not a JSON object: the upstream's output is broken."""


class InBandError(Exception):
    """The upstream reported an error inside a successful answer (Rule 3)."""


class _Type(msgspec.Struct):
    type: str | None = None


class _Shape(msgspec.Struct):
    """What tells a whole body's kind: the protocol's reply, or an error (Rule 3)."""

    type: str | None = None
    object: str | None = None
    error: msgspec.Raw = msgspec.Raw()


class _Error(msgspec.Struct):
    message: str | None = None


class _ErrorEvent(msgspec.Struct):
    """Anthropic's `error` event (`error.message`), OpenAI's (`message`)."""

    error: _Error | None = None
    message: str | None = None


class _Failed(msgspec.Struct):
    error: _Error | None = None


class _FailedEvent(msgspec.Struct):
    response: _Failed | None = None


_decode_type: Final = msgspec.json.Decoder(_Type).decode
_decode_shape: Final = msgspec.json.Decoder(_Shape).decode
_decode_error_event: Final = msgspec.json.Decoder(_ErrorEvent).decode
_decode_failed_event: Final = msgspec.json.Decoder(_FailedEvent).decode
_decode_fields: Final = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode

_ERRORS: Final = frozenset({"error", "response.failed"})


def _holds_error(data: bytes) -> bool:
    """Whether an untyped event's data is an error object (`{"error": {...}}`)."""
    try:
        shape = _decode_shape(data)
    except (msgspec.DecodeError, RecursionError):
        return False
    return _an_error(shape.error)


def _an_error(raw: msgspec.Raw) -> bool:
    """Whether a body's `error` member is there and not `null`."""
    return bool(raw) and raw != b"null"


_UNKNOWN: Final = "unknown error"


def _error_message(data: bytes, name: str) -> str:
    """The upstream's words in an in-band error event (Rule 3)."""
    try:
        if name == "response.failed":
            failed = _decode_failed_event(data).response
            error = failed.error if failed is not None else None
            return (error.message if error is not None else None) or _UNKNOWN
        event = _decode_error_event(data)
    except (msgspec.DecodeError, RecursionError):
        return _UNKNOWN
    if event.error is not None and event.error.message:
        return event.error.message
    return event.message or _UNKNOWN


class NativeReply:
    """One run's native reply, shaped for its caller (see the module rules)."""

    __slots__ = (
        "_answers",
        "_ends",
        "_held",
        "_keep",
        "_opening",
        "_reader",
        "_run",
        "_tail",
        "_traced_model",
        "ended",
        "final_response",
    )

    def __init__(self, run: Run, form: NativeForm) -> None:
        self._keep = run.keep_output and form.keeps_output
        self._reader: NativeReader = form.reader(run)
        self._answers = form.answers
        self._ends = form.ends
        self._tail = form.tail if run.hold_tail else frozenset[str]()
        self._held: list[bytes] = []
        self._run = run
        self._opening: tuple[str, Callable[[Run], bytes]] | None = (
            (form.opens, form.opening) if form.opens and form.opening is not None else None
        )
        """Until the stream's first event: what it must begin with (Rule 7)."""
        self.ended = False
        """The stream's last event went by (Rule 3)."""
        self.final_response: bytes | None = None
        """With `run.keep_output`: the final response object of a Responses stream."""
        self._traced_model = False
        """The model the upstream answered as went to the run's trace."""

    @property
    def usage(self) -> Usage | None:
        """The usage the upstream reported so far, in the wire's counts."""
        return _wire_usage(self._reader.usage)

    def response(self, body: bytes) -> bytes:
        """A whole non-stream body with the caller's alias (`NotAnObject` when the body
        is not a JSON object)."""
        if body.lstrip()[:1] != b"{":
            raise NotAnObject("the response is not a JSON object")
        try:
            shape = _decode_shape(body)
        except (msgspec.DecodeError, RecursionError):
            raise NotAnObject("the response is not a JSON object") from None
        member, value = self._answers
        if getattr(shape, member) != value:  # Rule 3: an error, or no reply at all
            if shape.type == "error" or _an_error(shape.error):
                raise InBandError(_error_message(body, "error"))
            raise NotAnObject(f"the response is not a reply ({member} is not {value!r})")
        shaped = self._reader.response(body)
        self._trace_model()
        return shaped

    def event(self, name: str, data: bytes) -> tuple[bytes, int]:
        """One upstream event as the caller's framed events to send now (b"" when it is
        held back, with the events held before it when it is not: Rule 6), and the output
        tokens it carries (Rule 4)."""
        if name == "message":  # no `event:` line (Rule 2)
            name = self._type_of(data)
            if name == "message" and _holds_error(data):
                name = "error"  # OpenAI-style `{"error": {...}}` (Rule 3)
        if name in _ERRORS:
            raise InBandError(_error_message(data, name))
        opening = b""
        if self._opening is not None:
            opens, make = self._opening
            self._opening = None
            if name != opens:
                opening = make(self._run)
        shaped = self._reader.event(data, name)
        if not self._traced_model:
            self._trace_model()
        if name in self._ends:
            self.ended = True
            if self._keep:
                self.final_response = self._final(shaped)
        tokens = 1 if name == "content_block_delta" or name.endswith(".delta") else 0
        if b"\n" in shaped:  # data that came in several `data:` lines (Rule 2)
            shaped = b"\ndata: ".join(shaped.split(b"\n"))
        framed = b"event: " + name.encode() + b"\ndata: " + shaped + b"\n\n"
        if name in self._tail:
            self._held.append(framed)
            return opening, tokens
        if self._held:
            framed = self.release() + framed
        return opening + framed, tokens

    def _trace_model(self) -> None:
        """Tell the run's trace the model the upstream answered as, once it is known."""
        model = self._reader.upstream_model
        if model is not None:
            self._traced_model = True
            tracing.answered_as(model)

    def release(self) -> bytes:
        """The events held back so far (Rule 6), framed, and no longer held; b"" when
        none are: the run's `tail` once the stream ended well, else what the caller
        still gets ahead of the failure."""
        held, self._held = self._held, []
        return b"".join(held)

    @staticmethod
    def _type_of(data: bytes) -> str:
        try:
            kind = _decode_type(data).type
        except (msgspec.DecodeError, RecursionError):
            raise NotAnObject("an event is not a JSON object") from None
        return kind or "message"

    @staticmethod
    def _final(data: bytes) -> bytes | None:
        try:
            response = _decode_fields(data).get("response")
        except (msgspec.DecodeError, RecursionError):
            raise NotAnObject("the last event is not a JSON object") from None
        return None if response is None else bytes(response)


def _wire_usage(usage: TokenUsage | None) -> Usage | None:
    if usage is None:
        return None
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
    )
