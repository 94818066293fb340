"""Where models are loaded and runs go for them (design §18.4): `core.routing.placement` (the
operator's loads), pool Rule 8 (runs) and `core.routing.holdings` (the Edge's account): pure
rules."""

from __future__ import annotations

from functools import partial
from typing import Any

from iop_edge.core.routing.holdings import Holdings
from iop_edge.core.routing.placement import choose_load, holders_of, pinned_at
from iop_edge.core.routing.pool import Grant, ProviderView, Refuse, Wait, decide
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


def test_a_provider_full_of_pinned_models_takes_no_load_and_says_why() -> None:
    """A load there would unload the pin, which loads it back at once."""
    pinned = _provider("p1", model_states=[ModelState(name="y", state="loaded", pinned=True)])
    choice = choose_load([(pinned, "x")])
    assert choice.provider is None
    assert "all pinned (y): unpin one first" in (choice.reason or "")
    unpinned = _provider("p2", {"y": "loaded"})
    assert choose_load([(pinned, "x"), (unpinned, "x")]).provider == "p2"


def test_an_unload_leaves_pinned_copies_alone() -> None:
    pinned = _provider("p1", model_states=[ModelState(name="x", state="loaded", pinned=True)])
    loose = _provider("p2", {"x": "loaded"})
    records = [(pinned, "x"), (loose, "x")]
    assert holders_of(records) == [("p1", "x"), ("p2", "x")]
    assert pinned_at(records) == {"p1"}


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


# --- pool Rule 8: runs go where their model is held --------------------------------------


_decide = partial(decide, placing=True)


def _view(provider_id: str, **fields: Any) -> ProviderView:
    return ProviderView(id=provider_id, capacity=2, **fields)


def test_a_run_goes_to_a_holder_even_when_a_cold_provider_is_idler() -> None:
    views = {"cold": _view("cold", holds="cold"), "held": _view("held", holds="held", in_flight=1)}
    assert _decide("m", ["cold", "held"], views, long=False) == Grant(views["held"])


def test_a_model_whose_runtimes_report_no_states_is_routed_by_load_alone() -> None:
    views = {"cold": _view("cold", holds="cold"), "held": _view("held", holds="held", in_flight=1)}
    assert decide("m", ["cold", "held"], views, long=False) == Grant(views["cold"])


def test_a_run_waits_for_a_full_holder_rather_than_loading_a_second_copy() -> None:
    views = {"cold": _view("cold", holds="cold"), "held": _view("held", holds="held", in_flight=2)}
    assert _decide("m", ["cold", "held"], views, long=False) == Wait(("cold", "held"))


def test_demand_beyond_the_holders_slots_loads_another_copy() -> None:
    views = {"cold": _view("cold", holds="cold"), "held": _view("held", holds="held", in_flight=2)}
    decision = _decide("m", ["cold", "held"], views, long=False, waiting=2)
    assert decision == Grant(views["cold"])


def test_a_model_nobody_holds_is_loaded_where_there_is_room_then_where_every_edge_would() -> None:
    full = _view("full", holds="cold", room=False)
    roomy = _view("roomy", holds="cold", in_flight=1)
    assert _decide("m", ["full", "roomy"], {"full": full, "roomy": roomy}, long=False) == Grant(
        roomy
    )
    # Without room anywhere, the model's rendezvous choice: the same whatever the order.
    views = {p: _view(p, holds="cold", room=False) for p in ("p1", "p2", "p3", "p4")}
    first = _decide("m", ["p1", "p2", "p3", "p4"], views, long=False)
    again = _decide("m", ["p4", "p3", "p2", "p1"], views, long=False, last="p2")
    assert first == again
    # Different models spread over the providers.
    chosen = {
        _decide(f"model-{i}", list(views), views, long=False).provider.id  # type: ignore[union-attr]
        for i in range(20)
    }
    assert len(chosen) > 1


