"""How much of each provider's recent prompts its runtime took from its prefix cache
(design §6, §18.2): the `cached_share` of `GET /catalog` and the pool page. Pure: the
metering code hands each finished run's reported counts here; nothing reads a clock.

Rules:
1. Only counts the runtime reported (`usage_source: provider`) are observed: an estimate
   knows nothing of a cache, and would read as a miss.
2. "Recent" is counted in runs, not seconds: each observed run weighs `DECAY` times less
   for every run of the same provider after it (a half-life of `HALF_LIFE_RUNS` runs),
   so a provider's share follows its last few dozen runs and costs two numbers.
3. The share is cached / prompt tokens of those weighted runs, in 0..1 (a runtime cannot
   take more from cache than the prompt it read); None before the provider reported a
   prompt, so "no cache hits yet" and "never measured" stay apart.
4. Tracked per provider id; a provider a refresh removes is forgotten (`forget`), so the
   memory is bounded by the pool.
"""

from __future__ import annotations

from typing import Final

__all__ = ["DECAY", "HALF_LIFE_RUNS", "CacheShares"]

HALF_LIFE_RUNS: Final = 32
DECAY: Final = 0.5 ** (1 / HALF_LIFE_RUNS)


class CacheShares:
    """Per provider, two decayed sums: prompt tokens and the cached part of them."""

    __slots__ = ("_sums",)

    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}

    def observe(self, provider: str, *, prompt_tokens: int, cached_tokens: int) -> None:
        """One run the provider's runtime reported on (Rules 1-2)."""
        if prompt_tokens <= 0:
            return
        cached = min(max(cached_tokens, 0), prompt_tokens)
        sums = self._sums.get(provider)
        if sums is None:
            self._sums[provider] = [float(prompt_tokens), float(cached)]
            return
        sums[0] = sums[0] * DECAY + prompt_tokens
        sums[1] = sums[1] * DECAY + cached

    def share(self, provider: str) -> float | None:
        """The provider's recent cached share (Rule 3)."""
        sums = self._sums.get(provider)
        if sums is None or sums[0] <= 0:
            return None
        return min(sums[1] / sums[0], 1.0)

    def forget(self, provider: str) -> None:
        """A provider removed from the pool (Rule 4)."""
        self._sums.pop(provider, None)
