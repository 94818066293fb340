"""A principal's standing against its limits, as the two header families the caller
protocols use (design §15); each protocol names its family (`CallerProtocol.rate_limit_headers`).

- Chat completions and Responses (OpenAI's clients): `x-ratelimit-limit-requests`,
  `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests` and the same three for
  `-tokens`; a reset is a duration (`1s`, `6m0s`), as OpenAI writes it.
- Anthropic Messages: `anthropic-ratelimit-requests-limit`, `-remaining`, `-reset` and the
  same for `tokens`; a reset is the RFC 3339 time the limit is full again, as
  Anthropic writes it.

Only the limits that are set appear; a principal without limits gets none of them.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from iop_edge.core.principals import SECONDS_PER_DAY, format_reset
from iop_edge.runtime.runs.limits import RateLimits

__all__ = ["Headers", "anthropic_rate_limit_headers", "openai_rate_limit_headers"]

Headers = list[tuple[bytes, bytes]]


def openai_rate_limit_headers(limits: RateLimits) -> Headers:
    """`limits` as OpenAI's headers (chat completions, Responses)."""
    headers: Headers = []
    for kind, limit, remaining, reset_s in _kinds(limits):
        headers += [
            (f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()),
            (f"x-ratelimit-remaining-{kind}".encode(), str(remaining or 0).encode()),
            (f"x-ratelimit-reset-{kind}".encode(), format_reset(reset_s or 0.0).encode()),
        ]
    return headers


def anthropic_rate_limit_headers(limits: RateLimits, *, wall: float | None = None) -> Headers:
    """`limits` as Anthropic's headers (Messages); `wall` (Unix time, now by default)
    dates a reset."""
    headers: Headers = []
    for kind, limit, remaining, reset_s in _kinds(limits):
        at = (time.time() if wall is None else wall) + min(reset_s or 0.0, SECONDS_PER_DAY)
        stamp = datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")
        headers += [
            (f"anthropic-ratelimit-{kind}-limit".encode(), str(limit).encode()),
            (f"anthropic-ratelimit-{kind}-remaining".encode(), str(remaining or 0).encode()),
            (f"anthropic-ratelimit-{kind}-reset".encode(), stamp.replace("+00:00", "Z").encode()),
        ]
    return headers


def _kinds(limits: RateLimits) -> list[tuple[str, int, int | None, float | None]]:
    """The limits that are set: kind, limit, remaining, seconds to reset."""
    if not limits:
        return []
    kinds = (
        ("requests", limits.limit_requests, limits.remaining_requests, limits.reset_requests_s),
        ("tokens", limits.limit_tokens, limits.remaining_tokens, limits.reset_tokens_s),
    )
    return [
        (kind, limit, remaining, reset_s)
        for kind, limit, remaining, reset_s in kinds
        if limit is not None
    ]
