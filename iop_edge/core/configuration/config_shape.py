"""Check plain data against msgspec schema types and report *every* misfit, each with its path.

Why this exists: `msgspec.convert` stops at the first problem, so an operator fixing a
config would meet its mistakes one run at a time. Here a walker descends the schema
(Structs, lists, dicts, unions, `Annotated` aliases) alongside the data and, at each leaf,
asks msgspec itself to judge the value against its annotated type. The `Meta` constraints
written in the schema therefore stay the single source of truth for ranges, lengths and
patterns; this module only adds the collecting and the wording.

Rules of the walk:

1. One `ConfigError(path, message)` per misfit; the walk goes on after every error.
2. Paths read like the config itself: `nodes[0].providers[1].capacity`, and a key that is
   not a plain word is quoted: `models[0].providers["qwen3.6:35b"]`.
3. Messages are msgspec's verdict reworded for a human ("must be >= 1", "expected a
   mapping, got list"). They never repeat the rejected value, since it may be a secret:
   an invalid enum value is answered with the allowed choices instead.
4. A container's own constraints (say `min_length` on a list) are checked only when its
   items are fine, so one mistake is not reported twice.
5. Nothing here knows the Edge: wording for particular schema aliases is passed in as
   `LeafWording`.
6. A Struct value that msgspec converts as a whole has no misfit below it (msgspec
   judges every leaf and container the walk would): the walk only runs the wordings'
   prechecks there, and only into fields whose type can hold such a leaf. A config of
   ten thousand Nodes is then checked in a few conversions, not one per leaf.
7. No one conversion takes a long list whole: a list the walk meets is converted
   `CHUNK_ITEMS` items at a time (a chunk that fits has no misfit; one that does not is
   walked item by item, to name each misfit), and a Struct value holding a list of more
   than `CHUNK_ITEMS` items, at any depth through mappings, is walked field by field
   instead of converted whole. A conversion is C code that keeps the GIL until it
   returns, and a config is checked in a worker thread beside the event loop:
   converting ten thousand principal tokens at once would hold every caller's request
   for tens of milliseconds, a chunk holds them well under one. `convert` builds values
   under the same rule, and `release_long_lists` lets go of the data they were built
   from under it too.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from schemas.config import ConfigError
from schemas.runtime.give_way import free_in_pieces, give_way

__all__ = [
    "CHUNK_ITEMS",
    "LeafWording",
    "ShapeChecker",
    "check_shape",
    "convert",
    "error_from_msgspec",
    "index_path",
    "key_path",
    "kind_of",
    "release_long_lists",
]

S = typing.TypeVar("S", bound=msgspec.Struct)

CHUNK_ITEMS: Final = 64
"""Items of a list converted at once (Rule 7): a hundred microseconds of principal
tokens, a millisecond of Node entries."""


@dataclass(frozen=True, slots=True)
class LeafWording:
    """Human wording for one schema alias, where msgspec's own message would not help."""

    invalid: str
    """Said instead of msgspec's message when a string value is rejected."""
    precheck: Callable[[str], str | None] | None = None
    """Runs first on string values; a message returned here is the error."""


def check_shape(
    value: object,
    schema: Any,
    *,
    wording: Mapping[Any, LeafWording] | None = None,
    path: str = "",
) -> list[ConfigError]:
    """Every place where `value` does not fit schema type `schema`, in the order met.

    `wording` is keyed by schema aliases (like `Sha256Hex`): a leaf declared with one of
    them is described by its `LeafWording` rather than by msgspec's message. `path` is
    where `value` sits in a larger document (`nodes[3]`), for the errors' paths.
    """
    return ShapeChecker(wording or {}).check(value, schema, path=path)


