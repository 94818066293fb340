"""What a config refresh changes, and which of those changes can go live (design §5 step 2).

Pure functions over two validated `EdgeConfig`s: no I/O, no awaits, no clock. The
Refresher decides with them; the tests drive them synchronously.

Rules:

1. A change is the smallest config path whose value differs: a scalar field, a list that
   is not keyed (`lifecycle`, a provider's `models`), an optional section that appeared
   or vanished (`edge.tls`), or an item of a keyed list or mapping that was added or
   removed (`nodes[gpu2]`, `models[qwen].providers[gpu2-vllm]`). Nothing below an added
   or removed item is listed: the item is one change.
2. List items are named by identity, never by index: models, nodes and providers by
   `id`, principal tokens by `token_ref`, legacy model routes by `model,provider`.
   Reordering such a list is not a change, and inserting an item does not shift the
   paths of the items after it. (A list whose keys repeat cannot be matched up and is
   compared whole; validation rejects such configs, so this is only a safety net.)
3. Paths read like config-error paths, with items named by key instead of index:
   `.field` for a struct field, `[key]` for a keyed list item or a mapping key
   (`nodes[gpu1].providers[gpu1-vllm].capacity`, `models[qwen3.6:35b].display_name`).
4. A path is live only if its pattern (the path with every `[key]` reduced to `[]`) is
   in `LIVE_PATTERNS` or below one of them. Everything else, including a path this
   module has never heard of, is restart-required: new config fields are safe by default.
5. A change carries its path and class, never a value, so a token hash that changed is
   reported without being echoed.
6. The live subset of a candidate is the candidate with every restart-required change
   put back to its running value; by construction it differs from the running config
   in live paths only, and from the candidate in restart-required paths only.
7. The live subset keeps the running node set, provider set, provider types, adapter
   settings and principal tokens, so it can be invalid where the candidate is valid in
   two ways: a model mapped to a provider that only the candidate adds, and limits for a
   principal whose token only the candidate adds. `live_subset_errors` names each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from iop_edge.core.principals import ANONYMOUS_PRINCIPAL
from schemas.config import EVERY_OTHER_PRINCIPAL, EdgeConfig
from schemas.refresh import Change, ChangeClass, RefreshError

__all__ = [
    "LIVE_PATTERNS",
    "ConfigDiff",
    "class_of",
    "compare_configs",
    "live_subset",
    "live_subset_errors",
]

#: Patterns (rule 4) whose subtree can change without a restart (design §5 step 2).
LIVE_PATTERNS: tuple[str, ...] = (
    "models",
    "dispatch",
    "openai.long_context_threshold_tokens",
    "openai.model_routes",
    "nodes[].providers[].capacity",
    "nodes[].providers[].long_context_slots",
    "nodes[].providers[].priority",
    "nodes[].providers[].enabled",
    "nodes[].providers[].models",
    "nodes[].providers[].lifecycle",
    "nodes[].providers[].category",
    "principals",
)


# --- paths -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Field:
    name: str


@dataclass(frozen=True, slots=True)
class _Item:
    """A keyed list item or a mapping entry; `key` has one part except for model routes."""

    key: tuple[str, ...]


_Step = _Field | _Item
_Path = tuple[_Step, ...]


def _render(path: _Path) -> str:
    out: list[str] = []
    for step in path:
        if isinstance(step, _Field):
            out.append(f".{step.name}" if out else step.name)
        else:
            out.append(f"[{','.join(step.key)}]")
    return "".join(out)


def _pattern(path: _Path) -> str:
    return _render(tuple(_Item(()) if isinstance(step, _Item) else step for step in path))


@functools.cache
def _is_live_pattern(pattern: str) -> bool:
    """Cached: a fleet's config has tens of thousands of changes, of a dozen patterns."""
    return any(
        pattern == live or pattern.startswith((f"{live}.", f"{live}[")) for live in LIVE_PATTERNS
    )


def class_of(pattern: str) -> ChangeClass:
    """The class of a change at `pattern` (rule 4): `nodes[].providers[].capacity`, as
    the configuration reference names its keys."""
    return "live" if _is_live_pattern(pattern) else "restart_required"


# --- keyed lists (rule 2) ----------------------------------------------------------------

