"""A fleet's JSON made and read a piece at a time, a step of the event loop each.

A refresh of 10,000 Nodes reads a candidate of megabytes (`POST /refresh`'s inline
YAML, a JSON string) and writes a report and an audit line of megabytes (tens of
thousands of changes and push results). msgspec makes or reads each in one call of
several milliseconds, and on a busy 2-core machine tens: one step of the loop that every
caller's request waits behind. So:

1. A list field of a struct is encoded `STEP_ITEMS` items to a step
   (`encode_in_pieces`); the rest of the struct is encoded once, with those lists
   empty, and each list's pieces are put where its `[]` is. The JSON is byte for byte
   what one `encode` makes.
2. A long JSON string is decoded about `STEP_BYTES` bytes to a step
   (`decode_string_in_pieces`), each piece cut just before an escaped newline (`\\n`),
   where no escape sequence, no surrogate pair and no UTF-8 sequence can be cut in two:
   the last before `STEP_BYTES`, else the first after. A string with no newline left is
   decoded whole from there (YAML has one every line).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import msgspec
import trio

__all__ = ["STEP_BYTES", "STEP_ITEMS", "decode_string_in_pieces", "encode_in_pieces"]

#: Items of a list encoded in one step of the loop (Rule 1).
STEP_ITEMS: Final = 1024
#: Bytes of a JSON string decoded in one step of the loop (Rule 2).
STEP_BYTES: Final = 128 * 1024

_STRING: Final = msgspec.json.Decoder(str)
_BACKSLASH: Final = ord("\\")


async def encode_in_pieces(
    encoder: msgspec.json.Encoder, value: msgspec.Struct, fields: Iterable[str]
) -> bytearray:
    """`encoder.encode(value)`, the lists in `fields` (attribute names) a piece a step,
    with a checkpoint before each piece (Rule 1)."""
    lists = {name: getattr(value, name) for name in fields}
    head = encoder.encode(msgspec.structs.replace(value, **{name: [] for name in lists}))
    names = {field.name: field.encode_name for field in msgspec.structs.fields(value)}
    places = sorted(
        (head.index(b'"%s":[]' % names[name].encode()) + len(names[name]) + 4, name)
        for name in lists
    )
    out = bytearray()
    done = 0
    for close, name in places:  # `close`: where the list's `]` is
        out += head[done:close]
        items: list[Any] = lists[name]
        for start in range(0, len(items), STEP_ITEMS):
            await trio.lowlevel.checkpoint()
            if start:
                out += b","
            out += encoder.encode(items[start : start + STEP_ITEMS])[1:-1]
        done = close
    out += head[done:]
    return out


async def decode_string_in_pieces(raw: bytes | memoryview) -> str:
    """The JSON string `raw` (quotes included) as text, a piece a step with a checkpoint
    before each (Rule 2); only a piece at a time is copied. Raises `msgspec.DecodeError`
    for what is not a JSON string."""
    view = memoryview(raw)
    end = len(view) - 1  # the closing quote's place
    if end < STEP_BYTES or view[:1].tobytes() != b'"' or view[end:].tobytes() != b'"':
        return _STRING.decode(view)
    parts: list[str] = []
    start = 1
    while start < end:
        await trio.lowlevel.checkpoint()
        piece = _piece(view, start, end)
        parts.append(_STRING.decode(b'"' + piece + b'"'))
        start += len(piece)
    return "".join(parts)


def _piece(view: memoryview, start: int, end: int) -> bytes:
    """The piece from `start` (Rule 2): up to just before the last escaped newline within
    `STEP_BYTES`, else the first after them, else up to `end`."""
    window = view[start : min(start + STEP_BYTES, end)].tobytes()
    if start + len(window) >= end:
        return window
    cut = _last_newline(window)
    while cut is None:  # none in the window: look on, a window at a time
        more = view[start + len(window) : min(start + len(window) + STEP_BYTES, end)].tobytes()
        if not more:
            return window
        at = len(window)
        window += more
        cut = _first_newline(window, max(at - 1, 1))
    return window[:cut]


def _last_newline(window: bytes) -> int | None:
    """Where the last escaped newline of `window` begins, if any (not at its start)."""
    position = len(window)
    while (found := window.rfind(b"\\n", 1, position)) > 0:
        if _begins_escape(window, found):
            return found
        position = found
    return None


def _first_newline(window: bytes, start: int) -> int | None:
    """Where the first escaped newline of `window` at or after `start` begins, if any."""
    while (found := window.find(b"\\n", start)) > 0:
        if _begins_escape(window, found):
            return found
        start = found + 1
    return None


def _begins_escape(data: bytes, backslash: int) -> bool:
    """Whether the backslash at `backslash` begins an escape: an even number of
    backslashes just before it (each pair one escaped backslash). A piece begins where
    no escape is cut, so counting within it is enough."""
    run = 0
    while backslash - 1 - run >= 0 and data[backslash - 1 - run] == _BACKSLASH:
        run += 1
    return run % 2 == 0
