"""Compacting an OpenAI Responses conversation with the model itself (design §14).

OpenAI's service compacts a conversation (`POST /v1/responses/compact`, or a
`compaction_trigger` item ending a `POST /v1/responses` input) into a `compaction` item
whose `encrypted_content` only its own models read. No runtime behind IOP has such a
thing, so the Edge makes one with the model: a summary turn, the conversation followed by
an instruction to summarise it, run as any other Responses run (admitted, routed,
metered), and the summary sealed in a `compaction` item that IOP reads again when the
caller sends it back.

Rules:

1. A compaction IOP made carries `encrypted_content` = `iopc1.<summary>.<digest>`: the
   version (`iopc1`), the summary's UTF-8 as unpadded base64url, and the first 16 bytes
   of its SHA-256 (base64url). The digest catches a summary that was cut or damaged on
   the way, not a forged one: the summary is the caller's own context, and a caller who
   wants other words there can send them as a message.
2. In a Responses input (the request's own items and a stored conversation's alike),
   IOP's compaction item becomes a user message holding the summary after
   `SUMMARY_PREFIX`. Of the items before the last such compaction only the user messages
   stay (what a compacted output holds: the summary covers the rest). A compaction item
   that is not IOP's (another service's sealed content) is left as it is: a runtime that
   speaks Responses natively may read it, a translation refuses it. One that claims to be
   IOP's but does not read back is refused (`CompactionUnreadable`), naming the item.
3. A `compaction_trigger` item is honoured as the last item of the request's own input
   only; anywhere else (a stored conversation) it is dropped.
4. The summary turn is the (expanded) conversation, then a user message holding
   `SUMMARY_INSTRUCTION`; it runs without tools, unstored, not streamed, its output
   bounded by `MAX_SUMMARY_TOKENS` (or the model's lower limit).
5. A compacted output (`/v1/responses/compact`) is the conversation's user messages in
   order (IOP's own summaries left out: the new one covers them), then the compaction
   item. A `compaction_trigger` response's output is the compaction item alone.
6. The summary is the text of the summary turn's output messages; a turn that wrote no
   text is the runtime's failure (`summary_text` returns "").
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from typing import Any, Final

import msgspec

__all__ = [
    "MAX_SUMMARY_TOKENS",
    "SUMMARY_INSTRUCTION",
    "SUMMARY_PREFIX",
    "TRIGGER",
    "CompactionUnreadable",
    "compacted_output",
    "compaction_item",
    "ends_with_trigger",
    "expand",
    "seal",
    "summary_request",
    "summary_text",
    "unseal",
]

VERSION: Final = "iopc1"
TRIGGER: Final = "compaction_trigger"
#: The most output tokens a summary turn may write (Rule 4).
MAX_SUMMARY_TOKENS: Final = 4096
SUMMARY_INSTRUCTION: Final = (
    "You are compacting this conversation so that it can go on within a smaller context. "
    "Write a concise summary for whoever continues it: the goal and the constraints the "
    "user gave, what has been done and decided so far (files, commands, results, errors), "
    "what remains to do and the next step. Keep names, paths and identifiers exact. "
    "Write the summary only: no greeting, no question, no tool call."
)
SUMMARY_PREFIX: Final = (
    "The conversation so far was compacted. This summary of it replaces the earlier messages:"
)
_DIGEST_BYTES: Final = 16


class CompactionUnreadable(ValueError):
    """An item claims to be IOP's compaction but does not read back (Rule 2); `index`:
    the item's, in the list `expand` was given (None from `unseal`)."""

    def __init__(self, problem: str, index: int | None = None) -> None:
        super().__init__(problem)
        self.index = index


class _Head(msgspec.Struct, frozen=True):
    type: str = "message"
    role: str | None = None
    encrypted_content: str | None = None


_decode_head: Final = msgspec.json.Decoder(_Head).decode


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    """Strict: a character outside base64url is an error, not skipped."""
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def seal(summary: str) -> str:
    """The `encrypted_content` of a compaction IOP made of `summary` (Rule 1)."""
    data = summary.encode()
    return f"{VERSION}.{_b64(data)}.{_b64(hashlib.sha256(data).digest()[:_DIGEST_BYTES])}"


def unseal(content: str) -> str | None:
    """The summary in `content` if IOP sealed it (Rule 1); None if it is another
    service's; raises `CompactionUnreadable` if it claims to be IOP's and is damaged."""
    if not content.startswith(VERSION + "."):
        return None
    parts = content.split(".")
    if len(parts) != 3:
        raise CompactionUnreadable(f"it has {len(parts)} dot-separated parts, not 3")
    try:
        data, digest = _unb64(parts[1]), _unb64(parts[2])
    except ValueError as exc:
        raise CompactionUnreadable(f"it is not base64url: {exc}") from None
    if hashlib.sha256(data).digest()[:_DIGEST_BYTES] != digest:
        raise CompactionUnreadable("its summary does not match its digest (cut or damaged)")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise CompactionUnreadable(f"its summary is not UTF-8: {exc}") from None


