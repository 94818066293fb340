"""The models' lifecycle policy (`core.lifecycle`, `core.routing.holdings` pins): pure rules."""

from __future__ import annotations

from iop_edge.core.lifecycle import Copy, choose_copies, copy_of, idle_rules, wanted_copies
from iop_edge.core.routing.affinity import placement_key, rendezvous_order
from iop_edge.core.routing.holdings import Holdings
from iop_edge.core.routing.pool import Grant, ProviderView, decide
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.refresh.worker import delta
from schemas.config import (
    EdgeConfig,
    IdleRule,
    ModelEntry,
    ModelLifecycle,
    NodeEntry,
    ProviderConfig,
)
from schemas.wire import ModelState
from tests.unit.test_placement import _provider


def test_each_node_gets_the_idle_rules_of_its_providers_by_served_name() -> None:
    models = [
        ModelEntry(
            id="qwen",
            providers={"p1": "qwen-q4", "p2": "qwen:7b"},
            lifecycle=ModelLifecycle(idle_unload_s=300),
        ),
        ModelEntry(id="kept", providers={"p1": "kept"}),  # no rule: the runtime decides
    ]
    rules = idle_rules(models, {"p1": "n1", "p2": "n2"})
    assert rules == {
        "n1": (IdleRule(provider_id="p1", model="qwen-q4", idle_unload_s=300),),
        "n2": (IdleRule(provider_id="p2", model="qwen:7b", idle_unload_s=300),),
    }


def test_a_pinned_model_wants_at_least_one_copy_and_a_preload_its_number() -> None:
    assert wanted_copies(ModelLifecycle(keep_loaded=True)) == 1
    assert wanted_copies(ModelLifecycle(keep_loaded=True, preload=3)) == 3
    assert wanted_copies(ModelLifecycle(preload=2)) == 2
    assert wanted_copies(ModelLifecycle(idle_unload_s=5)) == 0


def _copies(*ids: str, room: bool = True) -> list[Copy]:
    return [Copy(provider=p, holds=False, can_take=True, room=room) for p in ids]


def test_two_edges_choose_the_same_providers_whatever_order_they_see_them_in() -> None:
    ids = [f"gpu{i}" for i in range(8)]
    first = choose_copies("llama", _copies(*ids), 3)
    second = choose_copies("llama", _copies(*reversed(ids)), 3)
    assert first == second == rendezvous_order(placement_key("llama"), ids)[:3]
    # another model lands elsewhere (the spread is the hash's)
    assert {tuple(choose_copies(f"m{i}", _copies(*ids), 1)) for i in range(20)} != {
        tuple(first[:1])
    }


def test_holders_come_first_then_room_then_the_rest_and_failed_providers_never() -> None:
    copies = [
        Copy(provider="full", holds=False, can_take=True, room=False),
        Copy(provider="room", holds=False, can_take=True, room=True),
        Copy(provider="holder", holds=True, can_take=True, room=False),
        Copy(provider="failed", holds=False, can_take=False, room=True),
    ]
    assert choose_copies("m", copies, 4) == ["holder", "room", "full"]


def test_copies_already_chosen_stay_while_they_can() -> None:
    ids = ["a", "b", "c"]
    best = choose_copies("m", _copies(*ids), 1)
    other = next(p for p in ids if p not in best)
    assert choose_copies("m", _copies(*ids), 1, chosen=[other]) == [other]
    gone = [c for c in _copies(*ids) if c.provider != other]
    assert choose_copies("m", gone, 1, chosen=[other]) == best
    # one that cannot take it now, but keeps its place a while yet (the keeper's grace)
    assert choose_copies("m", gone, 1, chosen=[other], waiting={other}) == [other]


def test_a_catalog_record_says_whether_a_copy_can_be_taken() -> None:
    held = copy_of(_provider("p", {"m": "loaded"}), "m")
    assert (held.holds, held.can_take, held.room) == (True, True, False)
    failed = copy_of(_provider("p", {"m": "failed"}), "m")
    assert (failed.holds, failed.can_take) == (False, False)
    gone = copy_of(_provider("p", {"m": "loaded"}, connected=False), "m")
    assert (gone.holds, gone.can_take) == (False, False)
    silent = copy_of(_provider("p", model_states=None, discovered_lifecycle=None), "m")
    assert silent.can_take is False  # a runtime that does not load on request