_KeyOf = Callable[[Any], tuple[str, ...]]

_LIST_KEYS: dict[str, _KeyOf] = {
    "models": lambda model: (model.id,),
    "nodes": lambda node: (node.id,),
    "nodes[].providers": lambda provider: (provider.id,),
    "openai.principal_tokens": lambda token: (token.token_ref,),
    "openai.model_routes": lambda route: (route.model, route.provider),
    "principals": lambda entry: (entry.ref,),
}

_T = TypeVar("_T")


def _by_key(items: Sequence[_T], key_of: _KeyOf) -> dict[tuple[str, ...], _T] | None:
    """Items by key, or None when a key repeats (the list is then compared whole)."""
    keyed = {key_of(item): item for item in items}
    return keyed if len(keyed) == len(items) else None


# --- the walk (rules 1-3) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Found:
    """A change found by the walk: its path, rendered (rule 3) and as a pattern (rule 4),
    built step by step as the walk descends rather than once per change afterwards."""

    path: _Path
    text: str
    pattern: str


@functools.cache
def _field(name: str) -> _Field:
    return _Field(name)


def _walk(old: Any, new: Any, here: _Found, out: list[_Found]) -> None:
    """Append to `out` every change below `here`; `old != new` (the caller compared)."""
    if isinstance(old, msgspec.Struct) and type(old) is type(new):
        path, text, pattern = here.path, here.text, here.pattern
        for name in old.__struct_fields__:
            before, after = getattr(old, name), getattr(new, name)
            if before != after:
                step = f".{name}" if text else name
                _walk(
                    before,
                    after,
                    _Found((*path, _field(name)), text + step, pattern + step),
                    out,
                )
        return
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        old_entries: dict[tuple[str, ...], Any] = {(str(k),): v for k, v in old.items()}
        new_entries: dict[tuple[str, ...], Any] = {(str(k),): v for k, v in new.items()}
        _walk_keyed(old_entries, new_entries, here, out)
        return
    key_of = _LIST_KEYS.get(here.pattern)
    if key_of is not None and isinstance(old, list) and isinstance(new, list):
        old_items, new_items = _by_key(old, key_of), _by_key(new, key_of)
        if old_items is not None and new_items is not None:
            _walk_keyed(old_items, new_items, here, out)
            return
    out.append(here)


def _walk_keyed(
    old: Mapping[tuple[str, ...], Any],
    new: Mapping[tuple[str, ...], Any],
    here: _Found,
    out: list[_Found],
) -> None:
    pattern = here.pattern + "[]"
    for key in old.keys() | new.keys():
        item = _Found((*here.path, _Item(key)), f"{here.text}[{','.join(key)}]", pattern)
        if key in old and key in new:
            if old[key] != new[key]:
                _walk(old[key], new[key], item, out)
        else:
            out.append(item)


# --- the result --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConfigDiff:
    """Every change between two configs, sorted by path, with what they touch."""

    changes: tuple[Change, ...]
    changed_nodes: tuple[str, ...]
    """Nodes added, removed, or whose provider list changed: the ones a push concerns.
    A node whose token or alias alone changed needs no push and is not listed."""
    changed_providers: tuple[str, ...]
    changed_models: tuple[str, ...]
    _paths: tuple[_Path, ...] = field(repr=False)

    def __bool__(self) -> bool:
        return bool(self.changes)

    @property
    def live_paths(self) -> tuple[str, ...]:
        return tuple(c.path for c in self.changes if c.class_ == "live")

    @property
    def restart_required_paths(self) -> tuple[str, ...]:
        return tuple(c.path for c in self.changes if c.class_ == "restart_required")


