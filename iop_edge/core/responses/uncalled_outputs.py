"""Tool outputs no call asked for, as a message every runtime reads (design §14).

Codex hands the model context its harness keeps, such as the thread's goal, as a
`function_call_output` item without a `call_id` (`"name": "goal_objective", "namespace":
"agent"` after its `create_goal` tool runs). OpenAI's service reads such an item; no
runtime behind IOP does: llama.cpp's server refuses the request ("Cannot determine type
of 'item'"), and a chat translation has no call for a `tool` message to answer. The Edge
therefore rewrites the item once, for every route alike, into what it carries: text the
harness gives the model.

Rules:

1. An uncalled output is a `function_call_output` or `custom_tool_call_output` item whose
   `call_id` is missing, null or empty. It becomes a `user` message whose first
   `input_text` part is its label, `<namespace>.<name>:` (`<name>:` without a namespace,
   no label when it names nothing), then its output: a string in that same part, a list
   of parts (`input_text`, `input_image`, `input_file`: a user message's own part types)
   after it.
2. The message goes after the run of output items the uncalled one sits in, several in
   their order: the outputs answering one assistant turn stay together, as chat
   templates and the Messages translation need them.
3. `rewrite` returns the very list it was given when no item is uncalled: the common
   request pays one scan of its items.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

__all__ = ["OUTPUT_TYPES", "rewrite"]

#: The item types that answer a call (Rule 1).
OUTPUT_TYPES: Final = frozenset({"function_call_output", "custom_tool_call_output"})


class _Head(msgspec.Struct, frozen=True):
    type: str = "message"
    call_id: str | None = None


_decode_head: Final = msgspec.json.Decoder(_Head).decode


def _kind(item: Any) -> tuple[bool, bool]:
    """Whether `item` is an output item, and whether no call asked for it (Rule 1).
    A stored item is JSON; most hold no output at all, so a byte test comes first."""
    if isinstance(item, dict):
        if item.get("type") not in OUTPUT_TYPES:
            return False, False
        return True, not item.get("call_id")
    if isinstance(item, msgspec.Raw):
        if b"_call_output" not in bytes(item):
            return False, False
        try:
            head = _decode_head(item)
        except (msgspec.DecodeError, RecursionError):
            return False, False  # the translator or runtime names what is wrong with it
        if head.type not in OUTPUT_TYPES:
            return False, False
        return True, not head.call_id
    return False, False


def _message(item: Any) -> dict[str, Any]:
    """The user message of an uncalled output (Rule 1)."""
    body: Any = msgspec.json.decode(item) if isinstance(item, msgspec.Raw) else item
    name, namespace = body.get("name"), body.get("namespace")
    label = ""
    if isinstance(name, str) and name:
        label = f"{namespace}.{name}:" if isinstance(namespace, str) and namespace else f"{name}:"
    output = body.get("output")
    if isinstance(output, list):
        parts = [part for part in output if isinstance(part, dict)]
        content = [{"type": "input_text", "text": label}, *parts] if label else parts
    else:
        text = output if isinstance(output, str) else ""
        content = [{"type": "input_text", "text": f"{label}\n{text}" if label else text}]
    return {"type": "message", "role": "user", "content": content}


def rewrite(items: list[Any]) -> list[Any]:
    """`items` with each uncalled output a user message after its run of outputs (Rules
    1 and 2); the very list `items` when none is there (Rule 3)."""
    if not any(_kind(item)[1] for item in items):
        return items
    rewritten: list[Any] = []
    held: list[dict[str, Any]] = []
    for item in items:
        is_output, uncalled = _kind(item)
        if not is_output and held:
            rewritten.extend(held)
            held = []
        if uncalled:
            held.append(_message(item))
        else:
            rewritten.append(item)
    rewritten.extend(held)
    return rewritten
