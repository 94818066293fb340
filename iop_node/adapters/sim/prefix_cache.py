"""A runtime's prompt prefix cache, as the `sim` provider and the bench's upstream model it.

Engines (llama.cpp's slots, vLLM's and SGLang's prefix caching) keep the KV state of the
prompts they served and reuse the longest prefix a new prompt shares with one of them:
only the rest is prefilled. Prefill is the cost that dominates an agent's turn on a
self-hosted runtime (tens of thousands of prompt tokens, one reply of a few hundred),
so whether the prefix matches decides whether a turn takes a second or a minute.

The model, deliberately simple:

- The prompt is the text a chat template would lay out, in the order it lays it out:
  the system prompt, the tool definitions, then each message (`render_prompt`; a
  Messages body and a chat completions body render alike, so the native and the
  translated path meet the same cache).
- A token is `CHARS_PER_TOKEN` characters (`schemas.tokens`), the same rule as IOP's
  estimate. What matters here is not the count but where two prompts first differ.
- The cache holds the last `slots` prompts served (llama.cpp's default is 4 slots on a
  server started with `-np 4`), and at most `max_tokens` prompt tokens in all when that
  is set (vLLM's and SGLang's block pools: the least recently used prompts go first;
  the newest always stays); a new prompt reuses its longest common prefix with any of
  them, and then takes that slot (or the least recently used one). Bounded in tokens,
  it takes the slot only of a prompt it continues whole (the previous turn of its
  conversation); one that shares less (a system prompt) is kept beside it, as a block
  pool keeps both.
- A prefill costs `uncached_us` per token it computes and `cached_us` per token it
  reuses (reading a cached prefix is not free, but it is one or two orders cheaper).

Pure: no I/O, no clock. The sim (`adapters.sim.sim_prefill`) and the bench's upstream
(`bench.upstream --prefill-us-per-token`) sleep for `Prefill.seconds`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final

from schemas.tokens import CHARS_PER_TOKEN

#: llama.cpp's slot count for a server started with `-np 4`.
DEFAULT_SLOTS: Final = 4


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """What one prompt token costs to prefill, computed and reused (microseconds)."""

    uncached_us: float
    cached_us: float

    def __post_init__(self) -> None:
        if self.uncached_us <= 0:
            raise ValueError("the prefill cost of an uncached token must be > 0")
        if not 0 <= self.cached_us <= self.uncached_us:
            raise ValueError("a cached token must cost from 0 to an uncached one's cost")


@dataclass(frozen=True, slots=True)
class Prefill:
    """One prompt's prefill: its tokens, how many came from the cache, what it took, and
    the share of its text the cache held (`cached_share`: whole tokens round it down)."""

    tokens: int
    cached_tokens: int
    seconds: float
    cached_share: float = 0.0


class PrefixCache:
    """The last `slots` prompts served and what a new one reuses of them (module rules)."""

    def __init__(
        self, cost: PrefillCost, *, slots: int = DEFAULT_SLOTS, max_tokens: int | None = None
    ) -> None:
        if slots < 1:
            raise ValueError("a prefix cache needs at least one slot")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("a prefix cache bounded in tokens needs at least one")
        self._cost = cost
        self._slots = slots
        self._max_chars = None if max_tokens is None else max_tokens * CHARS_PER_TOKEN
        self._held_chars = 0
        self._prompts: OrderedDict[int, str] = OrderedDict()
        self._next_slot = 0

    def prefill(self, prompt: str) -> Prefill:
        """Serve `prompt`: what its prefill reuses and costs; it then holds a slot."""
        best_slot: int | None = None
        best = 0
        for slot, held in self._prompts.items():  # least recently used first
            shared = common_prefix_chars(prompt, held)
            if shared > best or best_slot is None:
                best_slot, best = slot, shared
        extends = best_slot is not None and best == len(self._prompts[best_slot])
        if (
            best_slot is None
            or (best == 0 and len(self._prompts) < self._slots)
            or (self._max_chars is not None and not extends)
        ):
            # bounded in tokens, a prompt keeps its own blocks beside the ones it shares
            best_slot = self._next_slot
            self._next_slot += 1
        replaced = self._prompts.get(best_slot)
        self._held_chars += len(prompt) - (0 if replaced is None else len(replaced))
        self._prompts[best_slot] = prompt
        self._prompts.move_to_end(best_slot)
        limit = self._max_chars
        while len(self._prompts) > self._slots or (
            limit is not None and self._held_chars > limit and len(self._prompts) > 1
        ):
            _, evicted = self._prompts.popitem(last=False)
            self._held_chars -= len(evicted)
        tokens = -(-len(prompt) // CHARS_PER_TOKEN)
        cached = min(best // CHARS_PER_TOKEN, tokens)
        seconds = ((tokens - cached) * self._cost.uncached_us + cached * self._cost.cached_us) / 1e6
        share = best / len(prompt) if prompt else 0.0
        return Prefill(tokens=tokens, cached_tokens=cached, seconds=seconds, cached_share=share)


def common_prefix_chars(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share. Bisects with slice comparisons (done
    in C), so an agent's 100,000-character prompts cost microseconds, not a Python loop."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def render_prompt(payload: dict[str, Any]) -> str:
    """The text a chat template lays out for a Messages or chat completions body: the
    system prompt, the tool definitions, then the messages, in order."""
    lines: list[str] = []
    system = payload.get("system")
    if system is not None:
        lines.append(f"system: {_text(system)}")
    for tool in payload.get("tools") or ():
        lines.append(f"tool: {_compact(tool)}")
    for message in payload.get("messages") or ():
        if isinstance(message, dict):
            lines.append(f"{message.get('role')}: {_text(message.get('content'))}")
    return "\n".join(lines)


def _text(content: Any) -> str:
    """A content value's text: a string, or the blocks/parts of a list, each its text, its
    tool call or its tool result."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return "" if content is None else _compact(content)
    pieces = []
    for block in content:
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            pieces.append(block["text"])
        elif isinstance(block, dict) and "content" in block:  # a tool result
            pieces.append(_text(block["content"]))
        else:
            pieces.append(_compact(block))
    return "\n".join(pieces)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
