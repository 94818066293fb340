"""What the `sim` engine says when it behaves like a model (`adapter.reply.mode: model`).

An agent (Claude Code, Codex) needs a model that ends its replies by itself and calls
the tools it is offered; a fixed `max_tokens`-long text (`fill` mode, kept for tests and
benchmarks that need a known length) does neither. This module decides a chat turn's
reply (and a text completion's: Rules 4 and 6) from the request alone; `sim.py` paces
and encodes it.

Rules:

1. A turn is a tool call or a text, never both. It calls a tool when tools are offered,
   `tool_choice` is not `none`, and no tool result came since the last assistant turn
   (a model that was handed a result answers with text). `tool_choice: required` or a
   named function makes it call one whatever came before.
2. Which tool: the named one; else the offered tool the last user text names first (a
   model follows "use the Bash tool"); else one drawn from the seed.
3. The arguments are the smallest instance of the tool's `parameters` (a JSON Schema)
   that a validator accepts: every required property, of its type; `const`, then
   `enum`'s first value, then `default`; numbers within their bounds; strings and
   arrays at their minimum length, at least one word or item. `$ref` into the schema's
   own `$defs`/`definitions`, `allOf`, `anyOf`/`oneOf` (the first branch) and type lists
   (the first non-null type) are followed. The first required string property takes the
   last user text's first `backquoted` span when there is one, as a model would take
   the command it was asked to run.
4. A text's length is drawn from a log-normal distribution with median
   `reply.median_tokens` and sigma `reply.spread`; `max_tokens` only caps it. A capped
   text ends with `finish_reason: length`, any other with `stop`; a tool call ends with
   `tool_calls` (a tool call is short: it is never capped).
5. After a tool result the text begins by quoting that result's first words ("The tool
   returned: ..."), so what an agent ran shows in the answer.
7. A text ends before the first of the request's `stop` strings it would contain, with
   `finish_reason: stop`, as a runtime stops: the stop string itself is not sent.
6. Deterministic: every draw comes from a hash of `reply.seed` and the request's
   messages and tools. The same seed and request always get the same reply.

No I/O, no clock: the adapter owns both.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Final

import msgspec

from schemas.config import SimReply

__all__ = [
    "WORDS",
    "PlannedCall",
    "ReplyPlan",
    "natural_length",
    "plan_reply",
    "plan_text",
    "schema_instance",
]

#: The vocabulary of the simulated engine, in both modes. Any fixed list works; this one
#: reads well.
WORDS: Final[tuple[str, ...]] = (
    "the", "engine", "answers", "with", "simulated", "tokens", "that", "arrive",
    "at", "a", "steady", "pace", "while", "the", "gateway", "routes", "each",
    "request", "to", "a", "provider", "slot", "and", "streams", "every", "chunk",
    "back", "through", "one", "calm", "endpoint", "today",
)  # fmt: skip
#: How many words of a tool's result a text quotes (Rule 5).
QUOTED_WORDS: Final = 32
_LEAD: Final = ("The", "tool", "returned:")
#: A schema nested deeper than this gets `null` below (a bound on the work, not a rule of
#: JSON Schema: no tool schema we know comes near it).
_MAX_DEPTH: Final = 32
_BACKQUOTED: Final = re.compile(r"`([^`\n]+)`")
_FORMATS: Final[dict[str, str]] = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00Z",
    "email": "user@example.com",
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "hostname": "example.com",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
}

_encode: Final = msgspec.json.Encoder().encode
_normal: Final = NormalDist()


@dataclass(frozen=True, slots=True)
class PlannedCall:
    """One tool call: its id, the function's name and its arguments (JSON text)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ReplyPlan:
    """A turn's reply: text `pieces` (one token each) or one tool call, and how it ends."""

    pieces: list[str]
    call: PlannedCall | None
    finish_reason: str


