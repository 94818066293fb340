"""Which provider a model is loaded on (`core.placement`, design §18): pure rules."""

from __future__ import annotations

from typing import Any

from iop_edge.core.placement import choose_load, holders_of
from schemas.catalog import CatalogLifecycle, CatalogProvider
from schemas.wire import ModelLoadState, ModelState

LOADS = CatalogLifecycle(list_models=True, load_model=True, unload_model=True)


def _provider(
    provider_id: str, held: dict[str, ModelLoadState] | None = None, **fields: Any
) -> CatalogProvider:
    record: dict[str, Any] = {
        "id": provider_id,
        "node_id": "n",
        "type": "openai_api",
        "category": "local_inference",
        "enabled": True,
        "connected": True,
        "health": "available",
        "capacity": 4,
        "in_flight": 0,
        "load_ratio": 0.0,
        "long_context_slots": None,
        "long_in_flight": 0,
        "discovered_lifecycle": LOADS,
        "model_states": [ModelState(name=n, state=s) for n, s in (held or {}).items()],
        "max_loaded": 1,
    }
    return CatalogProvider(**(record | fields))


def test_a_provider_that_holds_the_model_is_the_answer_and_nothing_loads() -> None:
    choice = choose_load(
        [(_provider("p1", {"x": "unloaded"}), "x"), (_provider("p2", {"x": "loading"}), "x")]
    )
    assert (choice.provider, choice.already) == ("p2", True)


def test_a_provider_with_room_comes_before_one_that_must_evict() -> None:
    full = _provider("p1", {"x": "unloaded", "y": "loaded"})
    room = _provider("p2", {"x": "unloaded", "y": "unloaded"}, in_flight=3)
    assert choose_load([(full, "x"), (room, "x")]).provider == "p2"


def test_among_full_providers_the_least_busy_then_priority_then_id() -> None:
    busy = _provider("a", {"y": "loaded"}, in_flight=2)
    idle = _provider("b", {"y": "loaded"}, priority=200)
    preferred = _provider("c", {"y": "loaded"}, priority=10)
    assert choose_load([(busy, "x"), (idle, "x"), (preferred, "x")]).provider == "c"
    assert choose_load([(busy, "x"), (idle, "x")]).provider == "b"


def test_a_runtime_that_does_not_say_how_many_it_holds_has_room() -> None:
    unbounded = _provider("a", {"y": "loaded"}, max_loaded=None, in_flight=1)
    bounded = _provider("b", {"y": "loaded"})
    assert choose_load([(bounded, "x"), (unbounded, "x")]).provider == "a"


def test_providers_that_cannot_load_are_named_with_why() -> None:
    listing_only = _provider("plain", discovered_lifecycle=CatalogLifecycle(list_models=True))
    down = _provider("down", health="unavailable", health_reason="connection refused")
    failed = _provider("bad", {"x": "failed"})
    gone = _provider("gone", connected=False, health_reason="node disconnected")
    choice = choose_load([(listing_only, "x"), (down, "x"), (failed, "x"), (gone, "x")])
    assert choice.provider is None
    assert choice.reason == (
        "plain: its runtime does not load models on request; down: connection refused; "
        "bad: x failed to load there; gone: node disconnected"
    )
    assert choose_load([]).reason == "it has no providers"


def test_an_unload_acts_on_every_provider_holding_the_model() -> None:
    records = [
        (_provider("a", {"x": "loaded"}), "x"),
        (_provider("b", {"x-served": "sleeping"}), "x-served"),
        (_provider("c", {"x": "unloaded"}), "x"),
        (_provider("d", {"x": "loaded"}, connected=False), "x"),
    ]
    assert holders_of(records) == [("a", "x"), ("b", "x-served")]