def test_placement_never_unloads_a_pinned_model_to_make_room() -> None:
    holdings = Holdings()
    holdings.report([ModelState(name="kept", state="loaded")], max_loaded=1)
    assert holdings.can_load("other", now=0.0)
    holdings.pinned = frozenset({"kept"})
    assert not holdings.can_load("other", now=0.0)

    two = Holdings()
    two.report(
        [ModelState(name="kept", state="loaded"), ModelState(name="old", state="loaded")],
        max_loaded=2,
    )
    two.started("old", now=1.0, load_timeout_s=60)
    two.ended("old")
    two.pinned = frozenset({"kept"})
    # kept is the least recently used, but pinned: old goes instead
    two.started("new", now=2.0, load_timeout_s=60)
    assert two.holding("kept", now=3.0) == "held"
    assert two.holding("old", now=3.0) == "cold"


def test_another_edge_s_pin_reported_by_the_node_is_kept_as_this_edge_s_own() -> None:
    holdings = Holdings()
    holdings.report(
        [
            ModelState(name="kept", state="loaded", pinned=True),
            ModelState(name="b", state="unloaded"),
        ],
        max_loaded=1,
    )
    assert not holdings.can_load("b", now=0.0)  # the only model it holds is pinned
    assert holdings.all_pinned() == {"kept"}
    holdings.pinned = frozenset({"b"})  # this Edge's own pin, beside the reported one
    assert holdings.all_pinned() == {"kept", "b"}
    holdings.report([ModelState(name="kept", state="loaded")], max_loaded=1)  # unpinned
    assert holdings.can_load("other", now=0.0)
    assert holdings.all_pinned() == {"b"}


def test_a_run_wakes_a_sleeping_copy_before_it_cold_loads_one_anywhere() -> None:
    """Pool Rule 8, holdings Rule 6: a wake-up is a load with room, and the cheapest."""
    full = Holdings()
    full.report(
        [ModelState(name="m", state="sleeping"), ModelState(name="busy", state="loaded")],
        max_loaded=1,
    )
    full.started("busy", now=0.0, load_timeout_s=60)  # no idle model to unload
    assert full.can_load("m", now=0.0)
    full.started("m", now=0.0, load_timeout_s=60)
    # woken, not loaded in place of another: nothing counts as unloaded for it
    assert full.holding("busy", now=1.0) == "held"
    assert full.holding("m", now=1.0) == "held"

    views = {
        "cold": ProviderView(id="cold", capacity=2, holds="cold", room=True),
        "asleep": ProviderView(id="asleep", capacity=2, holds="cold", asleep=True, room=False),
    }
    for rotation in (("cold", "asleep"), ("asleep", "cold")):
        decision = decide("m", rotation, views, long=False, placing=True)
        assert isinstance(decision, Grant) and decision.provider.id == "asleep"


def _fleet(lifecycle: ModelLifecycle) -> Snapshot:
    providers = {
        node: [ProviderConfig(id=f"{node}-p", type="openai_api", models=["s"], capacity=1)]
        for node in ("n1", "n2")
    }
    config = EdgeConfig(
        models=[
            ModelEntry(id="m", providers={"n1-p": "s"}, lifecycle=lifecycle),
            ModelEntry(id="other", providers={"n2-p": "s"}),
        ],
        nodes=[
            NodeEntry(id=node, token_hash_sha256="0" * 64, providers=node_providers)
            for node, node_providers in providers.items()
        ],
    )
    return Snapshot.build(config, revision=1, config_sha256="0" * 64)


def test_a_refresh_that_changes_an_idle_rule_pushes_only_the_nodes_it_concerns() -> None:
    before = _fleet(ModelLifecycle())
    after = _fleet(ModelLifecycle(idle_unload_s=120))
    # the refresh worker's delta names the Nodes to push: its entry unchanged, n1's idle
    # rules are not
    assert delta(before.config, after.config).to_push == ["n1"]
    assert after.node_config("n1").idle == [
        IdleRule(provider_id="n1-p", model="s", idle_unload_s=120)
    ]
    assert after.node_config("n2").idle == []
    # pins and preloads are the Edge's alone: no Node hears of them
    pinned = _fleet(ModelLifecycle(keep_loaded=True, preload=1))
    assert delta(before.config, pinned.config).to_push == []
