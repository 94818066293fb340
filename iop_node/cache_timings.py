"""llama.cpp's `timings`: how a runtime that says nothing else of its prefix cache says it.

llama.cpp's server puts a `timings` object at the top level of a whole response and of a
stream's last event: `prompt_n` is the prompt tokens it computed, `cache_n` the ones it
reused from the slot's cache. Newer servers also say it in OpenAI's
`usage.prompt_tokens_details.cached_tokens`, which wins when present; older ones, and
forks, say it here only. Both the relay (`reply`) and the translators (`protocols`) read
it through this module, leniently: `timings` is no standard, so a member that does not
read is as if absent, never a broken reply.
"""

from __future__ import annotations

from typing import Final

import msgspec

__all__ = ["timings_cached"]


class _Timings(msgspec.Struct):
    cache_n: int | None = None


_decode: Final = msgspec.json.Decoder(_Timings | None).decode


def timings_cached(raw: msgspec.Raw | None) -> int | None:
    """`timings.cache_n` from a reply's raw `timings` member (empty or None: it has none);
    None when there is none or it does not read."""
    if not raw:
        return None
    try:
        timings = _decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    if timings is None or timings.cache_n is None:
        return None
    return max(timings.cache_n, 0)