def plan_reply(body: dict[str, Any], settings: SimReply, max_tokens: int) -> ReplyPlan:
    """The reply to the chat request `body` (see the module rules)."""
    messages = body.get("messages")
    messages = messages if isinstance(messages, list) else []
    tools = _functions(body.get("tools"))
    draw = _Draw(settings.seed, messages, tools)
    choice = body.get("tool_choice")
    tool = _tool_to_call(tools, choice, messages, draw)
    if tool is not None:
        name, parameters = tool
        arguments = schema_instance(parameters, root=parameters, hint=_backquoted(messages))
        call_id = f"call_{draw.hex('call')[:24]}"
        call = PlannedCall(call_id, name, _json(arguments))
        return ReplyPlan(pieces=[], call=call, finish_reason="tool_calls")
    length = natural_length(settings, draw.unit("length"))
    quoted = _quoted(messages)
    lead = [*_LEAD, *quoted] if quoted else []
    words = lead + _filler(draw, max(length - len(lead), 0))
    finish_reason = "stop"
    if len(words) > max_tokens:
        words, finish_reason = words[:max_tokens], "length"
    pieces = [("" if index == 0 else " ") + word for index, word in enumerate(words)]
    if pieces and finish_reason == "stop" and not quoted:
        pieces[-1] += "."
    return _stopped(ReplyPlan(pieces=pieces, call=None, finish_reason=finish_reason), body)


def plan_text(body: dict[str, Any], settings: SimReply, max_tokens: int) -> ReplyPlan:
    """A text completion's reply to `body` (Rules 4, 6 and 7; it offers no tools)."""
    draw = _Draw(settings.seed, [body.get("prompt")], [])
    words = _filler(draw, natural_length(settings, draw.unit("length")))
    finish_reason = "stop"
    if len(words) > max_tokens:
        words, finish_reason = words[:max_tokens], "length"
    pieces = [("" if index == 0 else " ") + word for index, word in enumerate(words)]
    return _stopped(ReplyPlan(pieces=pieces, call=None, finish_reason=finish_reason), body)


