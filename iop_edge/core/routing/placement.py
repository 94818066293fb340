"""Which provider a model is loaded on, and which hold it (design §18). Pure.

Rules:

1. A provider whose runtime holds the model (`loaded`, or `loading`) needs no load: a load
   asked for without a provider is answered by the first such one, and nothing is done.
2. The candidates for a load are the model's providers that are connected, enabled, not
   `unavailable`, and whose runtime loads on request (`load_model` among the lifecycle
   operations its Node discovered) and has not `failed` this model, and which is not full
   of pinned models (a load there would unload a pin, which loads it back at once).
3. Among the candidates, one with room comes first: it holds fewer models than its
   `max_loaded` (a runtime that does not say how many it holds has room). Then fewer
   runs in flight (a load evicts, and a busy runtime's models are in use), then lower
   `priority`, then the provider id.
4. An unload without a provider acts on every provider whose runtime holds the model
   (`loaded`, `loading` or `sleeping`); a copy pinned there is not unloaded (`pinned_at`
   names those: the pin would load it back at once).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from schemas.catalog import CatalogProvider

__all__ = ["LoadChoice", "choose_load", "holders_of", "pinned_at"]

#: The states in which a runtime holds a model in memory (Rule 1; `sleeping` for Rule 4).
_HELD = frozenset({"loaded", "loading"})
_HELD_OR_ASLEEP = _HELD | {"sleeping"}


@dataclass(frozen=True, slots=True)
class LoadChoice:
    """Where to load: `provider` (None: nowhere), whether it `already` holds the model,
    and `reason`, why no provider could take it."""

    provider: str | None
    already: bool = False
    reason: str | None = None


def _state(provider: CatalogProvider, served: str) -> str | None:
    for state in provider.model_states or ():
        if state.name == served:
            return state.state
    return None


def _loads_on_request(provider: CatalogProvider) -> bool:
    discovered = provider.discovered_lifecycle
    return discovered is not None and discovered.load_model


def _held_count(provider: CatalogProvider) -> int:
    return sum(state.state in _HELD for state in provider.model_states or ())


def _full_of_pins(provider: CatalogProvider) -> list[str] | None:
    """The pinned models that fill `provider` (Rule 2), or None when it has room or a
    model it may unload."""
    held = [s for s in provider.model_states or () if s.state in _HELD]
    full = provider.max_loaded is not None and len(held) >= provider.max_loaded
    if not full or not held or not all(s.pinned for s in held):
        return None
    return [s.name for s in held]


def choose_load(providers: Iterable[tuple[CatalogProvider, str]]) -> LoadChoice:
    """Where a model goes (Rules 1-3), from each of its providers with its served name."""
    candidates: list[CatalogProvider] = []
    refusals: list[str] = []
    for provider, served in providers:
        state = _state(provider, served)
        if state in _HELD and provider.connected:
            return LoadChoice(provider=provider.id, already=True)
        if not provider.connected or not provider.enabled or provider.health == "unavailable":
            refusals.append(f"{provider.id}: {provider.health_reason or provider.health}")
        elif not _loads_on_request(provider):
            refusals.append(f"{provider.id}: its runtime does not load models on request")
        elif state == "failed":
            refusals.append(f"{provider.id}: {served} failed to load there")
        elif (pins := _full_of_pins(provider)) is not None:
            refusals.append(
                f"{provider.id}: it holds {len(pins)} model(s), all pinned ({', '.join(pins)}): "
                "unpin one first"
            )
        else:
            candidates.append(provider)
    if not candidates:
        return LoadChoice(provider=None, reason="; ".join(refusals) or "it has no providers")

    def order(provider: CatalogProvider) -> tuple[bool, int, int, str]:
        room = provider.max_loaded is None or _held_count(provider) < provider.max_loaded
        return (not room, provider.in_flight, provider.priority, provider.id)

    return LoadChoice(provider=min(candidates, key=order).id)


def holders_of(providers: Sequence[tuple[CatalogProvider, str]]) -> list[tuple[str, str]]:
    """Rule 4: the (provider, served name) pairs whose runtime holds the model."""
    return [
        (provider.id, served)
        for provider, served in providers
        if provider.connected and _state(provider, served) in _HELD_OR_ASLEEP
    ]


def pinned_at(providers: Sequence[tuple[CatalogProvider, str]]) -> set[str]:
    """Rule 4: the providers where the model is pinned."""
    return {
        provider.id
        for provider, served in providers
        for state in provider.model_states or ()
        if state.name == served and state.pinned
    }
