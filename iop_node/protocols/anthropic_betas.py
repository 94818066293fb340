"""Anthropic's beta extras in a native Messages run, and a runtime that refuses them.

Claude Code sends, on every request, `anthropic-beta` flags, a top-level
`context_management` block and `cache_control` markers with a `ttl` ("1h"). Anthropic's
own API and a runtime that follows it take them; a runtime that validates Messages
bodies strictly (a pydantic model with `extra = "forbid"`) answers 400 "Extra inputs are
not permitted", and the agent fails on every turn.

Rules:

1. A native Messages run is sent as the caller sent it, extras included, until its
   provider has refused them once.
2. Refused: the upstream answered 400 or 422 and its message says an input was not
   permitted or not known (`Extra inputs are not permitted`, pydantic's
   `extra_forbidden`, "unrecognized", "unknown field", "unexpected keyword",
   "additional properties") or names one of the extras (`context_management`, `ttl`,
   `anthropic-beta`). Then the run is sent once more without them (`without_betas`): no
   `anthropic-beta` header, no `context_management`, no `ttl` in any `cache_control` (the
   marker itself stays).
3. When that second attempt succeeds, the provider refuses extras (the Node remembers
   it for the adapter's life, as it remembers protocols: `ProtocolSupport`, logged
   once), and its later runs go without them from the start. When it is refused again,
   the extras were not the cause: nothing is learned, and the run fails with the
   runtime's first answer; any other failure of it proves nothing either way, and the
   run fails with it.
4. A translated run never carries them (the translation drops `context_management` and
   `cache_control`; a chat endpoint sees no `anthropic-*` header).

Pure: the runner sends, this decides and rewrites.
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec

from schemas.wire import Run

__all__ = ["BETA_HEADER", "refuses_betas", "without_betas"]

BETA_HEADER: Final = "anthropic-beta"
_REFUSED: Final = re.compile(
    r"extra inputs are not permitted|extra_forbidden|unrecognized|unknown field"
    r"|unexpected keyword|additional properties"
    r"|context_management|\bttl\b|anthropic-beta",
    re.IGNORECASE,
)
_MAX_DEPTH: Final = 64

_encode: Final = msgspec.json.Encoder().encode
_decode: Final = msgspec.json.Decoder().decode


def refuses_betas(status: int | None, message: str) -> bool:
    """Whether an upstream's answer refuses an input it does not know (Rule 2)."""
    return status in (400, 422) and _REFUSED.search(message) is not None


def without_betas(run: Run) -> Run | None:
    """`run` without Anthropic's beta extras (Rule 2); None when it carries none."""
    headers = {
        name: value for name, value in run.caller_headers.items() if name.lower() != BETA_HEADER
    }
    changed = len(headers) != len(run.caller_headers)
    body = run.body
    if b"context_management" in body or b"ttl" in body:
        try:
            value = _decode(body)
        except msgspec.DecodeError:
            value = None
        if isinstance(value, dict):
            removed = value.pop("context_management", None) is not None
            removed = _drop_ttl(value, 0) or removed
            if removed:
                body, changed = _encode(value), True
    if not changed:
        return None
    return msgspec.structs.replace(run, body=body, caller_headers=headers)


def _drop_ttl(value: Any, depth: int) -> bool:
    """Remove `ttl` from every `cache_control` object in `value`; whether any went."""
    if depth > _MAX_DEPTH:
        return False
    removed = False
    if isinstance(value, dict):
        marker = value.get("cache_control")
        if isinstance(marker, dict) and "ttl" in marker:
            del marker["ttl"]
            removed = True
        for key, inner in value.items():
            if key != "cache_control" and isinstance(inner, dict | list):
                removed = _drop_ttl(inner, depth + 1) or removed
    elif isinstance(value, list):
        for inner in value:
            if isinstance(inner, dict | list):
                removed = _drop_ttl(inner, depth + 1) or removed
    return removed
