"""A run's request body, read from ASGI `receive` and decoded once (`runs`, step 1).

Bounded in size (`openai.max_request_bytes`, the caller's `Content-Length` first) and in
time (`BODY_TIMEOUT_S` for what has not come yet), and in depth once decoded
(`MAX_JSON_DEPTH`). Nearly every run's body comes in the same packets as its head, and
Hypercorn's protocol task has put it in the app's channel by the app's first step: that
is taken without waiting (`http.compat.hypercorn.queued_receiver`), so such a body costs
no cancel scope and mostly no task switch.
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Collection
from itertools import accumulate
from typing import Any, Final

import msgspec
import trio
from hypercorn.typing import ASGIReceiveCallable, ASGIReceiveEvent

from iop_edge.http.compat.hypercorn import queued_receiver
from iop_edge.http.errors import ApiError, bad_request, decoder_param

__all__ = [
    "BODY_TIMEOUT_S",
    "MAX_JSON_DEPTH",
    "CallerGone",
    "decode_body",
    "read_json",
    "too_large",
]

#: How long a caller may take to send its request body (Quart's default, kept).
BODY_TIMEOUT_S: Final = 60.0
#: How deep a request's JSON may nest. OpenAI requests nest a few levels (tool schemas a
#: few more); a deeper body is refused (400) before anything walks it (the decoders and
#: encoders on the way to the upstream all recurse).
MAX_JSON_DEPTH: Final = 64
_decode_json: Final = msgspec.json.Decoder().decode


class CallerGone(Exception):
    """The caller disconnected before its request body was read."""


async def read_json(
    receive: ASGIReceiveCallable, content_length: int | None, limit: int
) -> dict[str, Any]:
    """The body, decoded. What the connection already holds is taken without a wait;
    the rest of the body is awaited under `BODY_TIMEOUT_S`. A body framed by its
    length is whole at its last byte, and the message that ends it then comes
    without another read from the caller (h11 ends such a body there), so it is
    awaited without a deadline. So a body that came with its head, as nearly every
    run's does, is read without a cancel scope, and mostly without a task switch.
    (The end is still taken: Hypercorn keeps a connection for its next request only
    once it has seen it.)"""
    if content_length is not None and content_length > limit:
        raise too_large(f"Request body of {content_length} bytes", limit)
    body = _Body(limit, content_length)
    take = queued_receiver(receive)
    if take is not None:
        while body.more:
            try:
                message = take()
            except trio.WouldBlock:
                break
            body.add(message)
    if body.more and not body.whole:
        with trio.move_on_after(BODY_TIMEOUT_S) as scope:
            while body.more and not body.whole:
                body.add(await receive())
        if scope.cancelled_caught:
            raise ApiError(
                408,
                f"The request body did not arrive within {BODY_TIMEOUT_S:g}s",
                code="request_timeout",
            )
    while body.more:  # whole: its end is on its way from the connection's own task
        body.add(await receive())
    return decode_body(b"".join(body.parts))


class _Body:
    """A request body as its ASGI messages bring it, bounded by `limit` bytes."""

    __slots__ = ("expected", "limit", "more", "parts", "size")

    def __init__(self, limit: int, expected: int | None) -> None:
        self.limit = limit
        self.expected = expected
        """Its `Content-Length`, when it has one."""
        self.parts: list[bytes] = []
        self.size = 0
        self.more = True
        """Whether a message is still to come (its end, at least)."""

    @property
    def whole(self) -> bool:
        """Every byte of a body framed by its length is here."""
        return self.size == self.expected

    def add(self, message: ASGIReceiveEvent) -> None:
        """Take one message: raises `CallerGone` for a disconnect, 413 past the limit."""
        if message["type"] == "http.disconnect":
            raise CallerGone
        part: bytes = message.get("body", b"")  # type: ignore[assignment]
        self.size += len(part)
        if self.size > self.limit:
            raise too_large("Request body", self.limit)
        self.parts.append(part)
        self.more = bool(message.get("more_body", False))


def decode_body(data: bytes, what: str = "body") -> dict[str, Any]:
    """A request body (or a WebSocket event, `what`) decoded: a JSON object nesting at
    most `MAX_JSON_DEPTH` levels; raises a 400 `invalid_json` saying what is wrong."""
    try:
        body = _decode_json(data)
    except msgspec.DecodeError as exc:
        raise bad_request(
            f"Could not parse the JSON {what}: {exc}",
            code="invalid_json",
            param=_unparsed_field(data, str(exc)),
        ) from None
    except RecursionError:  # deeper than the decoder's stack: surely deeper than the limit
        raise _too_deep(what) from None
    if not isinstance(body, dict):
        raise bad_request(f"The request {what} must be a JSON object", code="invalid_json")
    if _nests_deeper(data, body, MAX_JSON_DEPTH):
        raise _too_deep(what)
    return body


def _unparsed_field(data: bytes, problem: str) -> str | None:
    """The member a JSON text could not be parsed at, as far as it can be told: a number
    out of any float's range is named by its key (the untyped decoder's path says only
    `$[...]`)."""
    if problem.startswith("Number out of range"):
        for match in _NUMBER_MEMBER.finditer(data):
            if math.isinf(float(match.group(2))):
                return match.group(1).decode("utf-8", "replace")
    param = decoder_param(problem)
    return None if param is None or "[...]" in param else param


#: `"key": number` with an exponent, the numbers a float may not hold.
_NUMBER_MEMBER: Final = re.compile(rb'"([^"\\]{1,256})"\s*:\s*(-?[0-9.]+[eE][+-]?[0-9]+)')


def _too_deep(what: str) -> ApiError:
    return bad_request(
        f"The JSON {what} nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
    )


def _nests_deeper(data: bytes, value: object, limit: int) -> bool:
    """Whether the decoded `value` (of the JSON text `data`) nests more than `limit`
    arrays/objects deep.

    A body with at most `limit` brackets cannot (two C-speed counts, the usual case). A
    larger one is walked, without recursion, while the walk is cheap: up to
    `WALK_BUDGET` values, a few hundred kilobytes of an agent's conversation. Past that
    the body is wide (millions of small values, `[[],[],...]` perhaps), where a walk
    would hold the loop for seconds, and the text is measured instead
    (`_text_nests_deeper`), at C speed."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    budget = WALK_BUDGET
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        assert isinstance(children, Collection)
        budget -= len(children)
        if budget < 0:
            return _text_nests_deeper(data, limit)
        for child in children:
            if isinstance(child, dict | list):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


#: Values `_nests_deeper` walks before it measures the text instead (about 10 ms).
WALK_BUDGET: Final = 100_000
_NOT_BRACKETS: Final = bytes(range(256)).translate(None, b"[]{}")
#: An opening bracket to 1, a closing one to -1 (as a signed byte).
_STEPS: Final = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def _text_nests_deeper(data: bytes, limit: int) -> bool:
    """`_nests_deeper` asked of valid JSON text, each step in C (bytes methods, no
    regular expression building a match per escape): the escaped backslashes taken out
    of its strings, then the escaped quotes (left to right, as JSON reads them), so a
    quote left begins or ends a string; then what is outside the strings (every other
    piece between quotes); then all but the brackets. The deepest nesting is the highest
    running sum of +1 per opening bracket and -1 per closing one. (A value a duplicate
    key overwrote counts here, not in the decoded walk: the text can only be found
    deeper.)"""
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(data.split(b'"')[::2])
    brackets = outside.translate(_STEPS, _NOT_BRACKETS)
    return max(accumulate(array("b", brackets)), default=0) > limit


def too_large(what: str, limit: int) -> ApiError:
    return ApiError(413, f"{what} exceeds the limit of {limit} bytes", code="request_too_large")
