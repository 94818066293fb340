"""IOP's spans as OTLP protobuf, written straight to bytes, a batch at a time.

The OTLP exporter's own encoder builds a protobuf object for every span, attribute and
value of a batch before it serializes them, and it needs the SDK's span objects to read
from: more work per span than IOP spends on a request. IOP's spans are few and known, so
the export thread writes each finished `schemas.runtime.spans.SpanRecorder` of a batch as its
OTLP `Span` message, field by field (`encode_span`), and puts the process's resource
and scope, written once, around them (`TraceRequest`); the exporter sends that as it
would its own (`schemas.runtime.compat.otlp_http`). `tests/unit/test_otlp_encoding.py` decodes
the bytes and holds them equal to what the exporter's encoder builds from the same
spans.

Why in the export thread and not as each span ends: measured in a running Edge, a span
written in the middle of the request path costs three to four times what it costs in
a loop over a batch (the request's own work leaves the caches cold), and the request
path then only queues the record. The records wait in the queue with their attribute
dicts, which hold only names and numbers: nothing the cyclic collector follows. The
attributes many spans share (`schemas.runtime.spans.SharedAttributes`) are written once, when
the set is made, on the request path (`write_attributes`, which keeps nothing): the
caches below are the export thread's alone.

Rules:
1. The message is the exporter's: one `ResourceSpans` per batch (a process has one
   resource), one `ScopeSpans` in it (one instrumentation scope), the spans in the order
   they ended; every field the exporter sets, set the same way (proto3 omits scalars at
   their default; a oneof `AnyValue`, a span's `status` and `flags` are always written).
2. Pure: bytes out, no OpenTelemetry import.
3. Most attributes repeat (a token count, a status code, a response model, finish
   reasons): each attribute with a str, int or tuple-of-str value is written once and
   kept, so a repeated one costs one lookup. Bounded: past `_KEPT` attributes, or
   `_VALUES_KEPT` values of one key (a request id is new every time), attributes are
   written afresh.
4. A span's times are never zero (`time.time_ns`), so both are always written.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Final

from schemas.runtime.span_record import SpanRecorder

__all__ = [
    "SPAN_ATTRIBUTES",
    "TraceRequest",
    "encode_attributes",
    "encode_span",
    "write_attributes",
]

#: The tag of a span's `attributes` (field 9, length-delimited).
SPAN_ATTRIBUTES: Final = b"\x4a"
_UINT64: Final = (1 << 64) - 1
_SMALL: Final = [bytes([n]) for n in range(128)]
_DOUBLE: Final = struct.Struct("<d").pack
#: `trace_id` (field 1, 16 bytes) and `span_id` (field 2, 8 bytes), big-endian as the ids.
_IDS: Final = struct.Struct(">2sQQ2sQ").pack
_PARENT: Final = struct.Struct(">2sQ").pack
#: `start_time_unix_nano` (field 7) and `end_time_unix_nano` (field 8), fixed64.
_TIMES: Final = struct.Struct("<cQcQ").pack
_EVENT_TIME: Final = struct.Struct("<cQ").pack
#: `kind` (field 6): OTLP's SPAN_KIND_INTERNAL is 1, SERVER 2, CLIENT 3.
_KINDS: Final = {"internal": b"\x30\x01", "server": b"\x30\x02", "client": b"\x30\x03"}
#: `status` (field 15): an empty message (code UNSET), or code ERROR (2).
_STATUS_UNSET: Final = b"\x7a\x00"
_STATUS_ERROR: Final = b"\x7a\x02\x18\x02"
#: `flags` (field 16, fixed32): trace.proto's `SpanFlags`, whether the parent is remote
#: known (0x100) and true (0x200).
_FLAGS_LOCAL: Final = b"\x85\x01" + struct.pack("<I", 0x100)
_FLAGS_REMOTE: Final = b"\x85\x01" + struct.pack("<I", 0x300)
_VALUES_KEPT: Final = 256
_KEPT: Final = 16384
_NAMES_KEPT: Final = 1024
#: Rule 3: per (key, value), the KeyValue message with its length prefix, for values
#: that are a str, an int or a tuple of str (never a bool or a float: `True == 1 == 1.0`,
#: and never a tuple of anything else: `(True,) == (1,)`; a tuple is looked up, but kept
#: only when all of it is str). Keyed by the pair as a dict's `items()` yields it: a
#: kept attribute costs one lookup.
_written: dict[tuple[str, object], bytes] = {}
_KEPT_KINDS: Final = (str, int, tuple)
#: How many values of each key `_written` holds (Rule 3's bound).
_values_kept: dict[str, int] = {}
#: Keys as the start of a KeyValue message (`key`, field 1, with its tag and length).
_keys: dict[str, bytes] = {}
#: Per key, the KeyValue message of a double value up to the value (`_new_double_prefix`).
_doubles: dict[str, bytes] = {}
#: Span names, written (`name`, field 5, with its tag and length).
_names: dict[str, bytes] = {}
#: Event names, written (an event's `name`, field 2, with its tag and length).
_event_names: dict[str, bytes] = {}
_ENCODED: Final = attrgetter("encoded")
#: Length prefixes of 128 to 16383 bytes: two varint bytes, low seven bits first.
_PREFIX2: Final = struct.Struct("<BB").pack


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL[value]
    if value < 0x4000:
        return _PREFIX2((value & 0x7F) | 0x80, value >> 7)
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag + _varint(len(payload)) + payload


def _text(tag: bytes, text: str) -> bytes:
    return _field(tag, text.encode("utf-8"))


def _any(value: object) -> bytes:
    """An `AnyValue` message (its oneof always written, as the exporter does)."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _text(b"\x0a", value)
    if isinstance(value, int):
        return b"\x18" + _varint(value & _UINT64)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Mapping):
        pairs = b"".join(_field(b"\x0a", _key_value(str(k), v)) for k, v in value.items())
        return _field(b"\x32", pairs)
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any(item)) for item in value))
    raise TypeError(f"an attribute value of type {type(value).__name__} has no OTLP form")


