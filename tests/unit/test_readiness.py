"""Readiness rules (`iop_edge.core.routing.readiness`)."""

from __future__ import annotations

from typing import Any

import pytest

from iop_edge.core.routing.readiness import readiness
from schemas.catalog import Catalog, CatalogModel, CatalogProvider


def _provider(provider_id: str, **changes: Any) -> CatalogProvider:
    values: dict[str, Any] = {
        "id": provider_id,
        "node_id": "n",
        "type": "sim",
        "category": "local_inference",
        "enabled": True,
        "connected": True,
        "health": "available",
        "capacity": 2,
        "in_flight": 2,  # full: a request would queue and be served, so still ready
        "load_ratio": 1.0,
        "long_context_slots": None,
        "long_in_flight": 0,
    }
    values.update(changes)
    return CatalogProvider(**values)


def _catalog(*providers: CatalogProvider) -> Catalog:
    return Catalog(
        revision=1,
        models=[
            CatalogModel(id="a", providers={"p1": "x"}),
            CatalogModel(id="b", providers={"p2": "x", "p3": "x"}),
        ],
        providers=list(providers),
    )


def test_ready_with_the_servable_models() -> None:
    state = readiness(_catalog(_provider("p1"), _provider("p2", health="busy")))
    assert (state.ready, state.servable_models, state.models) == (True, ["a", "b"], 2)


@pytest.mark.parametrize(
    "change",
    [
        {"connected": False},
        {"enabled": False},
        {"health": "unavailable"},
        {"health": "draining"},
        {"health": "unknown"},
        {"cooling_down": True},
    ],
)
def test_a_provider_that_cannot_take_runs_now(change: dict[str, Any]) -> None:
    state = readiness(_catalog(_provider("p1", **change), _provider("p2", **change)))
    assert (state.ready, state.servable_models) == (False, [])


def test_one_servable_model_is_enough() -> None:
    state = readiness(_catalog(_provider("p1", health="draining"), _provider("p3")))
    assert (state.ready, state.servable_models) == (True, ["b"])


def test_a_mapping_its_node_refused_serves_nothing_and_one_pending_its_ack_does() -> None:
    refused = _provider("p1", unapplied={"x": "refused"})
    assert readiness(_catalog(refused)).servable_models == []
    pending = _provider("p1", unapplied={"x": "pending"})
    assert readiness(_catalog(pending)).servable_models == ["a"]
    other_name = _provider("p1", unapplied={"y": "refused"})  # another served name's
    assert readiness(_catalog(other_name)).servable_models == ["a"]