class ShapeChecker:
    """`check_shape` for many values under one wording: what it works out about the
    schema types (which of them can hold a prechecked leaf, each one's wording) is kept
    from one value to the next.

    Working that out is a walk of the schema, a few hundred microseconds: once per
    config, nothing; once per Node entry of a fleet's changed Nodes, seconds. Not for
    sharing between threads (its caches are built as it goes); one per config read.
    """

    def __init__(self, wording: Mapping[Any, LeafWording]) -> None:
        self._types = _TypeFacts(wording)

    def check(self, value: object, schema: Any, *, path: str = "") -> list[ConfigError]:
        """Every place where `value` does not fit `schema` (as `check_shape`)."""
        walker = _Walker(self._types)
        walker.shape(value, schema, path)
        return walker.errors


def convert(value: object, schema: type[S]) -> S:
    """`msgspec.convert(value, schema)` for a Struct type, each long list converted a chunk
    at a time (Rule 7); raises `msgspec.ValidationError` as msgspec does."""
    stripped, long_lists = _strip_long_lists(value, schema)
    built = msgspec.convert(stripped, schema)
    for attributes, item_type, items in long_lists:
        converted: list[Any] = []
        for start in range(0, len(items), CHUNK_ITEMS):
            give_way()
            converted += msgspec.convert(items[start : start + CHUNK_ITEMS], _list_of(item_type))
        built = _replace_at(built, attributes, converted)
    return built


def release_long_lists(value: object, schema: Any) -> None:
    """Let go of the items of the long lists `convert` converted a chunk at a time, a
    chunk at a time (Rule 7), once `value` is no longer needed: freeing ten thousand
    entries at once is as long a hold of the GIL as converting them at once.

    Only those lists are emptied, and nothing in them is touched: msgspec builds a list
    of its own for a field of list type, so they are `value`'s alone, while an item may
    be shared with what was built (a value of a field of type `Any` is)."""
    for _, _, items in _strip_long_lists(value, schema)[1]:
        free_in_pieces(items)


def error_from_msgspec(exc: msgspec.ValidationError) -> ConfigError:
    """A msgspec error as a ConfigError: `$.nodes[0].id` becomes `nodes[0].id`."""
    message, _, where = str(exc).partition(_MSGSPEC_WHERE)
    path = where.rstrip("`").removeprefix("$").removeprefix(".")
    return ConfigError(path=path, message=_humanize(message, None))


def kind_of(value: object) -> str:
    """A value's type in YAML words, for "expected X, got Y"."""
    match value:
        case None:
            return "null"
        case dict():
            return "mapping"
        case list():
            return "list"
        case _:
            return type(value).__name__


# --------------------------------------------------------------------------- paths

_PLAIN_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")


def key_path(path: str, key: object) -> str:
    """`path.key`; a key that is not a plain word is quoted: `providers["qwen3.6:35b"]`."""
    if isinstance(key, str) and _PLAIN_KEY.fullmatch(key):
        return f"{path}.{key}" if path else key
    quoted = json.dumps(key) if isinstance(key, str) else repr(key)
    return f"{path}[{quoted}]"


def index_path(path: str, index: int) -> str:
    """`path[index]`."""
    return f"{path}[{index}]"


# --------------------------------------------------------------------------- the walk


class _TypeFacts:
    """What the walk needs to know about schema types, worked out once per type.

    Keyed by `id` of the type, and each entry keeps its type alive, so an id is never
    reused for another type while the facts are held."""

    def __init__(self, wording: Mapping[Any, LeafWording]) -> None:
        self.wording = wording
        self._wording_of: dict[int, tuple[Any, LeafWording | None]] = {}
        self._may_precheck: dict[int, tuple[Any, bool]] = {}
        self._prechecked_fields: dict[int, tuple[Any, list[tuple[str, Any]]]] = {}

    def wording_of(self, tp: Any) -> LeafWording | None:
        known = self._wording_of.get(id(tp))
        if known is None:
            # Compared with ==, never hashed: an `Annotated` type whose metadata is
            # unhashable is still a valid schema type.
            found = next((w for alias, w in self.wording.items() if alias == tp), None)
            known = self._wording_of[id(tp)] = (tp, found)
        return known[1]

    def prechecked_fields(self, cls: type[msgspec.Struct]) -> list[tuple[str, Any]]:
        """The fields of `cls` (name in the data, type) that can hold a prechecked leaf."""
        known = self._prechecked_fields.get(id(cls))
        if known is None:
            fields = [
                (name, info.type)
                for name, info in _fields_of(cls)[0].items()
                if self.may_precheck(info.type)
            ]
            known = self._prechecked_fields[id(cls)] = (cls, fields)
        return known[1]

    def may_precheck(self, tp: Any) -> bool:
        """Whether a value of type `tp` can hold a leaf whose wording has a precheck."""
        known = self._may_precheck.get(id(tp))
        if known is not None:
            return known[1]
        self._may_precheck[id(tp)] = (tp, False)  # a recursive type: not through itself
        wording = self.wording_of(tp)
        if wording is not None and wording.precheck is not None:
            found = True
        elif _is_struct(tp):
            found = any(self.may_precheck(info.type) for info in _fields_of(tp)[0].values())
        else:
            args = typing.get_args(tp)
            if typing.get_origin(tp) is typing.Annotated:
                args = args[:1]  # the rest is metadata
            found = any(self.may_precheck(arg) for arg in args)
        self._may_precheck[id(tp)] = (tp, found)
        return found


