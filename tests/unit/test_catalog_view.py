"""`iop_edge.core.catalog_view`: one provider's catalog record, and why a provider is out
of the pool, from plain values (the scheduler's state is pinned in tests/unit/test_pool.py
and the e2e catalog tests)."""

from __future__ import annotations

from typing import Any

import pytest

from iop_edge.core.catalog_view import catalog_lifecycle, catalog_provider, health_reason
from schemas.config import ProviderConfig

CONFIG = ProviderConfig(id="gpu", type="vllm", models=["m"], capacity=4, lifecycle=["list_models"])
STATE: dict[str, Any] = {
    "node_id": "n1",
    "connected": True,
    "health": "available",
    "detail": None,
    "in_flight": 1,
    "long_in_flight": 0,
    "other_edges_in_flight": 0,
    "discovered_models": ["m"],
    "discovered_lifecycle": ["list_models", "load_model"],
    "queued": 0,
    "cooling_down": False,
    "consecutive_failures": 0,
    "protocols": ["chat"],
}


def test_a_connected_available_provider_is_fully_in_the_pool() -> None:
    record = catalog_provider(CONFIG, **STATE)
    assert (record.health, record.health_reason, record.load_ratio) == ("available", None, 0.25)
    assert record.discovered_lifecycle is not None and record.discovered_lifecycle.load_model
    assert record.lifecycle.list_models and not record.lifecycle.load_model


def test_a_provider_whose_node_is_gone_is_unavailable_whatever_it_last_said() -> None:
    record = catalog_provider(CONFIG, **{**STATE, "connected": False})
    assert (record.health, record.health_reason) == ("unavailable", "node disconnected")
    assert record.discovered_lifecycle is None


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        (
            {"cooling_down": True, "consecutive_failures": 3, "enabled": False},
            "cooling down after 3 consecutive failures",
        ),
        ({"enabled": False}, "disabled in config"),
        ({"health": "unknown"}, "waiting for the node's first health report"),
        ({"health": "unknown", "detail": "probing"}, "probing"),
        ({"health": "busy"}, "busy"),
        # The health is its own column: a Node's words that repeat it lose the repeat.
        (
            {"health": "busy", "detail": "busy: 1 run from IOP producing output"},
            "1 run from IOP producing output",
        ),
        ({"health": "busy", "detail": "busy-looking words"}, "busy-looking words"),
        (
            {"health": "unavailable", "detail": "GET /models returned 500"},
            "GET /models returned 500",
        ),
    ],
)
def test_the_first_reason_a_provider_is_out_of_the_pool_is_the_one_given(
    state: dict[str, Any], reason: str
) -> None:
    values: dict[str, Any] = {
        "connected": True,
        "cooling_down": False,
        "consecutive_failures": 0,
        "enabled": True,
        "health": "available",
        "detail": None,
    }
    assert health_reason(**{**values, **state}) == reason


def test_one_lifecycle_record_is_shared_per_set_of_flags() -> None:
    assert catalog_lifecycle(["load_model", "list_models"]) is catalog_lifecycle(
        ("list_models", "load_model")
    )
