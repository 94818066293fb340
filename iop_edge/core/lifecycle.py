"""The models' lifecycle policy (`models[].lifecycle`, design §18.4): idle rules, pins,
preloads. Pure.

Rules:

1. Idle. A model with `idle_unload_s` has one idle rule per provider serving it, by the
   name the provider serves it under, sent to that provider's Node with its providers
   (`NodeConfig.idle`). The Node keeps the clock (`iop_node.idle_clock`): it sees every
   Edge's runs on the provider and its runtime's word on what is loaded, so several
   Edges sharing it agree. A refresh that changes a rule pushes the Nodes it concerns.
2. Copies. A model wants `max(preload, 1)` copies when `keep_loaded` (pinned: kept),
   `preload` copies otherwise (loaded once).
3. Where. The providers that can take a copy are those connected, enabled, not
   `unavailable`, whose runtime loads on request and has not `failed` the model. Copies
   already chosen stay while they can, and for a while after they cannot (the keeper's
   `MOVE_AFTER_S`: a probe that fails once, or a Node dialling again, does not move a
   pin, which would load the model elsewhere and unload it here); then those that hold
   the model already (no load), then those with room (nothing unloaded for it), then
   the rest; each group in
   the model's rendezvous order (`core.routing.affinity.placement_key`, as a run's load is
   placed, `core.routing.pool` Rule 8). So every Edge sharing the Nodes picks the same
   providers, with no shared store.
4. Pins. A `keep_loaded` model is pinned on its Rule 3 copies; an operator's pin is on
   one provider (the one named, else the model's first Rule 3 choice). A pinned copy is
   never chosen to make room (`core.routing.holdings` Rule 4), never unloaded for idleness
   (the Node is told, `model_command` `pin`), and loaded again when its runtime does
   not hold it. A config pin lasts while the config says so, an operator's until it is
   unpinned or the Edge restarts.
5. Preloads. A model's preload is done once its wanted copies are held or were asked
   for (each provider at most once), and starts over when a refresh changes the
   model's `lifecycle` or the Edge starts: a copy that goes away later is not loaded
   again (only a pin does that).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from iop_edge.core.routing.affinity import placement_key, provider_seed, rendezvous_score
from schemas.catalog import CatalogProvider
from schemas.config import IdleRule, ModelEntry, ModelLifecycle

__all__ = [
    "Copy",
    "choose_copies",
    "copy_of",
    "idle_rules",
    "lifecycle_problems",
    "wanted_copies",
]

_HELD = frozenset({"loaded", "loading"})


def idle_rules(
    models: Iterable[ModelEntry], provider_node: Mapping[str, str]
) -> dict[str, tuple[IdleRule, ...]]:
    """Rule 1: each Node's idle rules, in config order."""
    rules: dict[str, list[IdleRule]] = {}
    for model in models:
        idle_s = model.lifecycle.idle_unload_s
        if idle_s is None:
            continue
        for provider_id, served in model.providers.items():
            node_id = provider_node.get(provider_id)
            if node_id is not None:
                rules.setdefault(node_id, []).append(
                    IdleRule(provider_id=provider_id, model=served, idle_unload_s=idle_s)
                )
    return {node_id: tuple(node_rules) for node_id, node_rules in rules.items()}


def lifecycle_problems(raw: object, providers: int) -> list[tuple[str, str]]:
    """What is wrong with a model's `lifecycle` beyond its shape: (field, message)."""
    if not isinstance(raw, dict):
        return []
    preload = raw.get("preload")
    if isinstance(preload, int) and not isinstance(preload, bool) and preload > providers:
        return [
            (
                "preload",
                f"asks for {preload} copies but the model has {providers} provider(s)",
            )
        ]
    return []


def wanted_copies(lifecycle: ModelLifecycle) -> int:
    """Rule 2."""
    return max(lifecycle.preload, 1) if lifecycle.keep_loaded else lifecycle.preload


@dataclass(frozen=True, slots=True)
class Copy:
    """One provider of a model, as far as choosing its copies goes (Rule 3)."""

    provider: str
    holds: bool
    """Its runtime holds the model (`loaded` or `loading`), per its last report."""
    can_take: bool
    """It could load the model (Rule 3's candidates)."""
    room: bool
    """It holds fewer models than its `max_loaded` (or does not say how many)."""


def copy_of(provider: CatalogProvider, served: str) -> Copy:
    """What a provider's catalog record says of a copy of `served` there."""
    states = {state.name: state.state for state in provider.model_states or ()}
    state = states.get(served)
    lifecycle = provider.discovered_lifecycle
    held = sum(s in _HELD for s in states.values())
    usable = provider.connected and provider.enabled and provider.health != "unavailable"
    return Copy(
        provider=provider.id,
        holds=usable and state in _HELD,
        can_take=usable
        and lifecycle is not None
        and lifecycle.load_model
        and provider.model_states is not None
        and state != "failed",
        room=provider.max_loaded is None or held < provider.max_loaded,
    )


def choose_copies(
    model_id: str,
    copies: Sequence[Copy],
    wanted: int,
    *,
    chosen: Sequence[str] = (),
    waiting: Collection[str] = (),
) -> list[str]:
    """Rule 3: the providers a model's `wanted` copies go to, first choices first (fewer
    when fewer can take one). `waiting`: those of `chosen` that cannot take a copy now
    but keep their place a while yet."""
    if wanted <= 0:
        return []
    key = placement_key(model_id)
    takers = [copy for copy in copies if copy.can_take or copy.holds]
    able = {copy.provider for copy in takers}
    kept = [provider for provider in chosen if provider in able or provider in waiting]

    def order(copy: Copy) -> tuple[bool, bool, int]:
        return (not copy.holds, not copy.room, -rendezvous_score(key, provider_seed(copy.provider)))

    rest = sorted((copy for copy in takers if copy.provider not in kept), key=order)
    return (kept + [copy.provider for copy in rest])[:wanted]
