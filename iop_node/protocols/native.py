"""A native Messages or Responses reply on its way to the caller: the alias, the usage.

A provider that speaks the caller's protocol gets the body as the caller sent it and
its reply goes back as it came (design §14), with two exceptions the Node owes every
caller (design §3): the `model` the caller sees is the alias it asked for, and the run's
usage is read for metering. A Responses reply the Edge stores (`stored`) also says
`store: true`, as its caller asked: the runtime was sent `store: false`, since the Edge
is the store (design §14), and echoes that. Every Responses reply's `id` is IOP's own
(`response_id`, the `resp_<request id>` a translated reply has too), not the upstream's,
stored or not: a caller sees one id scheme whichever runtime answered, and the Edge
stores a response under that id, so an upstream that reuses ids (a restarted runtime
counting from 1 again) cannot make two stored responses collide; and a reply continuing a stored
conversation echoes the caller's `previous_response_id`, which the Edge took out of the
body (it sends the conversation instead) and passed beside it. All of these live in a few
events only, so these readers parse only those, and only their top level plus the one
object below it that holds the model:

- Messages: `message_start` (`message.model`, `message.usage` with the input counts)
  and `message_delta` (`usage`, cumulative: output counts, sometimes input counts);
  the non-stream body (`model`, `usage`).
- Responses: the lifecycle events `response.created`, `.queued`, `.in_progress`,
  `.completed`, `.incomplete` and `.failed` (`response.model`, `response.store`,
  `response.previous_response_id`, `response.usage` on the last three); the non-stream
  body (`model`, `store`, `previous_response_id`, `usage`).
  A reply without `store` is left without it.

Every other event (the bulk: text and argument deltas) is returned as it is, unread
when the caller passes the SSE event name along, which is what a relay has in hand,
unless the runtime's Responses stream leaves out the indexes its readers need: a stream
whose first event has no `sequence_number` (llama.cpp's server numbers nothing) has
each event's `sequence_number`, an item event's `output_index` and a content event's
`content_index` filled in where missing, in the order the events came, so the official
SDKs' stream helpers, which index the response by them, read it.
Values are kept as raw JSON and written back untouched, so a 40 KB `tools` echo costs
a scan, not a decode and re-encode.

`ResponsesNative.final_response` keeps the response object a stream ended with, for the
Edge to store (`store: true`).

An empty alias (`""`) keeps the upstream's `model`.

Usage is read into `TokenUsage`, chat completions' convention: Anthropic's
`input_tokens` excludes cached input, so prompt tokens are input + cache read + cache
creation there. A Messages reply that never says its input counts (a stream that began
without `message_start`, as llama.cpp's server's sometimes does) reports no usage: the
run is metered by estimate (`usage_source: estimated`), never at 0 prompt tokens.

`NativeForm` is what an adapter needs to know of a protocol to relay it natively (its
path, headers, reader and last events); each protocol's translator
(`iop_node.runs.protocol_run`) has one when runtimes may speak the protocol, and hands it to
the adapter with the run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

import msgspec

from iop_node.protocols.chat_body import encode
from iop_node.protocols.chat_view import TokenUsage
from schemas.wire import Run

__all__ = ["ANTHROPIC_VERSION", "MessagesNative", "NativeForm", "NativeReader", "ResponsesNative"]

#: Anthropic's API refuses a request without `anthropic-version`; a caller that sent none
#: (the Edge passes the caller's own when there is one) gets the first stable version,
#: which every Messages-speaking runtime accepts.
ANTHROPIC_VERSION: Final = "2023-06-01"


class NativeReader(Protocol):
    """Reads one native reply for its caller: the alias in, the usage out."""

    @property
    def usage(self) -> TokenUsage | None: ...

    @property
    def upstream_model(self) -> str | None: ...

    def event(self, data: bytes, name: str | None = None) -> bytes: ...

    def response(self, body: bytes) -> bytes: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class NativeForm:
    """A caller protocol as a runtime that speaks it natively serves it."""

    name: str
    """The protocol's name (a `ProtocolSupport` learns it is unsupported by this)."""
    path: str
    """Its endpoint under the provider's `base_url` (`/messages`)."""
    reader: Callable[[Run], NativeReader]
    """A reader of one run's reply."""
    ends: frozenset[str]
    """The SSE events after which a stream has ended well."""
    tail: frozenset[str]
    """The events held back for the run's end with `run.hold_tail`."""
    keeps_output: bool = False
    """A stream's final response object travels in `run_done.response` when the run
    keeps its output (Responses)."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """Headers the upstream requires, sent when the caller sent none of that name
    (Anthropic's `anthropic-version`)."""
    key_header: str | None = None
    """Another header that carries the provider's API key, beside `Authorization`
    (Anthropic's `x-api-key`)."""
    opens: str = ""
    """The event a stream of the protocol begins with (Messages' `message_start`); ""
    when the stream is relayed as it begins."""
    opening: Callable[[Run], bytes] | None = None
    """That event, framed, for a run whose upstream began its stream without it."""
    answers: tuple[str, str] = ("type", "message")
    """The member and value every whole reply of the protocol has (Messages' `type:
    message`, Responses' `object: response`): a body without it is no reply."""


_decode_fields: Final = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_text: Final = msgspec.json.Decoder(str).decode


class _Type(msgspec.Struct):
    type: str = ""


_decode_type: Final = msgspec.json.Decoder(_Type).decode


class _AnthropicUsage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


_decode_anthropic_usage: Final = msgspec.json.Decoder(_AnthropicUsage).decode


class _Cached(msgspec.Struct):
    cached_tokens: int | None = None


class _Reasoning(msgspec.Struct):
    reasoning_tokens: int | None = None


class _ResponsesUsage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    input_tokens_details: _Cached | None = None
    output_tokens_details: _Reasoning | None = None


_decode_responses_usage: Final = msgspec.json.Decoder(_ResponsesUsage).decode


def _kind(data: bytes, name: str | None) -> str:
    if name is not None and name != "message":
        return name
    try:
        return _decode_type(data).type
    except (msgspec.DecodeError, RecursionError):
        return ""


def _fields(data: bytes) -> dict[str, msgspec.Raw] | None:
    try:
        return _decode_fields(data)
    except (msgspec.DecodeError, RecursionError):
        return None  # not an object: relayed as it is, read as nothing


class _Native:
    """What both readers share: the alias, and the usage read so far.

    An empty `reply_model` leaves `model` as the upstream wrote it (`schemas.wire.Run
    .reply_model`): the reader then only reads the usage, and returns what it is given."""

    __slots__ = ("_alias", "upstream_model", "usage")

    def __init__(self, reply_model: str) -> None:
        self._alias = msgspec.Raw(encode(reply_model)) if reply_model else None
        self.usage: TokenUsage | None = None
        """The run's usage as the upstream reported it, once it has."""
        self.upstream_model: str | None = None
        """The model the upstream answered as (before the alias took its place), once
        a reply named one: a trace's `gen_ai.response.model`."""

    def _with_alias(self, fields: dict[str, msgspec.Raw]) -> bool:
        model = fields.get("model")
        if model is None:
            return False
        if self.upstream_model is None:
            try:
                self.upstream_model = _decode_text(model)
            except (msgspec.DecodeError, RecursionError):
                pass
        if self._alias is not None:
            fields["model"] = self._alias
            return True
        return False


class MessagesNative(_Native):
    """Reads one native Anthropic Messages reply (module docstring)."""

    __slots__ = ("_input",)

    def __init__(self, reply_model: str) -> None:
        super().__init__(reply_model)
        self._input = _AnthropicUsage()

    def event(self, data: bytes, name: str | None = None) -> bytes:
        """One stream event's `data` as the caller gets it. `name` is its SSE event name
        (Anthropic names every event after its type), to skip reading the rest."""
        kind = _kind(data, name)
        if kind == "message_start":
            fields = _fields(data)
            message = _fields(fields["message"]) if fields and "message" in fields else None
            if fields is None or message is None:
                return data
            if "usage" in message:
                self._read(message["usage"])
            if self._with_alias(message):
                fields["message"] = msgspec.Raw(encode(message))
                return encode(fields)
        elif kind == "message_delta":
            fields = _fields(data)
            if fields is not None and "usage" in fields:
                self._read(fields["usage"])
        return data

    def response(self, body: bytes) -> bytes:
        """A whole (non-stream) Messages response as the caller gets it."""
        fields = _fields(body)
        if fields is None:
            return body
        if "usage" in fields:
            self._read(fields["usage"])
        return encode(fields) if self._with_alias(fields) else body

    def _read(self, raw: msgspec.Raw) -> None:
        """Usage counts are cumulative; a count a later event leaves out keeps its value
        from an earlier one (message_start has the input counts, message_delta the
        output)."""
        try:
            seen = _decode_anthropic_usage(raw)
        except (msgspec.DecodeError, RecursionError):
            return
        known = self._input
        self._input = known = _AnthropicUsage(
            input_tokens=_pick(seen.input_tokens, known.input_tokens),
            output_tokens=_pick(seen.output_tokens, known.output_tokens),
            cache_read_input_tokens=_pick(
                seen.cache_read_input_tokens, known.cache_read_input_tokens
            ),
            cache_creation_input_tokens=_pick(
                seen.cache_creation_input_tokens, known.cache_creation_input_tokens
            ),
        )
        if (
            known.input_tokens is None
            and known.cache_read_input_tokens is None
            and known.cache_creation_input_tokens is None
        ):
            return  # no input count yet (a stream that began without message_start)
        cached = max(known.cache_read_input_tokens or 0, 0)
        prompt = (
            max(known.input_tokens or 0, 0)
            + cached
            + max(known.cache_creation_input_tokens or 0, 0)
        )
        self.usage = TokenUsage(
            prompt_tokens=prompt,
            completion_tokens=max(known.output_tokens or 0, 0),
            cached_tokens=cached,
        )


_LIFECYCLE: Final = frozenset(
    {
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    }
)


_TERMINAL: Final = frozenset({"response.completed", "response.incomplete", "response.failed"})


_STORED: Final = msgspec.Raw(b"true")

#: The Responses stream events about one content part of an item (`content_index`).
_CONTENT_EVENTS: Final = frozenset(
    {
        "response.content_part.added",
        "response.content_part.done",
        "response.output_text.delta",
        "response.output_text.done",
        "response.output_text.annotation.added",
        "response.refusal.delta",
        "response.refusal.done",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
    }
)


class _Identified(msgspec.Struct):
    id: str | None = None


_decode_identified: Final = msgspec.json.Decoder(_Identified).decode


def _item_id(fields: dict[str, msgspec.Raw]) -> str | None:
    """The id of the output item an event is about (its `item_id`, or its `item`'s)."""
    try:
        if "item_id" in fields:
            return _decode_text(fields["item_id"])
        if "item" in fields:
            return _decode_identified(fields["item"]).id
    except (msgspec.DecodeError, RecursionError):
        pass
    return None


class _Indexes:
    """A Responses stream's indexes, filled in where the runtime left them out (module
    docstring): the events' order numbers, each output item's place in the response (in
    the order the items were added), each content event's part of its item (the last one
    added)."""

    __slots__ = ("_items", "_parts", "_sequence")

    def __init__(self) -> None:
        self._sequence = 0
        self._items: dict[str, int] = {}
        self._parts: dict[str, int] = {}

    def fill(self, kind: str, fields: dict[str, msgspec.Raw]) -> None:
        fields.setdefault("sequence_number", msgspec.Raw(b"%d" % self._sequence))
        self._sequence += 1
        item_id = _item_id(fields)
        if item_id is None:
            return
        if kind == "response.output_item.added":
            self._items.setdefault(item_id, len(self._items))
        elif kind == "response.content_part.added":
            self._parts[item_id] = self._parts.get(item_id, 0) + 1
        index = self._items.get(item_id)
        if index is not None:
            fields.setdefault("output_index", msgspec.Raw(b"%d" % index))
        if kind in _CONTENT_EVENTS:
            part = max(self._parts.get(item_id, 1) - 1, 0)
            fields.setdefault("content_index", msgspec.Raw(b"%d" % part))


#: A stream that numbers its events itself: relayed without filling anything in.
_NUMBERED: Final = _Indexes()


class ResponsesNative(_Native):
    """Reads one native OpenAI Responses reply (module docstring)."""

    __slots__ = ("_id", "_indexes", "_previous", "_stored", "final_response")

    def __init__(
        self,
        reply_model: str,
        *,
        stored: bool = False,
        response_id: str = "",
        previous_response_id: str = "",
    ) -> None:
        """`stored`: the Edge stores this run's response (`run.keep_output`);
        `response_id`: its id, IOP's own, stored or not ("" keeps the upstream's);
        `previous_response_id`: the
        conversation it continues, which the Edge took out of the body
        (`run.previous_response_id`), for the response to echo."""
        super().__init__(reply_model)
        self._stored = stored
        self._id = msgspec.Raw(encode(response_id)) if response_id else None
        self._previous = msgspec.Raw(encode(previous_response_id)) if previous_response_id else None
        self.final_response: bytes | None = None
        """The response object a stream ended with (its terminal event's `response`, with
        the alias), for the Edge to store when the caller asked for `store: true`."""
        self._indexes: _Indexes | None = None
        """What the stream's indexes need filled in: `_NUMBERED` for nothing, once its
        first event said (module docstring)."""

    def _shaped(self, response: dict[str, msgspec.Raw]) -> bool:
        """Give a response object's members the caller's alias, `store` and
        `previous_response_id`; whether any changed."""
        changed = self._with_alias(response)
        stored = response.get("store")
        if self._stored and stored is not None and stored != _STORED:
            response["store"] = _STORED
            changed = True
        own_id = self._id
        if own_id is not None and response.get("id", own_id) != own_id:
            response["id"] = own_id
            changed = True
        if self._previous is not None and response.get("previous_response_id") != self._previous:
            response["previous_response_id"] = self._previous
            changed = True
        return changed

    def event(self, data: bytes, name: str | None = None) -> bytes:
        """One stream event's `data` as the caller gets it. `name` is its SSE event name
        (OpenAI names every event after its type), to skip reading the rest."""
        kind = _kind(data, name)
        indexes = self._indexes
        if indexes is None:  # the first event: does the runtime number its events?
            fields = _fields(data)
            numbered = fields is None or "sequence_number" in fields
            indexes = self._indexes = _NUMBERED if numbered else _Indexes()
        if indexes is _NUMBERED:
            if kind not in _LIFECYCLE:
                return data
            fields = _fields(data)
            filled = False
        else:
            fields = _fields(data)
            if fields is None:
                return data
            indexes.fill(kind, fields)
            filled = True
        response = _fields(fields["response"]) if fields and "response" in fields else None
        if fields is None or response is None:
            return encode(fields) if filled and fields is not None else data
        self._read(response.get("usage"))
        changed = self._shaped(response)
        if kind in _TERMINAL:
            self.final_response = encode(response) if changed else bytes(fields["response"])
        if not changed and not filled:
            return data
        if changed:
            fields["response"] = msgspec.Raw(encode(response))
        return encode(fields)

    def response(self, body: bytes) -> bytes:
        """A whole (non-stream) Responses response (or a stored one) as the caller gets it."""
        fields = _fields(body)
        if fields is None:
            return body
        self._read(fields.get("usage"))
        return encode(fields) if self._shaped(fields) else body

    def _read(self, raw: msgspec.Raw | None) -> None:
        if raw is None:
            return
        try:
            seen = _decode_responses_usage(raw)
        except (msgspec.DecodeError, RecursionError):
            return  # `null` before the response completes, or not a usage object
        if seen.input_tokens is None and seen.output_tokens is None:
            return
        prompt = max(seen.input_tokens or 0, 0)
        details = seen.input_tokens_details
        reasoning = seen.output_tokens_details
        self.usage = TokenUsage(
            prompt_tokens=prompt,
            completion_tokens=max(seen.output_tokens or 0, 0),
            cached_tokens=min(max((details.cached_tokens if details else 0) or 0, 0), prompt),
            reasoning_tokens=max((reasoning.reasoning_tokens if reasoning else 0) or 0, 0),
        )


def _pick(new: int | None, old: int | None) -> int | None:
    return new if new is not None else old