def compaction_item(item_id: str, summary: str) -> dict[str, Any]:
    """The `compaction` output item of `summary` (`ResponseCompactionItem`)."""
    return {
        "id": item_id,
        "type": "compaction",
        "encrypted_content": seal(summary),
        "created_by": "iop",
    }


def _head(item: Any) -> _Head:
    """The type, role and sealed content of one input item (JSON or decoded)."""
    if isinstance(item, msgspec.Raw):
        try:
            return _decode_head(item)
        except (msgspec.DecodeError, RecursionError):
            return _Head(type="")
    if isinstance(item, dict):
        kind = item.get("type", "message")
        role = item.get("role")
        content = item.get("encrypted_content")
        return _Head(
            type=kind if isinstance(kind, str) else "",
            role=role if isinstance(role, str) else None,
            encrypted_content=content if isinstance(content, str) else None,
        )
    return _Head(type="")


def _summary_message(summary: str) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": f"{SUMMARY_PREFIX}\n\n{summary}"}],
    }


def _may_hold_compaction(item: Any) -> bool:
    """Cheap test before an item is read: stored items are JSON, most hold no word of it."""
    if isinstance(item, msgspec.Raw):
        return b"compaction" in bytes(item)
    return isinstance(item, dict) and item.get("type") in ("compaction", TRIGGER)


def ends_with_trigger(items: Sequence[Any]) -> bool:
    """Whether the request's own `items` end with a `compaction_trigger` (Rule 3)."""
    return bool(items) and _head(items[-1]).type == TRIGGER


def expand(items: list[Any]) -> list[Any]:
    """`items` with IOP's compactions made readable (Rule 2) and triggers dropped (Rule
    3); the very list `items` when neither is there. Raises `CompactionUnreadable`
    with the item's index."""
    if not any(_may_hold_compaction(item) for item in items):
        return items
    summaries: dict[int, str] = {}
    dropped: set[int] = set()
    for index, item in enumerate(items):
        if not _may_hold_compaction(item):
            continue
        head = _head(item)
        if head.type == TRIGGER:
            dropped.add(index)
        elif head.type == "compaction" and head.encrypted_content is not None:
            try:
                summary = unseal(head.encrypted_content)
            except CompactionUnreadable as exc:
                raise CompactionUnreadable(str(exc), index) from None
            if summary is not None:
                summaries[index] = summary
    last = max(summaries, default=-1)
    expanded: list[Any] = []
    for index, item in enumerate(items):
        if index in dropped:
            continue
        if index in summaries:
            if index == last:
                expanded.append(_summary_message(summaries[index]))
            continue
        if index < last and not _is_user_message(item):
            continue
        expanded.append(item)
    return expanded


def _is_user_message(item: Any) -> bool:
    head = _head(item)
    return head.type == "message" and head.role == "user"


def _is_own_summary(item: Any) -> bool:
    """A user message `expand` made of an IOP compaction (Rule 5 leaves it out)."""
    if isinstance(item, dict):
        content = item.get("content")
        if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict):
            text = content[0].get("text")
            return isinstance(text, str) and text.startswith(SUMMARY_PREFIX)
    return False


def summary_request(items: Sequence[Any]) -> list[Any]:
    """The input of the summary turn over the expanded conversation `items` (Rule 4)."""
    instruction = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": SUMMARY_INSTRUCTION}],
    }
    return [*items, instruction]


def compacted_output(items: Sequence[Any], compaction: dict[str, Any], id_prefix: str) -> list[Any]:
    """The output of `/v1/responses/compact` over the expanded conversation `items`
    (Rule 5): its user messages, then `compaction`. A message without an `id` gets
    `<id_prefix>_<n>`."""
    kept = [item for item in items if _is_user_message(item) and not _is_own_summary(item)]
    return [*(_user_message(item, f"{id_prefix}_{n}") for n, item in enumerate(kept)), compaction]


def _user_message(item: Any, item_id: str) -> dict[str, Any]:
    """A user message item as an output item has it: `type`, `id` and `status` given,
    text as `input_text` parts (the shape OpenAI's clients parse an output item by)."""
    message: dict[str, Any] = msgspec.json.decode(item) if isinstance(item, msgspec.Raw) else item
    content = message.get("content")
    if isinstance(content, str):
        content = [{"type": "input_text", "text": content}]
    return {
        "id": item_id,
        "status": "completed",
        **message,
        "type": "message",
        "role": "user",
        "content": content,
    }


class _Part(msgspec.Struct, frozen=True):
    type: str = ""
    text: str | None = None


class _OutputItem(msgspec.Struct, frozen=True):
    type: str = ""
    content: list[_Part] | None = None


class _Output(msgspec.Struct, frozen=True):
    output: list[_OutputItem] = []


_decode_output: Final = msgspec.json.Decoder(_Output).decode


def summary_text(response: bytes) -> str:
    """The text of a summary turn's final response object (Rule 6); "" when it wrote
    none or is not a response object."""
    try:
        output = _decode_output(response).output
    except (msgspec.DecodeError, RecursionError):
        return ""
    texts = [
        part.text
        for item in output
        if item.type == "message"
        for part in item.content or ()
        if part.type == "output_text" and part.text
    ]
    return "\n".join(texts).strip()
