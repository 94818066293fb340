"""Which provider a run would rather have: its affinity key and prompt blocks (design §4).

An agent's turn re-sends the whole conversation plus a little more, and a runtime with a
prefix cache (vLLM, SGLang, llama.cpp) prefills only what it has not seen: the turn is
cheap only on the provider that served the previous one. This module says what a run
is, as far as that goes; `core.routing.pool` Rule 7 decides with it and `core.routing.prefix_index`
remembers where prompts went. Pure: it reads what admission already decoded (the body's
dict, the request's headers) and hashes; nothing here parses the body again. A run of
a model with one provider is not asked for its affinity (`Caller.plan`): there is no
choice for it to steer.

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

Rule 3. A prompt's *blocks* name its prefixes, for the Edge's index of where prompts
        went (`core.routing.prefix_index`). The prompt is laid out as a chat template lays it
        out: its head (the system prompt, or Responses `instructions`, or the leading
        system and developer messages; then the tool definitions), then each message
        or input item. The block of the prefix that ends with message `i` is the hash
        of: the scope, the head, the first message, `i`, and messages `i` and `i - 1`.
        Only the last `BLOCKS` prefixes get a block (a turn adds a few messages: the
        previous turn's end is among them), so the cost of a turn is bounded whatever
        its history. A message's hash reads its structure, and of a long string its
        length and ends (`fingerprint`): what an agent re-sends is the very same text.
        Anthropic's `cache_control` marks are not part of a prompt (a runtime's
        template never lays them out, and Claude Code moves them to the newest message
        every turn): neither the key nor the blocks read them.
        Two prefixes that differ only inside an earlier message share a block; that
        costs a preference that misses, never a wrong answer. Blocks stay in this
        process: they are Python's string hashes (keyed per process) combined, not
        forgeable by a caller who does not know the key.

Rule 4. Rendezvous: every provider has a fixed 64-bit seed from its id; a key's score
        on a provider mixes the two. The highest score is the key's provider, the next
        its second choice, and so on: the same order on every Edge with no state shared,
        and a provider that leaves hands only its own keys on, each to its next choice.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Literal

import msgspec

from iop_edge.core.responses.protocol_requests import input_items

__all__ = [
    "BLOCKS",
    "GOLDEN",
    "MASK",
    "MAX_SESSION_CHARS",
    "SEEDS",
    "SESSION_HEADERS",
    "Affinity",
    "Conversation",
    "KeySource",
    "affinity_of",
    "chat_conversation",
    "fingerprint",
    "messages_conversation",
    "prompt_blocks",
    "provider_seed",
    "rendezvous_order",
    "rendezvous_score",
    "responses_conversation",
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

MASK: Final = (1 << 64) - 1
#: An odd 64-bit constant (the golden ratio's): the multiplier of the score's mix.
GOLDEN: Final = 0x9E3779B97F4A7C15
_SYSTEM_ROLES: Final = frozenset({"system", "developer"})
_encode: Final = msgspec.json.Encoder().encode


class Affinity(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a run would rather have (module rules): its key and its prompt's blocks."""

    key: int
    """The rendezvous key (Rules 1, 2, 4): 64 bits."""
    source: KeySource
    blocks: tuple[int, ...] = ()
    """The blocks of its prompt's last prefixes (Rule 3), the longest last."""


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
    conversation: Conversation,
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
    `headers` the request's session headers, lowercase; `conversation` reads the body's
    conversation in its caller protocol's layout."""
    prefix_scope = "*" if shared_prefixes else principal
    head, messages = conversation(body)
    first = messages[0] if messages else None
    session = session_header(headers, body)
    if session is not None:
        key = _hash64(_scope(principal, model), b"session", session.encode())
    else:
        # Rule 1 b/c: the first message, seeded with the scope (not with the system
        # prompt or the tools, which may change between turns); a chain's first turn
        # was keyed so
        key = _hash64(_scope(prefix_scope, model), b"prompt", _encode(_unmarked(first)))
    blocks = prompt_blocks(head, messages, (prefix_scope, model))
    source: KeySource = "session" if session is not None else "chain" if chained else "prefix"
    return Affinity(key=key, source=source, blocks=blocks)


#: How many of a prompt's last prefixes get a block (Rule 3).
BLOCKS: Final = 16


def prompt_blocks(
    head: Sequence[Any], messages: Sequence[Any], scope: tuple[str, str]
) -> tuple[int, ...]:
    """The blocks of a prompt's last `BLOCKS` prefixes, the longest last (Rule 3)."""
    if not messages:
        return ()
    count = len(messages)
    start = max(1, count - BLOCKS + 1)
    # each message's hash once: the window's, the one before it, and the first
    hashes = [fingerprint(message) for message in messages[max(start - 2, 0) :]]
    first = hashes[0] if start <= 2 else fingerprint(messages[0])
    base = hash((scope, tuple([fingerprint(block) for block in head]), first))
    previous = hashes[0] if start >= 2 else 0
    blocks: list[int] = []
    window = hashes[-(count - start + 1) :]
    for position, current in zip(range(start, count + 1), window, strict=True):
        blocks.append(hash((base, position, current, previous)))
        previous = current
    return tuple(blocks)