def _key(key: str) -> bytes:
    written = _keys.get(key)
    if written is None:
        written = _text(b"\x0a", key)
        if len(_keys) < _KEPT:
            _keys[key] = written
    return written


def _key_value(key: str, value: object) -> bytes:
    return _text(b"\x0a", key) + _field(b"\x12", _any(value))


def _new_double_prefix(key: str) -> bytes:
    """All of a KeyValue message with a double value but the value's 8 bytes."""
    message = _key(key) + b"\x12\x09\x21"
    prefix = _varint(len(message) + 8) + message
    if len(_doubles) < _KEPT:
        _doubles[key] = prefix
    return prefix


def _new_key_value(key: str, value: object) -> bytes:
    """A KeyValue message with its length prefix (an attribute `_written` does not hold),
    kept when Rule 3 allows."""
    kind = value.__class__
    if kind is float:  # a duration: new every time, and always the same size
        prefix = _doubles.get(key)
        if prefix is None:
            prefix = _new_double_prefix(key)
        return prefix + _DOUBLE(value)
    keep = kind is str or kind is int
    if kind is str:
        data: bytes = value.encode("utf-8")  # type: ignore[attr-defined]  # a str, as checked
        size = len(data)
        any_value = (b"\x0a" + _SMALL[size] if size < 0x80 else b"\x0a" + _varint(size)) + data
    elif (kind is tuple or kind is list) and all(item.__class__ is str for item in value):  # type: ignore[attr-defined]
        values = b"".join([_field(b"\x0a", _text(b"\x0a", item)) for item in value])  # type: ignore[attr-defined]
        any_value = _field(b"\x2a", values)
        keep = kind is tuple
    else:
        any_value = _any(value)
    size = len(any_value)
    message = _key(key) + b"\x12" + (_SMALL[size] if size < 0x80 else _varint(size)) + any_value
    size = len(message)
    written = (_SMALL[size] if size < 0x80 else _varint(size)) + message
    if keep:
        kept = _values_kept.get(key, 0)
        if kept < _VALUES_KEPT and len(_written) < _KEPT:
            _values_kept[key] = kept + 1
            _written[key, value] = written
    return written


def write_attributes(tag: bytes, attributes: Mapping[str, object]) -> bytes:
    """`attributes` as repeated KeyValue fields numbered by `tag` (`SPAN_ATTRIBUTES`: a
    span's `attributes`), keeping nothing (Rule 3): for what is written once, a
    resource, a scope, a span's shared attributes."""
    return b"".join([tag + _field(b"", _key_value(k, v)) for k, v in attributes.items()])


