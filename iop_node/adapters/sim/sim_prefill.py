"""The `sim` provider's prompt prefix cache: prefill time and cached tokens (design §9).

A runtime with prefix caching prefills only the part of a prompt it has not seen; an
agent's turn is cheap only where its conversation was served before. The sim models
that when its adapter settings ask for it, with the same model the bench's upstream
uses (`adapters.sim.prefix_cache`):

- `prefix_cache_tokens`: the prompt tokens the provider's cache holds (least recently
  used prompts go first); 0 (the default) models no cache;
- `prefill_us_per_token`: microseconds of prefill per prompt token not found in the
  cache, `cached_prefill_us_per_token` per token read from it; the prefill is added to
  the time to first token (`ttft_ms`).

The run's usage says how many prompt tokens came from the cache, in the chat field
runtimes use (`usage.prompt_tokens_details.cached_tokens`); a Node that translates the
run for a Messages or Responses caller reports it in that protocol's own field
(`cache_read_input_tokens`, `input_tokens_details.cached_tokens`). The prompt is the
chat body as the sim receives it (a translated request arrives as chat too), laid out as
a chat template would (`render_prompt`). One cache per provider, shared by every Edge
that sends it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from iop_node.adapters.sim.prefix_cache import PrefillCost, PrefixCache, render_prompt
from schemas.config import AdapterSettings

__all__ = ["SimPrefill", "SimPrefillResult"]

#: Prompts a cache bounded in tokens may hold: its token bound is what limits it.
_MANY_SLOTS = 1 << 16


@dataclass(frozen=True, slots=True)
class SimPrefillResult:
    """One prompt's prefill: how long it takes, and its cached tokens (None: the sim
    models no cache, and its usage says nothing of one)."""

    seconds: float
    tokens: int | None


class SimPrefill:
    """One provider's prefix cache and prefill cost (module docstring)."""

    __slots__ = ("_cache", "_cached_s", "_uncached_s")

    def __init__(self, settings: AdapterSettings) -> None:
        self._uncached_s = settings.prefill_us_per_token / 1e6
        self._cached_s = min(settings.cached_prefill_us_per_token / 1e6, self._uncached_s)
        self._cache: PrefixCache | None = None
        if settings.prefix_cache_tokens > 0:
            # the cache's own cost model needs a positive price; the sim prices it here
            cost = PrefillCost(uncached_us=1.0, cached_us=0.0)
            self._cache = PrefixCache(
                cost, slots=_MANY_SLOTS, max_tokens=settings.prefix_cache_tokens
            )

    def cached(self, body: dict[str, Any], prompt_tokens: int) -> SimPrefillResult:
        """Serve a chat body's prompt of `prompt_tokens` (the usage's count): its
        prefill time, and how many of its tokens the cache held.

        The cache matches the prompt as a template lays it out (tools, role markers);
        the usage counts it as `schemas.tokens` does. So the share of the laid-out prompt
        the cache held is the share of `prompt_tokens` reported cached: the two numbers
        are in one unit, and a prompt sent again reports nearly all of it cached. Not
        all: a runtime computes a prompt's last token again to start generating from it
        (llama.cpp's server reads 272 of 273 from its cache), so one token never is."""
        if self._cache is None:
            return SimPrefillResult(seconds=prompt_tokens * self._uncached_s, tokens=None)
        share = self._cache.prefill(render_prompt(body)).cached_share
        cached = min(int(prompt_tokens * share), max(prompt_tokens - 1, 0))
        uncached = prompt_tokens - cached
        return SimPrefillResult(
            seconds=uncached * self._uncached_s + cached * self._cached_s, tokens=cached
        )