class _Walker:
    def __init__(self, types: _TypeFacts) -> None:
        self.wording_of = types.wording_of
        self.may_precheck = types.may_precheck
        self.prechecked_fields = types.prechecked_fields
        self.errors: list[ConfigError] = []
        self.prechecks_only = False
        """Below a value msgspec converted whole (Rule 6): only prechecks can fail."""

    def error(self, path: str, message: str) -> None:
        self.errors.append(ConfigError(path=path, message=message))

    def shape(self, value: object, tp: Any, path: str) -> None:
        if tp is Any:
            return
        if self.prechecks_only and not self.may_precheck(tp):
            return
        origin = typing.get_origin(tp)
        if origin is typing.Union or origin is types.UnionType:
            members = typing.get_args(tp)
            present = [member for member in members if member is not type(None)]
            if value is None and len(present) < len(members):
                return
            if len(present) == 1:  # `X | None` holding an X: descend into X
                self.shape(value, present[0], path)
            else:
                self.leaf(value, tp, path)
        elif origin is typing.Annotated:
            inner = typing.get_args(tp)[0]
            if _is_struct(inner) or typing.get_origin(inner) in (list, dict):
                before = len(self.errors)
                self.shape(value, inner, path)
                if len(self.errors) == before:  # items are fine; now the container's own rules
                    self.leaf(value, tp, path)
            else:
                self.leaf(value, tp, path)
        elif _is_struct(tp):
            self.struct(value, tp, path)
        elif origin is list:
            if not isinstance(value, list):
                self.error(path, f"expected a list, got {kind_of(value)}")
                return
            (item_type,) = typing.get_args(tp)
            if not self.prechecks_only:
                self.chunks(value, item_type, path)
                return
            for index, item in enumerate(value):
                self.shape(item, item_type, index_path(path, index))
        elif origin is dict:
            if not isinstance(value, dict):
                self.error(path, f"expected a mapping, got {kind_of(value)}")
                return
            key_type, value_type = typing.get_args(tp)
            for key, item in value.items():
                item_path = key_path(path, key)
                problem = self.leaf_problem(key, key_type)
                if problem is not None:
                    self.error(item_path, f"invalid key: {problem}")
                self.shape(item, value_type, item_path)
        else:
            self.leaf(value, tp, path)

    def struct(self, value: object, cls: type[msgspec.Struct], path: str) -> None:
        if not isinstance(value, dict):
            self.error(path, f"expected a mapping, got {kind_of(value)}")
            return
        fields, required = _fields_of(cls)
        if self.prechecks_only:
            for name, tp in self.prechecked_fields(cls):
                if name in value:
                    self.shape(value[name], tp, key_path(path, name))
            return
        if not _holds_long_list(value) and _fits(value, cls):  # Rules 6, 7
            if self.may_precheck(cls):
                self.prechecks_only = True
                try:
                    self.struct(value, cls, path)
                finally:
                    self.prechecks_only = False
            return
        forbid_unknown = cls.__struct_config__.forbid_unknown_fields
        for key, item in value.items():
            info = fields.get(key) if isinstance(key, str) else None
            if info is not None:
                self.shape(item, info.type, key_path(path, key))
            elif forbid_unknown:
                self.error(key_path(path, key), _unknown_field(key, fields))
        for name in required:
            if name not in value:
                self.error(key_path(path, name), "required field missing")

    def chunks(self, value: list[Any], item_type: Any, path: str) -> None:
        """A list, `CHUNK_ITEMS` items at a time: a chunk msgspec converts whole has no
        misfit in it (Rules 6, 7)."""
        chunk_type = _list_of(item_type)
        for start in range(0, len(value), CHUNK_ITEMS):
            give_way()
            chunk = value[start : start + CHUNK_ITEMS]
            fits = _fits(chunk, chunk_type)
            if fits and not self.may_precheck(item_type):
                continue
            self.prechecks_only = fits  # a chunk that fits: its prechecks only (Rule 6)
            try:
                for index, item in enumerate(chunk, start):
                    self.shape(item, item_type, index_path(path, index))
            finally:
                self.prechecks_only = False

    def leaf(self, value: object, tp: Any, path: str) -> None:
        problem = self.leaf_problem(value, tp)
        if problem is not None:
            self.error(path, problem)

    def leaf_problem(self, value: object, tp: Any) -> str | None:
        """msgspec's verdict on one value, in human words; None when the value fits."""
        wording = self.wording_of(tp)
        if wording is not None and wording.precheck is not None and isinstance(value, str):
            problem = wording.precheck(value)
            if problem is not None:
                return problem
        if self.prechecks_only:
            return None
        try:
            msgspec.convert(value, tp)
        except msgspec.ValidationError as exc:
            if wording is not None and isinstance(value, str):
                return wording.invalid
            return _humanize(str(exc), tp)
        return None


