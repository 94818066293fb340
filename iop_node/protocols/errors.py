"""What cannot be translated, and where.

    ValueError
    └── TranslationError             the caller's request cannot be said in chat
        │                            completions: a 400 in the caller's protocol
        └── ReplyTranslationError    the runtime's reply cannot be said in the caller's
                                     protocol: the run fails (the upstream's fault)

Both carry `param`, the JSON path of the offending field in the body it was read from
(`messages[2].content[0].type` in a Messages request, `choices[0].message.tool_calls[1]
.function.arguments` in a chat reply), because a client that sent forty kilobytes of
agent history needs to know which field, not just that one was wrong.

msgspec's own validation messages already name the field (`... - at
`$.messages[2].content`); `from_validation` turns one into a `TranslationError` with that
path as `param`, so a wrong type anywhere in a request reads the same as a field we
refused by hand.
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from schemas.protocols import CallerProtocol, error_body

__all__ = [
    "ReplyTranslationError",
    "TranslationError",
    "from_validation",
    "join_path",
    "translation_error_body",
]


class TranslationError(ValueError):
    """The caller's request cannot be translated to chat completions (design §14: a clear
    400 naming the field, never a silent drop). `param` is the field's JSON path."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.reason = message
        """The message without the path (the error body carries the path in `param`)."""


class ReplyTranslationError(TranslationError):
    """The runtime's reply cannot be said in the caller's protocol (tool-call arguments
    that are not JSON where the caller's protocol needs an object, a stream that breaks
    the chat chunk grammar). The upstream is at fault, not the caller: the Node fails the
    run rather than answering 400."""


_AT_PATH: Final = re.compile(r"^(?P<message>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_INVALID_TAG: Final = re.compile(r"^Invalid value '(?P<tag>[^']*)'$")


def join_path(prefix: str | None, path: str) -> str | None:
    """`prefix` followed by msgspec's path (`.a[0].b` or `[3]`), without a leading dot."""
    joined = f"{prefix or ''}{path}".lstrip(".")
    return joined or None


def from_validation(
    exc: msgspec.ValidationError | msgspec.DecodeError,
    *,
    prefix: str | None = None,
    unsupported: dict[str, str] | None = None,
) -> TranslationError:
    """A msgspec error as a `TranslationError` whose `param` is the field's path.

    `prefix` is the path of the value that was decoded (msgspec's paths are relative to
    it). An unknown tag of a tagged union (`Invalid value 'server_tool_use'` at a `.type`)
    is explained: `unsupported` maps the types we know but cannot translate to why; any
    other is an unknown type."""
    text = str(exc)
    match = _AT_PATH.match(text)
    if match is None:
        if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
            return TranslationError(f"the body is not valid JSON ({text})", param=prefix)
        return TranslationError(text, param=prefix)
    message, param = match["message"], join_path(prefix, match["path"])
    tag = _INVALID_TAG.match(message)
    if tag is not None and match["path"].endswith(".type"):
        name = tag["tag"]
        reason = (unsupported or {}).get(name)
        if reason is not None:
            message = f"type '{name}' cannot be translated for this provider: {reason}"
        else:
            message = f"unknown type '{name}'"
    return TranslationError(message, param=param)


def translation_error_body(protocol: CallerProtocol, exc: TranslationError) -> bytes:
    """The 400 body for a request that cannot be translated, in the caller's protocol.
    OpenAI's error shape names the field in `param`; Anthropic's has no such field, so
    there the path leads the message (`messages[2].content[0].type: unknown type ...`)."""
    if protocol == "messages":
        return error_body("messages", 400, str(exc))
    return error_body(protocol, 400, exc.reason, param=exc.param)
