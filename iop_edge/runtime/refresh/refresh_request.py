"""A `POST /refresh` body read as a request (design §5 step 1).

A fleet's inline candidate is megabytes of YAML in one JSON string: unescaped at once it
would be a step of the loop of tens of milliseconds on a busy machine. So the body is
read first with the candidate left as its JSON (`_RequestBody`), which msgspec only
scans, and the candidate is then unescaped a piece a step (`json_pieces`).
"""

from __future__ import annotations

from typing import Final

import msgspec
import trio

from iop_edge.runtime.refresh.json_pieces import decode_string_in_pieces
from schemas.refresh import RefreshMode, RefreshRequest

__all__ = ["decode_request"]


class _RequestBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A `POST /refresh` body as read first: a `RefreshRequest` whose inline candidate is
    still its JSON string (`decode_request`); the same fields, a test keeps them so."""

    mode: RefreshMode
    config_yaml: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    """Empty when the body has none (`Raw()`), else the field's JSON: a string, `null`, or
    what is neither and is refused."""
    if_revision: int | None = None
    allow_restart_required: bool = False


class _CandidateOnly(msgspec.Struct, frozen=True):
    config_yaml: str | None = None


async def decode_request(pieces: list[bytes]) -> RefreshRequest:
    """A `POST /refresh` body, in the pieces it arrived in, as a request (an empty body is
    `{}`). Raises `msgspec.DecodeError`, or `RecursionError` for an unknown field nested
    too deeply (msgspec skips unknown fields recursively). A fleet's inline candidate is
    megabytes of JSON string: it is unescaped a piece a step (`json_pieces`)."""
    await trio.lowlevel.checkpoint()
    whole = b"".join(pieces) or b"{}"
    await trio.lowlevel.checkpoint()  # a fleet's body: megabytes copied, then scanned
    body = _REQUEST_DECODER.decode(whole)
    raw = memoryview(body.config_yaml)
    text: str | None = None
    if raw[:1].tobytes() == b'"':
        text = await decode_string_in_pieces(raw)
    elif raw:  # `null`, or what is not a string: its error names the field, as others do
        _CANDIDATE_DECODER.decode(b'{"config_yaml":' + bytes(raw) + b"}")
    return RefreshRequest(
        mode=body.mode,
        config_yaml=text,
        if_revision=body.if_revision,
        allow_restart_required=body.allow_restart_required,
    )


#: Decodes `POST /refresh` bodies (`decode_request`).
_REQUEST_DECODER: Final = msgspec.json.Decoder(_RequestBody)
_CANDIDATE_DECODER: Final = msgspec.json.Decoder(_CandidateOnly)