def _fits(value: object, tp: Any) -> bool:
    """Whether msgspec converts `value` to `tp` (Rules 6, 7)."""
    try:
        msgspec.convert(value, tp)
    except msgspec.ValidationError:
        return False
    return True


def _holds_long_list(value: dict[Any, Any]) -> bool:
    """Whether a list of more than `CHUNK_ITEMS` items sits in `value`, or in a mapping
    in it at any depth (Rule 7). Lists are not entered: their items are converted apart.
    Each mapping is looked at once: YAML aliases can share one, or make it hold itself."""
    mappings = [value]
    seen = {id(value)}
    while mappings:
        for item in mappings.pop().values():
            if isinstance(item, list):
                if len(item) > CHUNK_ITEMS:
                    return True
            elif isinstance(item, dict) and id(item) not in seen:
                seen.add(id(item))
                mappings.append(item)
    return False


#: A long list taken out of a value (Rule 7): the attribute names that lead to it from
#: the Struct built, its item type, its items.
_LongList = tuple[tuple[str, ...], Any, list[Any]]


def _strip_long_lists(value: object, cls: Any) -> tuple[object, list[_LongList]]:
    """`value` with each long list in a field of plain list type (at any depth through
    Struct-typed mappings) emptied, and those lists; `value` itself is not changed."""
    if not (_is_struct(cls) and isinstance(value, dict) and _holds_long_list(value)):
        return value, []
    fields, _ = _fields_of(cls)
    stripped = dict(value)
    found: list[_LongList] = []
    for key, item in value.items():
        info = fields.get(key) if isinstance(key, str) else None
        if info is None:
            continue  # msgspec reports it, or ignores it, as it would anyway
        if isinstance(item, list) and len(item) > CHUNK_ITEMS:
            if typing.get_origin(info.type) is list:  # [] fits: no constraint of its own
                stripped[key] = []
                found.append(((info.name,), typing.get_args(info.type)[0], item))
        elif isinstance(item, dict):
            inner, below = _strip_long_lists(item, _struct_in(info.type))
            stripped[key] = inner
            found.extend(((info.name, *names), tp, items) for names, tp, items in below)
    return stripped, found


