"""Which provider a run would rather have: its affinity key and prompt blocks (design §4).

An agent's turn re-sends the whole conversation plus a little more, and a runtime with a
prefix cache (vLLM, SGLang, llama.cpp) prefills only what it has not seen: the turn is
cheap only on the provider that served the previous one. This module says what a run
is, as far as that goes; `core.pool` Rule 7 decides with it and `core.prefix_index`
remembers where prompts went. Pure: it reads what admission already decoded (the body's
dict, the request's headers) and hashes; nothing here parses the body again.

Rules:

Rule 1. A run's *key* names its conversation, the first that applies:
        a. a session id the caller sends, headers in this order:
           `x-claude-code-session-id` (Claude Code), `session_id` or `session-id`
           (Codex), then the body's `prompt_cache_key` (Codex, OpenAI's Responses and
           chat field), then `x-session-id`, `x-session-affinity` (any client);
        b. for a Responses request with `previous_response_id`, its chain: the
           conversation the Edge rebuilt from the store begins with the chain's first
           turn, and the key is that turn's (c.), so every continuation lands where the
           chain began, on any Edge;
        c. otherwise the prompt itself: its first message (the first that is not a
           system or developer message), after the system prompt and tool
           definitions. A conversation's later turns begin the same way.
        A session id is used as sent (at most `MAX_SESSION_CHARS` characters; an empty
        or longer one does not count, and the next source decides).

Rule 2. Keys are scoped: a key is the hash of the principal, the model and the value,
        so one principal's session ids or prompts never steer another's runs. A model
        with `routing.shared_prefixes` leaves the principal out of a prompt's key (c.)
        and of its blocks (Rule 3), never out of a session id's. (A chain is keyed as
        its first turn was; only its own principal can continue it.)

Rule 3. A prompt's *blocks* are what the provider is sent, in the order a chat template
        lays it out: the system prompt (or Responses `instructions`, or the leading
        system and developer messages), the tool definitions, then each message or
        input item. Block `i`'s hash covers blocks `0..i` (a running hash seeded with
        the scope), so two prompts share block `i`'s hash exactly when they share their
        first `i + 1` blocks. `anchor` is the number of blocks before the first message:
        a match of those alone is a shared system prompt, not a conversation, and does
        not count (`core.prefix_index`).

Rule 4. Rendezvous: every provider has a fixed 64-bit seed from its id; a key's score
        on a provider mixes the two. The highest score is the key's provider, the next
        its second choice, and so on: the same order on every Edge with no state shared,
        and a provider that leaves hands only its own keys on, each to its next choice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal

import msgspec

from iop_edge.core.protocol_requests import input_items
from schemas.protocols import CallerProtocol

__all__ = [
    "MAX_SESSION_CHARS",
    "SESSION_HEADERS",
    "Affinity",
    "KeySource",
    "affinity_of",
    "provider_seed",
    "rendezvous_order",
    "rendezvous_score",
    "session_header",
]

#: The session headers of Rule 1 a, in their order (lowercase, as HTTP/2 and ASGI give
#: them). `prompt_cache_key` in the body comes between the Codex and the generic ones.
SESSION_HEADERS: Final = (
    "x-claude-code-session-id",
    "session_id",
    "session-id",
    "x-session-id",
    "x-session-affinity",
)
#: The headers that come before the body's `prompt_cache_key` (Rule 1 a).
_BEFORE_CACHE_KEY: Final = frozenset(SESSION_HEADERS[:3])
#: The longest session id taken (Rule 1).
MAX_SESSION_CHARS: Final = 256

KeySource = Literal["session", "chain", "prefix"]

_MASK: Final = (1 << 64) - 1
#: An odd 64-bit constant (the golden ratio's): the multiplier of the score's mix.
_GOLDEN: Final = 0x9E3779B97F4A7C15
_SYSTEM_ROLES: Final = frozenset({"system", "developer"})
_encode: Final = msgspec.json.Encoder().encode


class Affinity(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a run would rather have (module rules): its key and its prompt's blocks."""

    key: int
    """The rendezvous key (Rules 1, 2, 4): 64 bits."""
    source: KeySource
    blocks: tuple[int, ...] = ()
    """The running hashes of its prompt's blocks (Rule 3), 64 bits each."""
    anchor: int = 0
    """How many of `blocks` come before the first message (Rule 3)."""


