"""Continuing a stored OpenAI Responses conversation (`previous_response_id`, design §14).

Runtimes are stateless: a request that names a previous response is sent to its Node with
the whole conversation spelled out. The Edge keeps every stored response as the two
halves it needs for that, the request's own input items and the final response object
(whose `output` items are the model's turn), linked to the response it continued.

Rules:
1. A conversation is its turns oldest first; each turn contributes its input items, then
   its output items. The new request's input items come last.
2. `instructions` are not carried over from a previous response (OpenAI's documented
   behaviour): only the new request's own instructions apply.
3. The body sent on has `input` = the conversation, no `previous_response_id`, and
   `store: false`: the Edge is the store, the runtime must keep nothing.
4. A chain is loaded tip first by following `previous_id`. A link that is missing (the
   response expired or was deleted) or belongs to another principal makes the whole
   chain unknown: half a conversation is never sent as if it were all of it. A chain
   longer than `MAX_CHAIN` turns is refused the same way (it cannot be a real one: the
   store's own bound keeps fewer), and so is one that comes back to itself (an upstream
   that reuses response ids).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

__all__ = [
    "MAX_CHAIN",
    "ChainBroken",
    "ConversationTooLarge",
    "FinalResponse",
    "StoredTurn",
    "continue_body",
    "conversation",
    "order_chain",
    "read_final_response",
    "read_response_id",
]

#: The longest conversation followed back from a `previous_response_id` (Rule 4).
MAX_CHAIN: Final = 10_000


@dataclass(frozen=True, slots=True)
class StoredTurn:
    """One stored response, as a conversation needs it. Its items stay the JSON they were
    stored as: the Edge sends them on as they are (an encoder writes `msgspec.Raw`
    verbatim), so a long conversation is never decoded into objects only to be encoded
    again."""

    id: str
    previous_id: str | None
    input_items: list[msgspec.Raw]
    """The items of the request that produced it (its own, not the conversation's)."""
    output_items: list[msgspec.Raw]
    """The `output` items of its final response object."""


class ChainBroken(Exception):
    """The conversation cannot be rebuilt (Rule 4); the message says which link failed,
    `missing` which response is gone (None: another reason, or the tip itself)."""

    def __init__(self, message: str, *, missing: str | None = None) -> None:
        super().__init__(message)
        self.missing = missing


class ConversationTooLarge(Exception):
    """The conversation `previous_id` continues is longer than the Edge carries
    (`max_conversation_bytes`, `limit`): stored, or held by a WebSocket connection. The
    caller's 400; the message says so."""

    def __init__(self, previous_id: str, limit: int) -> None:
        super().__init__(
            f"Previous response with id '{previous_id}' continues a conversation of more "
            f"than {limit} bytes (edge.responses.max_conversation_bytes); start a new "
            "conversation with the context it needs"
        )


class FinalResponse(msgspec.Struct, frozen=True, kw_only=True):
    """What the Edge reads of a final Responses object: its id and its output items (as
    JSON, unread)."""

    id: str = ""
    output: list[msgspec.Raw] = []


class _ResponseId(msgspec.Struct, frozen=True):
    id: str = ""


_decode_final: Final = msgspec.json.Decoder(FinalResponse).decode
_decode_id: Final = msgspec.json.Decoder(_ResponseId).decode


def read_final_response(data: bytes) -> tuple[str, list[msgspec.Raw]]:
    """The id and output items of a final Responses object (`run_done.response`); raises
    `ValueError` saying what is wrong when `data` is not one."""
    try:
        final = _decode_final(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ValueError(f"not a Responses object: {exc}") from None
    if not final.id:
        raise ValueError("the response object has no `id`")
    return final.id, final.output


def read_response_id(data: bytes) -> str:
    """The id of a final Responses object, the rest skipped (what storing it needs);
    raises `ValueError` as `read_final_response` does."""
    try:
        response_id = _decode_id(data).id
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ValueError(f"not a Responses object: {exc}") from None
    if not response_id:
        raise ValueError("the response object has no `id`")
    return response_id


def order_chain(tip: str, turns: Mapping[str, StoredTurn]) -> list[StoredTurn]:
    """The conversation ending at `tip`, oldest turn first, from the `turns` loaded for
    it (Rule 4); raises `ChainBroken`."""
    chain: list[StoredTurn] = []
    seen: set[str] = set()
    current: str | None = tip
    while current is not None:
        if current in seen:
            raise ChainBroken(
                f"Previous response with id '{tip}' continues itself (through '{current}')."
            )
        seen.add(current)
        turn = turns.get(current)
        if turn is None:
            if current == tip:
                raise ChainBroken(f"Previous response with id '{tip}' not found.")
            raise ChainBroken(
                f"Previous response with id '{tip}' continues response '{current}', "
                "which is no longer stored.",
                missing=current,
            )
        chain.append(turn)
        if len(chain) > MAX_CHAIN:
            raise ChainBroken(
                f"Previous response with id '{tip}' continues more than {MAX_CHAIN} responses."
            )
        current = turn.previous_id
    chain.reverse()
    return chain


def conversation(chain: Sequence[StoredTurn], new_items: Sequence[Any]) -> list[Any]:
    """The input items of a request continuing `chain` (Rule 1): the stored ones as JSON
    (`msgspec.Raw`), then `new_items` as they are."""
    items: list[Any] = []
    for turn in chain:
        items += turn.input_items
        items += turn.output_items
    items += new_items
    return items


def continue_body(body: dict[str, Any], items: list[Any]) -> None:
    """Make `body` carry the whole conversation `items` (Rule 3), in place."""
    body["input"] = items
    body.pop("previous_response_id", None)
    body["store"] = False
