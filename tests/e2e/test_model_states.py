"""Runtimes' model load states reach the operator (design §18): a Node reads them from the
runtime's lifecycle API and the catalog, `/metrics` and the pool page's data show them per
provider, following the runtime as it loads and unloads."""

from __future__ import annotations

from typing import Any

import trio

from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.upstreams import MakeStack, provider_of, upstream_provider


def _held(catalog: dict[str, Any], provider_id: str) -> dict[str, str]:
    states = provider_of(catalog, provider_id).get("model_states") or []
    return {state["name"]: state["state"] for state in states}


async def test_a_llama_router_s_states_follow_its_loads(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(
        models=["smol-a", "smol-b", "broken"],
        lifecycle="llama_router",
        loaded={"smol-a"},
        failed={"broken": 1},
        max_loaded=1,
    )
    base_url = await nursery.start(fake.serve)
    stack = await make_stack(
        [
            upstream_provider(
                "router", base_url, type="openai_api", served="smol-a", health_interval_s=0.1
            )
        ]
    )

    catalog = await stack.wait_catalog(lambda c: bool(_held(c, "router")))
    router = provider_of(catalog, "router")
    assert _held(catalog, "router") == {
        "smol-a": "loaded",
        "smol-b": "unloaded",
        "broken": "failed",
    }
    [broken] = [s for s in router["model_states"] if s["name"] == "broken"]
    assert broken["reason"] == "failed to load (exit code 1)"
    assert router["max_loaded"] == 1
    assert router["discovered_lifecycle"] == {
        "list_models": True,
        "load_model": True,
        "unload_model": True,
        "pull_model": False,
        "delete_model": False,
    }

    # The runtime swaps its model (another client asked for smol-b): the next probe says so.
    fake.loaded = {"smol-b"}
    await stack.wait_catalog(lambda c: _held(c, "router").get("smol-b") == "loaded")
    assert _held(await stack.catalog(), "router")["smol-a"] == "unloaded"

    async with stack.admin() as admin:
        metrics = (await admin.get("/metrics")).text
    assert (
        'iop_provider_model_state{provider="router",served_model="smol-b",state="loaded"} 1.0'
        in metrics
    )
    assert (
        'iop_provider_model_state{provider="router",served_model="broken",state="failed"} 1.0'
        in metrics
    )


async def test_a_runtime_that_says_nothing_reports_no_states(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(models=["fake-model"])
    base_url = await nursery.start(fake.serve)
    stack = await make_stack([upstream_provider("plain", base_url)])
    catalog = await stack.catalog()
    assert provider_of(catalog, "plain")["health"] == "available"
    assert provider_of(catalog, "plain")["model_states"] is None


async def test_a_disconnected_node_s_states_are_forgotten(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(models=["fake-model"], lifecycle="ollama", loaded={"fake-model"})
    base_url = await nursery.start(fake.serve)
    stack = await make_stack([upstream_provider("box", base_url, type="ollama")])
    await stack.wait_catalog(lambda c: _held(c, "box") == {"fake-model": "loaded"})
    stack.kill_node()
    catalog = await stack.wait_catalog(lambda c: not provider_of(c, "box")["connected"])
    assert provider_of(catalog, "box")["model_states"] is None