def _stopped(plan: ReplyPlan, body: dict[str, Any]) -> ReplyPlan:
    """`plan` ended before the first of `body`'s `stop` strings its text contains
    (Rule 7)."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    stops = [text for text in stops if isinstance(text, str) and text]
    if not stops or not plan.pieces:
        return plan
    text = "".join(plan.pieces)
    found = [at for at in (text.find(word) for word in stops) if at >= 0]
    if not found:
        return plan
    end = min(found)
    pieces: list[str] = []
    length = 0
    for piece in plan.pieces:
        if length + len(piece) > end:
            if end > length:
                pieces.append(piece[: end - length])
            break
        pieces.append(piece)
        length += len(piece)
    return ReplyPlan(pieces=pieces, call=None, finish_reason="stop")


def natural_length(settings: SimReply, unit: float) -> int:
    """A text length (Rule 4) for the draw `unit`, in (0, 1)."""
    if settings.spread == 0:
        return settings.median_tokens
    z = _normal.inv_cdf(min(max(unit, 1e-9), 1 - 1e-9))
    return max(1, round(settings.median_tokens * math.exp(settings.spread * z)))


class _Draw:
    """Rule 6: named draws from a hash of the seed and the request."""

    __slots__ = ("_base",)

    def __init__(self, seed: int, messages: list[Any], tools: list[tuple[str, Any]]) -> None:
        self._base = hashlib.blake2b(
            _encode([seed, messages, [name for name, _ in tools]]), digest_size=16
        ).digest()

    def hex(self, name: str) -> str:
        return hashlib.blake2b(name.encode(), key=self._base, digest_size=16).hexdigest()

    def integer(self, name: str) -> int:
        return int(self.hex(name), 16)

    def unit(self, name: str) -> float:
        """A number in (0, 1)."""
        return (self.integer(name) % (1 << 53) + 0.5) / (1 << 53)


def _functions(value: object) -> list[tuple[str, Any]]:
    """The offered function tools, `(name, parameters)`, in order."""
    found: list[tuple[str, Any]] = []
    for tool in value if isinstance(value, list) else ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            found.append((function["name"], function.get("parameters")))
    return found


def _tool_to_call(
    tools: list[tuple[str, Any]], choice: object, messages: list[Any], draw: _Draw
) -> tuple[str, Any] | None:
    """Rules 1 and 2."""
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        function = choice.get("function")
        wanted = function.get("name") if isinstance(function, dict) else None
        named = [tool for tool in tools if tool[0] == wanted]
        if named:
            return named[0]
    elif choice != "required" and _answered(messages):
        return None
    text = _last_user_text(messages)
    mentioned = [
        (match.start(), -len(name), index)
        for index, (name, _) in enumerate(tools)
        if (match := re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text))
    ]
    if mentioned:
        return tools[min(mentioned)[2]]
    return tools[draw.integer("tool") % len(tools)]


def _answered(messages: list[Any]) -> bool:
    """A tool result came since the last assistant turn."""
    for message in reversed(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "assistant":
            return False
        if role == "tool":
            return True
    return False


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict)]
        return "\n".join(text for text in texts if isinstance(text, str))
    return ""


def _last_user_text(messages: list[Any]) -> str:
    """The last text part of the last user message (an agent puts its reminders and
    context first, the prompt last)."""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                texts = [
                    part["text"]
                    for part in content
                    if isinstance(part, dict) and isinstance(part.get("text"), str)
                ]
                return texts[-1] if texts else ""
            return _text_of(content)
    return ""


def _backquoted(messages: list[Any]) -> str | None:
    match = _BACKQUOTED.search(_last_user_text(messages))
    return None if match is None else match.group(1)


def _quoted(messages: list[Any]) -> list[str]:
    """Rule 5: the first words of the latest tool result, when the turn answers one."""
    if not _answered(messages):
        return []
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "tool":
            return _text_of(message.get("content")).split()[:QUOTED_WORDS]
    return []


def _filler(draw: _Draw, count: int) -> list[str]:
    offset = draw.integer("words")
    return [WORDS[(offset + index) % len(WORDS)] for index in range(count)]


def _json(value: object) -> str:
    return _encode(value).decode()


# --- the smallest valid instance of a JSON Schema (Rule 3) ----------------------------


def schema_instance(
    schema: object, *, root: object = None, hint: str | None = None, depth: int = 0
) -> object:
    """The smallest instance of `schema` a validator accepts (Rule 3); `hint` fills the
    first required string property. `root` is where `$ref`s point (the whole schema)."""
    if depth > _MAX_DEPTH or not isinstance(schema, dict):
        return {} if depth == 0 else None  # `true`/`{}` accept anything; a tool takes objects
    root = schema if root is None else root
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return schema_instance(_resolve(root, ref), root=root, hint=hint, depth=depth + 1)
    for key in ("const", "enum", "default"):
        if key in schema:
            value = schema[key]
            if key != "enum":
                return value
            if isinstance(value, list) and value:
                return value[0]
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and all_of:
        merged = _merge_all_of(schema, all_of, root)
        return schema_instance(merged, root=root, hint=hint, depth=depth + 1)
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            usable = [b for b in branches if not (isinstance(b, dict) and b.get("type") == "null")]
            return schema_instance((usable or branches)[0], root=root, hint=hint, depth=depth + 1)
    match _type(schema):
        case "object":
            return _object(schema, root, hint, depth)
        case "array":
            return _array(schema, root, depth)
        case "string":
            return _string(schema, hint)
        case "integer":
            return _number(schema, integer=True)
        case "number":
            return _number(schema, integer=False)
        case "boolean":
            return False
        case "null":
            return None
    return {} if depth == 0 else None


def _type(schema: dict[str, Any]) -> str | None:
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if isinstance(k, str) and k != "null"]
        kind = kinds[0] if kinds else ("null" if "null" in kind else None)
    if isinstance(kind, str):
        return kind
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _resolve(root: object, ref: str) -> object:
    """A `#/...` pointer into `root`; anything else resolves to nothing (`{}`)."""
    if not ref.startswith("#"):
        return {}
    node = root
    for raw in ref.removeprefix("#").split("/")[1:]:
        key = raw.replace("~1", "/").replace("~0", "~")
        node = node.get(key) if isinstance(node, dict) else None
    return node if node is not None else {}


def _merge_all_of(schema: dict[str, Any], parts: list[Any], root: object) -> dict[str, Any]:
    """`allOf` as one schema: the branches' properties and required names together."""
    merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
    properties: dict[str, Any] = dict(merged.get("properties") or {})
    required: list[str] = list(merged.get("required") or [])
    for branch in parts:
        part = branch
        while isinstance(part, dict) and isinstance(part.get("$ref"), str):
            part = _resolve(root, part["$ref"])
        if not isinstance(part, dict):
            continue
        for key, value in part.items():
            if key == "properties" and isinstance(value, dict):
                properties.update(value)
            elif key == "required" and isinstance(value, list):
                required += [name for name in value if name not in required]
            else:
                merged.setdefault(key, value)
    if properties:
        merged["properties"] = properties
    if required:
        merged["required"] = required
    return merged


