"""Compaction's Edge side: `POST /v1/responses/compact` and a `compaction_trigger` item
ending a `POST /v1/responses` input, made with the model (`core.responses.compaction`).

The caller's request becomes a summary turn (`prepare`) that runs as any other Responses
run: admitted, queued, routed, metered, translated or relayed natively by the Node. Its
final response becomes what the caller asked for (`settle`):

- `/v1/responses/compact`: a compacted response (`object: "response.compaction"`, its
  `output` the conversation's user messages and the compaction item, the turn's
  `usage`), stored under its id for the caller's principal, with no previous response:
  a request naming it as `previous_response_id` continues from the compaction.
- a `compaction_trigger`: a Response whose `output` is the compaction item alone
  (`completed` even when the summary reached its bound), stored as that request's turn
  when it asked for `store`; asked as a stream, it is written as
  the events of a Response with that one output item (`trigger_events`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgspec

from iop_edge.core.responses.compaction import (
    MAX_SUMMARY_TOKENS,
    compacted_output,
    compaction_item,
    summary_request,
    summary_text,
)
from schemas.config import ModelEntry

__all__ = ["COMPACT_PATH", "Compaction", "prepare", "settle", "trigger_events"]

COMPACT_PATH: Final = "/v1/responses/compact"
#: What of a compact or trigger request the summary turn keeps (Rule 4: no tools).
_KEPT: Final[tuple[str, ...]] = ("model", "instructions", "temperature", "top_p", "reasoning")


@dataclass(frozen=True, slots=True)
class Compaction:
    """A summary turn's purpose: what its final response becomes."""

    endpoint: bool
    """`/v1/responses/compact` (else a `compaction_trigger`)."""
    conversation: list[Any]
    """The expanded conversation summarised (without the instruction)."""
    stream: bool = False
    """A trigger whose caller asked for a stream."""


def prepare(body: dict[str, Any], conversation: list[Any], model: ModelEntry) -> None:
    """Make `body` the summary turn over `conversation` (`core.responses.compaction` Rule 4), in
    place."""
    kept = {key: body[key] for key in _KEPT if key in body}
    body.clear()
    body.update(kept)
    body["input"] = summary_request(conversation)
    body["stream"] = False
    body["store"] = False
    body["max_output_tokens"] = min(MAX_SUMMARY_TOKENS, model.generation.max_tokens_limit)


def settle(compaction: Compaction, response: bytes, request_id: str) -> bytes | None:
    """What the caller gets of the summary turn's final `response`: the compacted
    response or the trigger's Response; None when the turn wrote no summary (the
    runtime's failure, `core.responses.compaction` Rule 6)."""
    summary = summary_text(response)
    if not summary:
        return None
    fields: dict[str, Any] = msgspec.json.decode(response)
    item = compaction_item(f"cmp_{request_id}", summary)
    if compaction.endpoint:
        compacted = {
            "id": fields.get("id", f"resp_{request_id}"),
            "object": "response.compaction",
            "created_at": fields.get("created_at", 0),
            "output": compacted_output(compaction.conversation, item, f"msg_{request_id}"),
            "usage": fields.get("usage"),
        }
        return msgspec.json.encode(compacted)
    fields["output"] = [item]
    fields.pop("output_text", None)
    if fields.get("status") == "incomplete":  # a summary cut at its bound is still one
        fields["status"] = "completed"
        fields["incomplete_details"] = None
        fields["completed_at"] = fields.get("completed_at") or fields.get("created_at")
    return msgspec.json.encode(fields)


def trigger_events(response: bytes) -> bytes:
    """A trigger's Response as the server-sent events of a stream: created, in progress,
    the compaction item added, compacting, done, completed."""
    final: dict[str, Any] = msgspec.json.decode(response)
    item = final["output"][0]
    started = {**final, "status": "in_progress", "completed_at": None, "output": [], "usage": None}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        {"type": "response.compaction.compacting", "output_index": 0, "item_id": item["id"]},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": final},
    ]
    out = bytearray()
    for number, event in enumerate(events):
        event["sequence_number"] = number
        out += b"event: " + event["type"].encode() + b"\ndata: "
        out += msgspec.json.encode(event) + b"\n\n"
    return bytes(out)
