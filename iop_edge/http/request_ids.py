"""A request's ids: IOP's own for each request (the run id, `req_<24 hex>`), and the one
the caller sees in `x-request-id`, its own when it sent a sane one, so its logs and ours
match. Every answer carries one, a refusal at the HTTP framing included."""

from __future__ import annotations

import re
import secrets
from typing import Final

__all__ = ["new_run_id", "request_id"]

_REQUEST_ID: Final = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def new_run_id() -> str:
    return f"req_{secrets.token_hex(12)}"


def request_id(supplied: str | None, fallback: str) -> str:
    """The caller's `x-request-id` when it is sane, else `fallback` (IOP's own)."""
    return supplied if supplied and _REQUEST_ID.match(supplied) else fallback