def _object(schema: dict[str, Any], root: object, hint: str | None, depth: int) -> dict[str, Any]:
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = [name for name in schema.get("required") or () if isinstance(name, str)]
    instance: dict[str, Any] = {}
    for name in required:
        sub = properties.get(name, {})
        is_string = isinstance(sub, dict) and _type(sub) == "string" and not _fixed(sub)
        if is_string and hint is not None:
            instance[name] = _string(sub, hint)
            hint = None
        else:
            instance[name] = schema_instance(sub, root=root, depth=depth + 1)
    return instance


def _fixed(schema: dict[str, Any]) -> bool:
    return any(key in schema for key in ("const", "enum", "format", "pattern"))


def _array(schema: dict[str, Any], root: object, depth: int) -> list[Any]:
    low, high = schema.get("minItems"), schema.get("maxItems")
    count = low if isinstance(low, int) and low > 0 else 1
    if isinstance(high, int) and high < count:
        count = max(high, 0)
    prefix = schema.get("prefixItems")
    items = schema.get("items", {})
    out: list[Any] = []
    for index in range(count):
        sub = prefix[index] if isinstance(prefix, list) and index < len(prefix) else items
        out.append(schema_instance(sub, root=root, depth=depth + 1))
    return out


def _string(schema: dict[str, Any], hint: str | None = None) -> str:
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in _FORMATS:
        return _FORMATS[fmt]
    text = hint if hint is not None else WORDS[1]
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) and len(text) < low:
        text += "x" * (low - len(text))
    if isinstance(high, int) and len(text) > high:
        text = text[: max(high, 0)]
    return text


def _number(schema: dict[str, Any], *, integer: bool) -> int | float:
    low, high = schema.get("minimum"), schema.get("maximum")
    exclusive_low, exclusive_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    value: float = 0
    if isinstance(low, int | float):
        value = low
    if isinstance(exclusive_low, int | float) and not isinstance(exclusive_low, bool):
        value = max(value, exclusive_low + 1) if integer else max(value, exclusive_low + 0.5)
    if isinstance(high, int | float) and value > high:
        value = high
    if (
        isinstance(exclusive_high, int | float)
        and not isinstance(exclusive_high, bool)
        and value >= exclusive_high
    ):
        value = exclusive_high - 1 if integer else exclusive_high - 0.5
    if not integer:
        return value
    whole = math.ceil(value)
    if isinstance(high, int | float) and whole > high:
        whole = math.floor(high)
    return whole
