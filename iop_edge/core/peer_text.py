"""Text a peer sent, as the Edge's log shows it: quoted and cut short.

A Node is authenticated, not trusted (`node_input`), and an unauthenticated peer not even
that: an id, a reason or a version string it sends may hold a newline, which written as
it is would forge the next log line, or a megabyte, which would be a megabyte of log.
Every such text goes through `logged` on its way into a log line.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_LOGGED_CHARS", "logged"]

#: How much of one peer-sent text a log line shows.
MAX_LOGGED_CHARS: Final = 200


def logged(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """`text` quoted as a Python literal (a newline shows as `\\n`), cut after `limit`
    characters."""
    return repr(text if len(text) <= limit else f"{text[:limit]}...")
