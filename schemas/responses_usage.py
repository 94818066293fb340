"""A Response's `usage` object (OpenAI Responses), as IOP writes it: the Node from a run's
tokens, the Edge for a turn that ran nothing (a WebSocket warm-up). Defined once, so the
two write the members the official SDKs require alike (`cache_write_tokens` among them)."""

from __future__ import annotations

import msgspec

__all__ = ["CachedTokens", "ReasoningTokens", "ResponsesUsage"]


class CachedTokens(msgspec.Struct, frozen=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    """A runtime caches prefixes by itself; nothing is written to a cache on request."""


class ReasoningTokens(msgspec.Struct, frozen=True):
    reasoning_tokens: int = 0


class ResponsesUsage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int = 0
    input_tokens_details: CachedTokens = CachedTokens()
    output_tokens: int = 0
    output_tokens_details: ReasoningTokens = ReasoningTokens()
    total_tokens: int = 0
