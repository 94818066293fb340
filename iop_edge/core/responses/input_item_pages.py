"""`GET /v1/responses/{id}/input_items`: the items a stored response was generated from,
a page at a time (OpenAI's list of them, design §14).

Rules:
1. A response's input items are its conversation before its own turn (each earlier
   turn's input, then its output) followed by its own request's input: what the model
   read (`response_chain` Rule 1).
2. Every item has an `id`. An item the caller sent without one (a plain message, a tool
   output) gets `<kind>_in_<response>_<index>`, `<response>` being the response whose
   request sent it and `<index>` its place there: the same on every read and in every
   later response's list, so a page's `last_id` finds the next page (`after`), and never
   the id of another item (a response's output items are `<kind>_<response>_<index>`).
   A message is listed in the shape OpenAI lists it, whatever shorthand it was sent
   in: `type: message`, its `content` parts (a string becomes one `input_text`, or
   `output_text` for the assistant's).
3. `order` is `desc` (newest first, OpenAI's default) or `asc`; `limit` 1-100 (20);
   `after` an item id of the list, the page starting just past it. Anything else is the
   caller's error, naming the parameter.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec

from iop_edge.core.responses.response_chain import StoredTurn

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "PageRequestInvalid", "item_page"]

DEFAULT_LIMIT: Final = 20
MAX_LIMIT: Final = 100
_KINDS: Final = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


class PageRequestInvalid(ValueError):
    """A query parameter the list cannot take (Rule 3); `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def item_page(chain: Sequence[StoredTurn], query: Mapping[str, str]) -> bytes:
    """The list object of the input items of `chain`'s last response (Rules 1-3), its
    conversation oldest first, for `query` (`order`, `limit`, `after`); raises
    `PageRequestInvalid`."""
    response_id = chain[-1].id
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise PageRequestInvalid("order", f"order must be 'asc' or 'desc', not {order!r}")
    raw_limit = query.get("limit", str(DEFAULT_LIMIT))
    limit = int(raw_limit) if raw_limit.isdigit() else 0
    if not 1 <= limit <= MAX_LIMIT:
        raise PageRequestInvalid("limit", f"limit must be 1 to {MAX_LIMIT}, not {raw_limit!r}")
    named = _listed(chain)
    if order == "desc":
        named.reverse()
    start = 0
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in named]
        if after not in ids:
            raise PageRequestInvalid("after", f"no input item {after!r} in response {response_id}")
        start = ids.index(after) + 1
    data = named[start : start + limit]
    return msgspec.json.encode(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + limit < len(named),
        }
    )


def _listed(chain: Sequence[StoredTurn]) -> list[dict[str, Any]]:
    """The conversation of `chain`'s last response (Rule 1), each item with its id
    (Rule 2)."""
    named: list[dict[str, Any]] = []
    for turn in chain:
        owner = turn.id.removeprefix("resp_")
        named += _with_ids(turn.input_items, f"in_{owner}")
        if turn is not chain[-1]:
            named += _with_ids(turn.output_items, f"out_{owner}")
    return named


def _with_ids(items: Sequence[Any], owner: str) -> list[dict[str, Any]]:
    """Each item as an object with an `id` (Rule 2); an item that is no object is left out
    (the store keeps only what the model read, which is objects)."""
    named = []
    for index, item in enumerate(items):
        value = msgspec.json.decode(item) if isinstance(item, msgspec.Raw) else item
        if not isinstance(value, dict):
            continue
        if "role" in value and value.get("type", "message") == "message":
            value = _message(value)
        if not isinstance(value.get("id"), str):
            kind = _KINDS.get(str(value.get("type")), "item")
            value = {"id": f"{kind}_{owner}_{index}", **value}
        named.append(value)
    return named


def _message(item: dict[str, Any]) -> dict[str, Any]:
    """A message item in OpenAI's listed shape (Rule 2)."""
    content = item.get("content")
    if isinstance(content, str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        content = [{"type": part, "text": content}]
    return {**item, "type": "message", "content": content}