def compare_configs(old: EdgeConfig, new: EdgeConfig) -> ConfigDiff:
    """Diff two configs (rules 1-5)."""
    found: list[_Found] = []
    if old != new:
        _walk(old, new, _Found((), "", ""), found)
    found.sort(key=lambda change: change.text)
    changes: list[Change] = []
    nodes: set[str] = set()
    providers: set[str] = set()
    models: set[str] = set()
    for change in found:
        changes.append(Change(path=change.text, class_=class_of(change.pattern)))
        match change.path:
            case (_Field("nodes"), _Item((node,))):
                nodes.add(node)
            case (_Field("nodes"), _Item((node,)), _Field("providers"), _Item((provider,)), *_):
                nodes.add(node)
                providers.add(provider)
            case (_Field("nodes"), _Item((node,)), _Field("providers")):
                nodes.add(node)
            case (_Field("models"), _Item((model,)), *_):
                models.add(model)
            case (_Field("openai"), _Field("model_routes"), _Item((model, _)), *_):
                models.add(model)
    return ConfigDiff(
        changes=tuple(changes),
        changed_nodes=tuple(sorted(nodes)),
        changed_providers=tuple(sorted(providers)),
        changed_models=tuple(sorted(models)),
        _paths=tuple(change.path for change in found),
    )


# --- the live subset (rule 6) ------------------------------------------------------------


def live_subset(old: EdgeConfig, new: EdgeConfig, diff: ConfigDiff) -> EdgeConfig:
    """`new` with every restart-required change of `diff` (old -> new) put back to `old`.

    This is what an apply with `allow_restart_required` runs: the live changes take
    effect, the rest keeps its running value until a restart. The result is not
    re-validated here; a live change can depend on a restart-required one (a model
    mapped to a provider that is only being added), which the caller must check.
    """
    effective = new
    for path, change in zip(diff._paths, diff.changes, strict=True):
        if change.class_ == "restart_required":
            effective = _restore(effective, old, (), path)
    return effective


def live_subset_errors(effective: EdgeConfig) -> list[RefreshError]:
    """Model mappings of a live subset that name a provider it does not have, and limits
    for a principal it has no token for (rule 7)."""
    providers = {provider.id for node in effective.nodes for provider in node.providers}
    principals = {token.principal_ref for token in effective.openai.principal_tokens}
    if not principals:
        principals = {ANONYMOUS_PRINCIPAL}
    unknown_principals = [
        RefreshError(
            path=_render((_Field("principals"), _Item((entry.ref,)))),
            message=f"principal '{entry.ref}' only exists after a restart (a principal "
            "token is a credential: changing one is restart-required), so its limits "
            "cannot go live before then",
        )
        for entry in effective.principals
        if entry.ref != EVERY_OTHER_PRINCIPAL and entry.ref not in principals
    ]
    return unknown_principals + [
        RefreshError(
            path=_render(
                (_Field("models"), _Item((model.id,)), _Field("providers"), _Item((pid,)))
            ),
            message=f"provider '{pid}' only exists after a restart (adding a provider is "
            "restart-required), so this mapping cannot go live before then",
        )
        for model in effective.models
        for pid in model.providers
        if pid not in providers
    ]


def _restore(new: Any, old: Any, done: _Path, rest: _Path) -> Any:
    """`new` with the value at `done + rest` taken from `old` (changed, removed or added).

    `done` is the path walked so far: a keyed list needs it to know its key function.
    """
    if not rest:
        return old
    step, tail = rest[0], rest[1:]
    here = (*done, step)
    if isinstance(step, _Field):
        value = _restore(getattr(new, step.name), getattr(old, step.name), here, tail)
        return msgspec.structs.replace(new, **{step.name: value})
    if isinstance(new, Mapping):
        new_keys: dict[tuple[str, ...], Any] = {(str(k),): k for k in new}
        old_keys: dict[tuple[str, ...], Any] = {(str(k),): k for k in old}
        restored = dict(new)
        if step.key in new_keys and step.key in old_keys:
            k = new_keys[step.key]
            restored[k] = _restore(new[k], old[old_keys[step.key]], here, tail)
        elif step.key in old_keys:  # removed by the candidate: put it back
            restored[old_keys[step.key]] = old[old_keys[step.key]]
        else:  # added by the candidate: take it out
            del restored[new_keys[step.key]]
        return restored
    key_of = _LIST_KEYS[_pattern(done)]
    old_item = next((item for item in old if key_of(item) == step.key), None)
    items: list[Any] = []
    for item in new:
        if key_of(item) != step.key:
            items.append(item)
        elif old_item is not None:  # changed below the item: restore inside it
            items.append(_restore(item, old_item, here, tail))
        # else: added by the candidate, so it is left out
    if old_item is not None and all(key_of(item) != step.key for item in new):
        items.append(old_item)  # removed by the candidate: put it back
    return items