def encode_attributes(tag: bytes, attributes: Mapping[str, object]) -> bytes:
    """`attributes` as repeated KeyValue fields numbered by `tag` (`SPAN_ATTRIBUTES`: a
    span's `attributes`)."""
    if not attributes:
        return b""
    try:
        return tag + tag.join(
            [
                (_written.get(pair) if pair[1].__class__ in _KEPT_KINDS else None)
                or _new_key_value(*pair)
                for pair in attributes.items()
            ]
        )
    except TypeError:  # a tuple that holds a list cannot be looked up: each written afresh
        return tag + tag.join([_new_key_value(*pair) for pair in attributes.items()])


def _name(name: str) -> bytes:
    written = _text(b"\x2a", name) if name else b""
    if len(_names) < _NAMES_KEPT:
        _names[name] = written
    return written


def _trace_state(header: str) -> bytes:
    """The `trace_state` field of a `tracestate` header: the standard's canonical list,
    members without the optional whitespace around them, empty members dropped."""
    state = ",".join(member for part in header.split(",") if (member := part.strip()))
    return _text(b"\x1a", state) if state else b""


def _events(events: Sequence[tuple[str, int, Mapping[str, object]]]) -> bytes:
    """A span's `events` (field 11, repeated)."""
    out = []
    for name, at, attributes in events:
        written = _event_names.get(name)
        if written is None:
            written = _text(b"\x12", name) if name else b""
            if len(_event_names) < _NAMES_KEPT:
                _event_names[name] = written
        event = _EVENT_TIME(b"\x09", at) + written + encode_attributes(b"\x1a", attributes)
        size = len(event)
        out.append(b"\x5a" + (_SMALL[size] if size < 0x80 else _varint(size)) + event)
    return b"".join(out)


def encode_span(span: SpanRecorder) -> bytes:
    """A finished span as one `spans` field of a `ScopeSpans` message (its tag, its
    length, the `Span` message), ready to be joined with others (`TraceRequest`).

    Written as one join of its fields, each by an expression: every call in here is
    paid three times a request."""
    trace_id = span.trace_id
    parent = span.parent
    name = span.name
    message = b"".join(
        [
            _IDS(b"\x0a\x10", trace_id >> 64, trace_id & _UINT64, b"\x12\x08", span.span_id),
            _trace_state(span.tracestate) if span.tracestate else b"",
            _PARENT(b"\x22\x08", parent.span_id) if parent is not None else b"",
            _names.get(name) or _name(name),
            _KINDS[span.kind],
            _TIMES(b"\x39", span.start_ns, b"\x41", span.end_ns),
            *map(_ENCODED, span.shared),
            encode_attributes(SPAN_ATTRIBUTES, span.attributes),
            _events(span.events) if span.events else b"",
            _STATUS_ERROR if span.error else _STATUS_UNSET,
            _FLAGS_REMOTE if parent is not None and parent.remote else _FLAGS_LOCAL,
        ]
    )
    size = len(message)
    if 0x80 <= size < 0x4000:  # a span's usual size
        return b"\x12" + _PREFIX2((size & 0x7F) | 0x80, size >> 7) + message
    return b"\x12" + _varint(size) + message


class TraceRequest:
    """An `ExportTraceServiceRequest` of one process's spans: its resource and its
    instrumentation scope, written once, around the spans `encode_span` wrote."""

    __slots__ = ("_resource", "_resource_end", "_scope", "_scope_end")

    def __init__(
        self,
        *,
        resource: Mapping[str, object],
        resource_schema_url: str = "",
        scope_name: str,
        scope_version: str = "",
        scope_attributes: Mapping[str, object] | None = None,
        scope_schema_url: str = "",
    ) -> None:
        # ResourceSpans: `resource` (field 1), then `scope_spans` (2), then `schema_url` (3).
        self._resource = _field(b"\x0a", write_attributes(b"\x0a", resource))
        self._resource_end = _text(b"\x1a", resource_schema_url) if resource_schema_url else b""
        # ScopeSpans: `scope` (field 1), then `spans` (2), then `schema_url` (3).
        scope = _text(b"\x0a", scope_name) if scope_name else b""
        if scope_version:
            scope += _text(b"\x12", scope_version)
        scope += write_attributes(b"\x1a", scope_attributes or {})
        self._scope = _field(b"\x0a", scope)
        self._scope_end = _text(b"\x1a", scope_schema_url) if scope_schema_url else b""

    def __call__(self, spans: Sequence[bytes]) -> bytes:
        """The request carrying `spans` (each from `encode_span`), in that order."""
        scope_spans = self._scope + b"".join(spans) + self._scope_end
        resource_spans = self._resource + _field(b"\x12", scope_spans) + self._resource_end
        return _field(b"\x0a", resource_spans)