def session_header(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The session id of Rule 1 a, or None."""
    for name in SESSION_HEADERS:
        if name not in _BEFORE_CACHE_KEY:
            cache_key = body.get("prompt_cache_key")
            if isinstance(cache_key, str) and _usable(cache_key):
                return cache_key
        value = headers.get(name)
        if value is not None and _usable(value):
            return value
    return None


def _usable(value: str) -> bool:
    return 0 < len(value) <= MAX_SESSION_CHARS


def affinity_of(
    protocol: CallerProtocol,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    principal: str,
    model: str,
    shared_prefixes: bool = False,
    chained: bool = False,
) -> Affinity:
    """The affinity of a run of `model` for `principal` (module rules). `body` is the
    body sent on (a Responses continuation's with its conversation rebuilt: `chained`);
    `headers` the request's session headers, lowercase."""
    prefix_scope = "*" if shared_prefixes else principal
    blocks, anchor = prompt_blocks(protocol, body, _scope(prefix_scope, model))
    session = session_header(headers, body)
    if session is not None:
        return Affinity(
            key=_hash64(_scope(principal, model), b"session", session.encode()),
            source="session",
            blocks=blocks,
            anchor=anchor,
        )
    # Rule 1 b/c: the first message, seeded with the scope (not with the system prompt
    # or the tools, which may change between turns); a chain's first turn was keyed so
    first = _first_message(protocol, body)
    key = _hash64(_scope(prefix_scope, model), b"prompt", _encode(first))
    return Affinity(key=key, source="chain" if chained else "prefix", blocks=blocks, anchor=anchor)


def prompt_blocks(
    protocol: CallerProtocol, body: Mapping[str, Any], scope: bytes
) -> tuple[tuple[int, ...], int]:
    """The running hashes of a prompt's blocks and its anchor (Rule 3)."""
    head, messages = _layout(protocol, body)
    running = hashlib.blake2b(scope, digest_size=8)
    hashes: list[int] = []
    for block in head:
        running.update(_encode(block))
        running.update(b"\x1e")
        hashes.append(int.from_bytes(running.copy().digest(), "big"))
    anchor = len(hashes)
    for message in messages:
        running.update(_encode(message))
        running.update(b"\x1e")
        hashes.append(int.from_bytes(running.copy().digest(), "big"))
    return tuple(hashes), anchor


def _layout(protocol: CallerProtocol, body: Mapping[str, Any]) -> tuple[list[Any], Sequence[Any]]:
    """A body's blocks before the first message (system, tools) and its messages."""
    head: list[Any] = []
    if protocol == "messages":
        system = body.get("system")
        if system:
            head.append(system)
        messages = _list(body.get("messages"))
    elif protocol == "responses":
        instructions = body.get("instructions")
        if instructions:
            head.append(instructions)
        # a string input is the message the store keeps of it (and a chain begins with)
        messages = input_items(body.get("input"))
    else:
        messages = _list(body.get("messages"))
        if not messages and "prompt" in body:  # completions: the prompt is the message
            messages = [body.get("prompt")]
    leading = 0
    while leading < len(messages) and _role(messages[leading]) in _SYSTEM_ROLES:
        head.append(messages[leading])
        leading += 1
    tools = body.get("tools")
    if tools:
        head.append(tools)
    return head, messages[leading:]


def _first_message(protocol: CallerProtocol, body: Mapping[str, Any]) -> Any:
    _, messages = _layout(protocol, body)
    return messages[0] if messages else None


def _list(value: object) -> Sequence[Any]:
    return value if isinstance(value, list) else ()


def _role(message: object) -> object:
    return message.get("role") if isinstance(message, dict) else None


def _scope(principal: str, model: str) -> bytes:
    return _encode([principal, model])


def _hash64(*parts: bytes) -> int:
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    return int.from_bytes(digest.digest(), "big")


_seeds: dict[str, int] = {}
#: Provider ids whose seeds are kept (a refresh may bring new ids for ever).
_MAX_SEEDS: Final = 1 << 20


def provider_seed(provider_id: str) -> int:
    """The fixed 64-bit seed of a provider (Rule 4), remembered once worked out."""
    seed = _seeds.get(provider_id)
    if seed is None:
        if len(_seeds) >= _MAX_SEEDS:
            _seeds.clear()
        seed = _seeds[provider_id] = _hash64(b"provider", provider_id.encode())
    return seed


def rendezvous_score(key: int, seed: int) -> int:
    """A key's score on the provider of `seed` (Rule 4): higher is preferred. Both are
    already uniform hashes; the multiply spreads every bit of their combination into
    the high bits, which decide the comparison."""
    mixed = ((key ^ seed) * _GOLDEN) & _MASK
    return mixed ^ (mixed >> 31)


def rendezvous_order(key: int, provider_ids: Iterable[str]) -> list[str]:
    """`provider_ids` in the key's order of preference (Rule 4), for tests and tools."""
    return sorted(
        provider_ids, key=lambda pid: rendezvous_score(key, provider_seed(pid)), reverse=True
    )
