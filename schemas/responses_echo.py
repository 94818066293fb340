"""The members a Responses response object echoes of its request, for the Node's
translators and the Edge's own `response.failed` alike (design §14).

Rules:

1. A response echoes the request's settings as OpenAI's service does (`instructions`,
   `tools`, `tool_choice`, `previous_response_id`, `store`, ...), copied as the caller
   sent them, with the service's defaults for those it left out.
2. Every member the Open Responses schema requires is there, `null` when it has no value:
   the penalties (`0.0`, the service's default) and each echoed function tool's
   `description`, `parameters` and `strict` (a tool that did not say has `null` there:
   IOP promises no strict schema adherence it was not asked for).
3. A response the Edge stores says `store: true`, as its caller asked, though the body
   the runtime got says `store: false`; one continuing a stored conversation echoes the
   caller's `previous_response_id`, which the Edge took out of the body (it sends the
   conversation instead).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

__all__ = ["closing_members", "echo_members"]

_encode: Final = msgspec.json.Encoder().encode
_decode_any: Final = msgspec.json.Decoder().decode

#: What a Response echoes of its request (Rule 1), in order, with OpenAI's defaults.
_ECHO_DEFAULTS: Final[tuple[tuple[str, bytes], ...]] = (
    ("instructions", b"null"),
    ("max_output_tokens", b"null"),
    ("max_tool_calls", b"null"),
    ("metadata", b"{}"),
    ("parallel_tool_calls", b"true"),
    ("presence_penalty", b"0.0"),
    ("frequency_penalty", b"0.0"),
    ("previous_response_id", b"null"),
    ("prompt_cache_key", b"null"),
    ("reasoning", b'{"effort":null,"summary":null}'),
    ("safety_identifier", b"null"),
    ("service_tier", b'"default"'),
    ("store", b"true"),
    ("temperature", b"1.0"),
    ("text", b'{"format":{"type":"text"}}'),
    ("tool_choice", b'"auto"'),
    ("tools", b"[]"),
    ("top_logprobs", b"0"),
    ("top_p", b"1.0"),
    ("truncation", b'"disabled"'),
    ("user", b"null"),
)

#: The echoed fields of a request as the caller wrote them, each defaulting to OpenAI's
#: default: decoded from the request (the other fields are skipped), it encodes as the
#: echo.
_Echo = msgspec.defstruct(
    "_Echo",
    [(name, msgspec.Raw, msgspec.Raw(default)) for name, default in _ECHO_DEFAULTS],
    frozen=True,
)
_decode_echo: Final = msgspec.json.Decoder(_Echo).decode
_DEFAULT_ECHO: Final = _Echo()


_STORED: Final = msgspec.Raw(b"true")

#: The members the schema requires of a function tool (Rule 2), `null` unless given.
_FUNCTION_MEMBERS: Final = ("description", "parameters", "strict")


def _tool_echo(tools: msgspec.Raw) -> msgspec.Raw:
    """The echoed `tools` with every function tool's required members (Rule 2), those in
    a namespace too; as sent when none is missing."""
    try:
        listed = _decode_any(tools)
    except (msgspec.DecodeError, RecursionError):
        return tools
    if not isinstance(listed, list):
        return tools
    changed = False

    def complete(tool: Any) -> None:
        nonlocal changed
        if not isinstance(tool, dict):
            return
        if tool.get("type") == "function":
            for member in _FUNCTION_MEMBERS:
                if member not in tool:
                    tool[member] = None
                    changed = True
        inner = tool.get("tools") if tool.get("type") == "namespace" else None
        for member in inner if isinstance(inner, list) else ():  # the caller's, any shape
            complete(member)

    for tool in listed:
        complete(tool)
    return msgspec.Raw(_encode(listed)) if changed else tools


def echo_members(
    body: bytes, *, stored: bool = False, previous_response_id: str | None = None
) -> bytes:
    """The echo of a request body, encoded as the members that close a Response object
    (`,"instructions":...,"user":null}`): each field as the caller sent it, else OpenAI's
    default (Rules 1 and 2); `store: true` when the response is `stored`, and the
    `previous_response_id` the Edge passed beside the body (Rule 3). A body that is not a
    JSON object echoes the defaults (its translation has refused it already)."""
    try:
        echo = _decode_echo(body)
    except (msgspec.DecodeError, RecursionError):  # a ValidationError is a DecodeError
        echo = _DEFAULT_ECHO
    changes: dict[str, msgspec.Raw] = {}
    if stored:
        changes["store"] = _STORED
    if previous_response_id:
        changes["previous_response_id"] = msgspec.Raw(_encode(previous_response_id))
    sent: msgspec.Raw = getattr(echo, "tools")  # noqa: B009 (a `defstruct`'s member)
    tools = _tool_echo(sent)
    if tools is not sent:
        changes["tools"] = tools
    if changes:
        echo = msgspec.structs.replace(echo, **changes)
    return closing_members(_encode(echo))


def closing_members(encoded: bytes) -> bytes:
    """The members of an encoded JSON object, written to close another object that has
    members of its own: `{"a":1}` -> `,"a":1}`, and `{}` -> `}`. With `opened[:-1]`
    (an encoded object without its `}`) in front, the two are one object."""
    if not encoded.startswith(b"{") or not encoded.endswith(b"}"):
        raise ValueError("not an encoded JSON object")
    inner = encoded[1:]
    return inner if inner == b"}" else b"," + inner
