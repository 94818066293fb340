"""A principal's standing against its limits, as the caller's protocol's headers (design §15).

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
from schemas.protocols import CallerProtocol

__all__ = ["rate_limit_headers"]

Headers = list[tuple[bytes, bytes]]


def rate_limit_headers(
    limits: RateLimits, protocol: CallerProtocol, *, wall: float | None = None
) -> Headers:
    """`limits` as `protocol`'s headers; `wall` (Unix time, now by default) dates an
    Anthropic reset."""
    if not limits:
        return []
    kinds = (
        ("requests", limits.limit_requests, limits.remaining_requests, limits.reset_requests_s),
        ("tokens", limits.limit_tokens, limits.remaining_tokens, limits.reset_tokens_s),
    )
    headers: Headers = []
    for kind, limit, remaining, reset_s in kinds:
        if limit is None:
            continue
        left = str(remaining or 0).encode()
        if protocol == "messages":
            at = (time.time() if wall is None else wall) + min(reset_s or 0.0, SECONDS_PER_DAY)
            stamp = datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")
            headers += [
                (f"anthropic-ratelimit-{kind}-limit".encode(), str(limit).encode()),
                (f"anthropic-ratelimit-{kind}-remaining".encode(), left),
                (
                    f"anthropic-ratelimit-{kind}-reset".encode(),
                    stamp.replace("+00:00", "Z").encode(),
                ),
            ]
        else:
            headers += [
                (f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()),
                (f"x-ratelimit-remaining-{kind}".encode(), left),
                (f"x-ratelimit-reset-{kind}".encode(), format_reset(reset_s or 0.0).encode()),
            ]
    return headers