def test_a_provider_that_cannot_load_is_passed_over_and_failed_ones_are_named() -> None:
    busy = _view("busy", holds="cold", can_load=False)
    views = {"busy": busy, "ok": _view("ok", holds="cold", in_flight=1)}
    assert _decide("m", ["busy", "ok"], views, long=False) == Grant(views["ok"])
    assert _decide("m", ["busy"], {"busy": busy}, long=False) == Wait(("busy",))
    failed = {"f": _view("f", holds="failed")}
    assert _decide("m", ["f"], failed, long=False) == Refuse(
        "every provider of model 'm' failed to load it"
    )


# --- core.routing.holdings: the Edge's account between reports ------------------------------------


def _states(**states: str) -> list[ModelState]:
    return [ModelState(name=n, state=s) for n, s in states.items()]  # type: ignore[arg-type]


def test_a_runtime_that_reports_nothing_holds_everything() -> None:
    holdings = Holdings()
    assert holdings.holding("x", 0.0) == "held"
    holdings.report(None, None)
    assert holdings.holding("x", 0.0) == "held" and holdings.room(0.0)


def test_a_placed_load_counts_as_held_until_the_runtime_says_or_time_passes() -> None:
    holdings = Holdings()
    holdings.report(_states(a="loaded", b="unloaded"), max_loaded=1)
    assert (holdings.holding("a", 0), holdings.holding("b", 0)) == ("held", "cold")
    assert not holdings.room(0) and holdings.can_load("b", 0)
    holdings.started("b", 1.0, load_timeout_s=60)  # the runtime unloads a for it
    assert (holdings.holding("a", 2), holdings.holding("b", 2)) == ("cold", "held")
    holdings.report(_states(a="loaded", b="unloaded"), max_loaded=1)  # a report from before
    assert holdings.holding("b", 3) == "held"
    assert holdings.holding("b", 62) == "cold"  # the load never showed: forgotten
    holdings.report(_states(a="unloaded", b="loaded"), max_loaded=1)
    assert (holdings.holding("a", 63), holdings.holding("b", 63)) == ("cold", "held")


def test_a_placed_load_a_run_has_used_is_settled_by_a_report_that_it_is_gone() -> None:
    """The runtime loaded b for a run, then unloaded it for a pin (a report taken before
    the load said the same, and meant otherwise): once a run of b has ended there, the
    report is believed, and b is not sent back to evict the pinned model."""
    holdings = Holdings()
    holdings.report(_states(a="unloaded", b="unloaded"), max_loaded=1)
    holdings.started("b", 1.0, load_timeout_s=60)
    holdings.report(_states(a="unloaded", b="unloaded"), max_loaded=1)  # from before the load
    assert holdings.holding("b", 2) == "held"
    holdings.ended("b")
    holdings.pinned = frozenset({"a"})
    holdings.report([ModelState(name="a", state="loaded", pinned=True)], max_loaded=1)
    assert holdings.holding("b", 3) == "cold"
    assert not holdings.room(3) and not holdings.can_load("b", 3)  # a is pinned
    holdings.started("b", 4.0, load_timeout_s=60)  # placed again (another Edge's way)...
    holdings.report(_states(b="unloaded"), max_loaded=1)
    assert holdings.holding("b", 5) == "held"  # ...and no run of it has ended since


def test_a_model_in_use_is_never_the_guessed_victim() -> None:
    holdings = Holdings()
    holdings.report(_states(a="loaded", b="unloaded", c="unloaded"), max_loaded=1)
    holdings.started("a", 0.0, load_timeout_s=60)
    assert not holdings.can_load("b", 1.0)  # a is running: nothing idle to unload
    holdings.ended("a")
    assert holdings.can_load("b", 1.0)


def test_failed_and_sleeping_models() -> None:
    holdings = Holdings()
    holdings.report(
        [
            ModelState(name="f", state="failed", reason="exit 1"),
            ModelState(name="s", state="sleeping"),
        ],
        max_loaded=None,
    )
    assert holdings.holding("f", 0) == "failed" and holdings.failure("f") == "exit 1"
    # asleep: cold, and a run wakes it there (Rule 6)
    assert holdings.holding("s", 0) == "cold" and holdings.can_load("s", 0)
    assert holdings.asleep("s") and not holdings.asleep("f")
    assert holdings.holding("unlisted", 0) == "cold"
    holdings.forget()
    assert holdings.holding("f", 0) == "held"
