"""A Responses reply whose response was not stored says `store: false` (design §14).

The caller asked for `store: true` and the Node wrote that into the response; when the
Edge then could not store it (`ResponseStore.keep` says why), the caller must not find
out by a 404 on its next `previous_response_id`. The reply is corrected before its last
bytes go out:

1. A non-stream body: its top-level `store` becomes `false`.
2. A stream's held tail (`run_done.tail`, the events that end it, written after the
   store was tried): the `response` object of each event that carries one gets `store:
   false`. Events before the tail already went out as they came.
3. Only `store` changes; every other member stays the JSON it was (read as raw JSON and
   written back untouched). A body or event that is not what these rules expect is left
   as it is: the header and the log still say the response was not stored.

Pure: bytes in, bytes out. Only the failure path pays for it.
"""

from __future__ import annotations

from typing import Final

import msgspec

__all__ = ["unstored_body", "unstored_events"]

_FALSE: Final = msgspec.Raw(b"false")
_decode_fields: Final = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_encode: Final = msgspec.json.Encoder().encode


def _fields(data: bytes) -> dict[str, msgspec.Raw] | None:
    try:
        return _decode_fields(data)
    except (msgspec.DecodeError, RecursionError):
        return None


def unstored_body(body: bytes) -> bytes:
    """A response object with `store: false` (Rule 1)."""
    fields = _fields(body)
    if fields is None or "store" not in fields:
        return body
    fields["store"] = _FALSE
    return _encode(fields)


def unstored_events(events: bytes) -> bytes:
    """Server-sent events whose `response` objects say `store: false` (Rule 2)."""
    out: list[bytes] = []
    for event in events.split(b"\n\n"):
        lines = event.split(b"\n")
        for index, line in enumerate(lines):
            if line.startswith(b"data: "):
                lines[index] = b"data: " + _event_data(line[len(b"data: ") :])
        out.append(b"\n".join(lines))
    return b"\n\n".join(out)


def _event_data(data: bytes) -> bytes:
    fields = _fields(data)
    if fields is None or "response" not in fields:
        return data
    response = bytes(fields["response"])
    changed = unstored_body(response)
    if changed is response:
        return data
    fields["response"] = msgspec.Raw(changed)
    return _encode(fields)
