"""How the admin API answers: JSON documents (a large one sent in pieces) and errors in
the one shape every admin route uses (`{"error": {"message", "status"}}`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Final

import msgspec
from quart import Response

_encode = msgspec.json.Encoder().encode


#: A larger answer (a fleet's refresh report: megabytes) is sent this much at a time.
#: Whole, it would be copied on the event loop by Quart and again by h11, steps of
#: milliseconds each, and of tens in memory the process has not used yet.
_ANSWER_PIECE: Final = 64 * 1024


def json_response(payload: object, status: int = 200) -> Response:
    return encoded_response(_encode(payload), status)


def encoded_response(body: bytes | bytearray, status: int = 200) -> Response:
    """`body`, JSON, as the answer: past `_ANSWER_PIECE`, sent in pieces of that size."""
    if len(body) <= _ANSWER_PIECE:  # Quart takes bytes whole, and any other body as pieces
        return Response(bytes(body), status=status, content_type="application/json")
    response = Response(_in_pieces(body), status=status, content_type="application/json")
    response.content_length = len(body)
    return response


async def _in_pieces(body: bytes | bytearray) -> AsyncIterator[bytes]:
    view = memoryview(body)
    for start in range(0, len(view), _ANSWER_PIECE):
        yield bytes(view[start : start + _ANSWER_PIECE])


def error_response(status: int, message: str) -> Response:
    return json_response({"error": {"message": message, "status": status}}, status)