def _list_of(item_type: Any) -> Any:
    """The schema type `list[item_type]`, for one conversion of a chunk of items."""
    return list[item_type]


def _struct_in(tp: Any) -> Any:
    """The Struct type a field of type `tp` holds (`X`, `X | None`), else `tp`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        present = [member for member in typing.get_args(tp) if member is not type(None)]
        if len(present) == 1:
            return present[0]
    return tp


def _replace_at(built: Any, attributes: tuple[str, ...], value: object) -> Any:
    """`built` with the attribute at the end of `attributes` set to `value`."""
    name, rest = attributes[0], attributes[1:]
    inner = value if not rest else _replace_at(getattr(built, name), rest, value)
    return msgspec.structs.replace(built, **{name: inner})


@functools.cache
def _fields_of(
    cls: type[msgspec.Struct],
) -> tuple[Mapping[str, msgspec.structs.FieldInfo], tuple[str, ...]]:
    """A Struct's fields by their name in the data, and the names of the required ones.

    Worked out once per class: `msgspec.structs.fields` evaluates the class's annotations
    again on every call, which made a config of a thousand Nodes take seconds to check."""
    fields = {info.encode_name: info for info in msgspec.structs.fields(cls)}
    required = tuple(name for name, info in fields.items() if info.required)
    return types.MappingProxyType(fields), required


def _is_struct(tp: object) -> typing.TypeGuard[type[msgspec.Struct]]:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _unknown_field(key: object, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f"unknown field (did you mean '{close[0]}'?)" if close else "unknown field"


# --------------------------------------------------------------------------- wording

_MSGSPEC_WHERE: Final = " - at `"
_EXPECTED_GOT: Final = re.compile(r"Expected `(?P<expected>[^`]+)`, got `(?P<got>[^`]+)`")
_BOUND: Final = re.compile(r"Expected `\w+` (?P<op>>=|>|<=|<) (?P<bound>\S+)")
_LENGTH: Final = re.compile(r"Expected `(?P<kind>\w+)` of length (?P<op>>=|<=) (?P<n>\d+)")
_PATTERN: Final = re.compile(r"Expected `str` matching regex (?P<pattern>'.*')")
_TYPE_WORDS: Final = {"object": "mapping", "array": "list"}


def _humanize(message: str, tp: Any) -> str:
    """Reword a msgspec message ("Expected `int` >= 1") for a human ("must be >= 1").

    msgspec quotes the rejected value only for an invalid enum value; that one is answered
    with the allowed choices instead, so no message here repeats what was given.
    """
    message = message.split(_MSGSPEC_WHERE, 1)[0]
    if match := _EXPECTED_GOT.fullmatch(message):
        return f"expected {_type_words(match['expected'])}, got {_type_words(match['got'])}"
    if match := _BOUND.fullmatch(message):
        bound = match["bound"].removesuffix(".0")
        return f"must be {match['op']} {bound}"
    if match := _LENGTH.fullmatch(message):
        size = int(match["n"])
        if match["kind"] == "str" and match["op"] == ">=" and size == 1:
            return "must not be empty"
        unit = "characters" if match["kind"] == "str" else "items"
        least = "at least" if match["op"] == ">=" else "at most"
        return f"must have {least} {size} {unit}"
    if match := _PATTERN.fullmatch(message):
        return f"must match the pattern {match['pattern']}"
    if message.startswith("Invalid enum value"):
        choices = ", ".join(_literal_choices(tp))
        return f"must be one of: {choices}" if choices else "not an allowed value"
    return message[:1].lower() + message[1:]


def _type_words(msgspec_types: str) -> str:
    names = [_TYPE_WORDS.get(name, name) for name in msgspec_types.split(" | ")]
    return " or ".join(names)


def _literal_choices(tp: Any) -> list[str]:
    if typing.get_origin(tp) is typing.Literal:
        return [str(choice) for choice in typing.get_args(tp)]
    return [choice for member in typing.get_args(tp) for choice in _literal_choices(member)]