def fingerprint(value: object) -> int:
    """A hash of a decoded JSON value, walked as it is (Rule 3): its strings' hashes
    (computed in C, keyed per process; a long string's from its length and ends),
    combined along the structure (a long list's from its length and its first and last
    items). Nothing is encoded again, and a message costs a few objects' hashes, not a
    pass over its bytes. A stored item (`msgspec.Raw`, a rebuilt Responses
    conversation) is decoded first, so it hashes as the item it was when it arrived."""
    kind = type(value)
    if kind is str:
        return _text_hash(value)  # type: ignore[arg-type]
    if kind is dict:
        pairs: dict[str, Any] = value  # type: ignore[assignment]
        return hash(
            tuple([(key, fingerprint(item)) for key, item in pairs.items() if key not in _MARKS])
        )
    if kind is list:
        items: list[Any] = value  # type: ignore[assignment]
        if len(items) <= 2:
            return hash((_LIST, *[fingerprint(item) for item in items]))
        return hash((_LIST, len(items), fingerprint(items[0]), fingerprint(items[-1])))
    if kind is msgspec.Raw:
        return fingerprint(_decode_raw(value))  # type: ignore[arg-type]
    return hash((kind.__name__, value))


#: Keys that mark a prompt for a cache without being part of it: Anthropic's
#: `cache_control` moves to the newest message every turn (Claude Code puts it there), and
#: a runtime's chat template never lays it out.
_MARKS: Final = frozenset({"cache_control"})


def _unmarked(value: Any) -> Any:
    """`value` without `_MARKS` keys at any depth (itself when it has none)."""
    if isinstance(value, dict):
        if _MARKS.isdisjoint(value) and not any(isinstance(v, dict | list) for v in value.values()):
            return value
        return {key: _unmarked(item) for key, item in value.items() if key not in _MARKS}
    if isinstance(value, list):
        return [_unmarked(item) for item in value]
    return value


def _text_hash(text: str) -> int:
    """A string's hash; a long one's by its length and its ends (`SAMPLE_CHARS` each)."""
    if len(text) <= 2 * SAMPLE_CHARS:
        return hash(text)
    return hash((len(text), text[:SAMPLE_CHARS], text[-SAMPLE_CHARS:]))


#: How much of each end of a long string its hash reads (`fingerprint`).
SAMPLE_CHARS: Final = 96
_LIST: Final = "\x00list"
_decode_raw: Final = msgspec.json.Decoder().decode


Conversation = Callable[[Mapping[str, Any]], tuple[list[Any], Sequence[Any]]]
"""How a protocol's body lays out its conversation: the blocks before the first message
(system, tools) and the messages (each caller protocol names its own)."""


def chat_conversation(body: Mapping[str, Any]) -> tuple[list[Any], Sequence[Any]]:
    """Chat completions' (and completions': the prompt is the message)."""
    messages = _list(body.get("messages"))
    if not messages and "prompt" in body:
        messages = [body.get("prompt")]
    return _with_leading([], messages, body)


def messages_conversation(body: Mapping[str, Any]) -> tuple[list[Any], Sequence[Any]]:
    """Anthropic Messages': its `system`, then its messages."""
    system = body.get("system")
    return _with_leading([system] if system else [], _list(body.get("messages")), body)


def responses_conversation(body: Mapping[str, Any]) -> tuple[list[Any], Sequence[Any]]:
    """OpenAI Responses': its `instructions`, then its input items (a string input is the
    message the store keeps of it, and a chain begins with)."""
    instructions = body.get("instructions")
    head = [instructions] if instructions else []
    return _with_leading(head, input_items(body.get("input")), body)


def _with_leading(
    head: list[Any], messages: Sequence[Any], body: Mapping[str, Any]
) -> tuple[list[Any], Sequence[Any]]:
    """The head grown by the system messages that lead the conversation and the tools."""
    leading = 0
    while leading < len(messages) and _role(messages[leading]) in _SYSTEM_ROLES:
        head.append(messages[leading])
        leading += 1
    tools = body.get("tools")
    if tools:
        head.append(tools)
    return head, messages[leading:]


def _list(value: object) -> Sequence[Any]:
    return value if isinstance(value, list) else ()


def _role(message: object) -> object:
    return message.get("role") if isinstance(message, dict) else None


def _scope(principal: str, model: str) -> bytes:
    return _encode([principal, model])


def _hash64(*parts: bytes) -> int:
    """The same 64 bits on every Edge (a rendezvous key, a provider's seed)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    return int.from_bytes(digest.digest()[:8], "big")


SEEDS: Final[dict[str, int]] = {}
"""Provider id -> its seed (`provider_seed`), for loops that read it inline."""
#: Provider ids whose seeds are kept (a refresh may bring new ids for ever).
_MAX_SEEDS: Final = 1 << 20


def provider_seed(provider_id: str) -> int:
    """The fixed 64-bit seed of a provider (Rule 4), remembered once worked out."""
    seed = SEEDS.get(provider_id)
    if seed is None:
        if len(SEEDS) >= _MAX_SEEDS:
            SEEDS.clear()
        seed = SEEDS[provider_id] = _hash64(b"provider", provider_id.encode())
    return seed


def rendezvous_score(key: int, seed: int) -> int:
    """A key's score on the provider of `seed` (Rule 4): higher is preferred. Both are
    already uniform hashes; the multiply spreads every bit of their combination into
    the high bits, which decide the comparison."""
    mixed = ((key ^ seed) * GOLDEN) & MASK
    return mixed ^ (mixed >> 31)


@functools.lru_cache(maxsize=4096)
def placement_key(model_id: str) -> int:
    """The rendezvous key of a model's placement (`core.routing.pool` Rule 8): where a model
    nobody holds is loaded, the same on every Edge."""
    return _hash64(b"placement", model_id.encode())


def rendezvous_order(key: int, provider_ids: Iterable[str]) -> list[str]:
    """`provider_ids` in the key's order of preference (Rule 4), for tests and tools."""
    return sorted(
        provider_ids, key=lambda pid: rendezvous_score(key, provider_seed(pid)), reverse=True
    )
