"""Where prompts went: the Edge's index of prompt prefixes per provider (design §4).

A runtime keeps the KV state of the prompts it served and reuses the longest prefix a
new prompt shares with one of them. The Edge cannot see that cache, but it knows what it
sent where: this index remembers, for the prompts it routed, which provider got them,
so a conversation that had to go elsewhere once (its provider was busy) keeps going to
where its prefix now is. The keys are `core.routing.affinity`'s running block hashes, already
scoped to the principal (or shared, per model): the index never mixes two scopes.

Rules:

Rule 1. Recording a prompt remembers its deepest block's hash with the provider it was
        sent to. An agent's next turn is the previous prompt plus the reply and a new
        message, so it contains that hash among its own; one entry per run, whatever
        the prompt's length.

Rule 2. A lookup walks a prompt's blocks from the longest prefix back and answers the
        providers that hold the first block found, with how many blocks back it was:
        the providers holding the longest known prefix of it. Blocks name prefixes that
        end with a message (`core.routing.affinity` Rule 3): the system prompt and tools every
        conversation shares are no match.

Rule 3. The index is bounded and ages: at most `max_entries` block hashes, the least
        recently recorded forgotten first, and an entry older than `ttl_s` neither
        matches nor stays (a runtime's cache forgets too). Time is the caller's (`now`).

Rule 4. A holder is only ever a preference among the providers that could take the
        run now (`core.routing.pool` Rule 7): one that left the pool, or is full, steers
        nothing, and its conversations go to their next choice. Its entries age out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

__all__ = ["DEFAULT_MAX_ENTRIES", "DEFAULT_TTL_S", "PrefixIndex", "PrefixMatch"]

#: Block hashes kept (Rule 3): one per conversation is what routing needs (its last
#: turn's), and 16,384 of them take about 6 MB.
DEFAULT_MAX_ENTRIES: Final = 16_384
#: How long a recorded prompt is taken to stay in its runtime's cache (Rule 3).
DEFAULT_TTL_S: Final = 1800.0

PrefixMatch = tuple[int, frozenset[str]]
"""How many blocks back from the prompt's longest prefix the match is, and the providers
holding it (none: no match)."""

_NO_MATCH: Final[PrefixMatch] = (-1, frozenset())


class PrefixIndex:
    """Block hash -> the providers it was last sent to, and when (module rules)."""

    __slots__ = ("_entries", "_max_entries", "_ttl_s")

    def __init__(self, *, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S):
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("a prefix index needs max_entries >= 1 and ttl_s > 0")
        self._entries: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._max_entries = max_entries
        self._ttl_s = ttl_s

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, provider_id: str, blocks: Sequence[int], now: float) -> None:
        """`provider_id` was sent the prompt of `blocks` (Rule 1); ages out the oldest."""
        if not blocks:
            return  # no message: nothing a conversation could continue
        deepest = blocks[-1]
        entries = self._entries
        holders = entries.get(deepest)
        if holders is None:
            entries[deepest] = {provider_id: now}
        else:
            holders[provider_id] = now
            entries.move_to_end(deepest)
        self._trim(now)

    def lookup(self, blocks: Sequence[int], now: float) -> PrefixMatch:
        """The longest known prefix of `blocks` and who holds it (Rule 2)."""
        entries = self._entries
        oldest = now - self._ttl_s
        for back, block in enumerate(reversed(blocks)):
            holders = entries.get(block)
            if holders is None:
                continue
            fresh = frozenset(pid for pid, at in holders.items() if at >= oldest)
            if fresh:
                return back, fresh
        return _NO_MATCH

    def _trim(self, now: float) -> None:
        entries = self._entries
        while len(entries) > self._max_entries:
            entries.popitem(last=False)
        oldest = now - self._ttl_s
        while entries:
            block, holders = next(iter(entries.items()))
            if max(holders.values()) >= oldest:
                break
            del entries[block]
