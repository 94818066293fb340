"""Runtimes' model load states reach the operator (design §18): a Node reads them from the
runtime's lifecycle API and the catalog, `/metrics` and the pool page's data show them per
provider, following the runtime as it loads and unloads."""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
import trio

from schemas.catalog import ModelsReport, ProviderLoadState
from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import Stack
from tests.e2e.upstreams import MakeStack, provider_of, upstream_provider
from tests.timing import GUARD_S


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


# --- the operator's loads and unloads -------------------------------------------------------


async def _two_routers(
    nursery: trio.Nursery, make_stack: MakeStack
) -> tuple[Stack, FakeUpstream, FakeUpstream]:
    """Two llama.cpp routers that hold one model at a time, both serving `a` and `b`."""
    fakes = [
        FakeUpstream(models=["a", "b"], lifecycle="llama_router", max_loaded=1) for _ in range(2)
    ]
    providers = []
    for index, fake in enumerate(fakes):
        base_url = await nursery.start(fake.serve)
        provider = upstream_provider(f"r{index}", base_url, type="openai_api", served="a")
        provider["models"] = ["a", "b"]
        providers.append(provider)
    models = [{"id": m, "providers": {"r0": m, "r1": m}} for m in ("a", "b")]
    stack = await make_stack(providers, models=models)
    await stack.wait_catalog(lambda c: all(_held(c, p) for p in ("r0", "r1")))
    return stack, fakes[0], fakes[1]


async def test_an_operator_loads_a_model_where_there_is_room_and_unloads_it_everywhere(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    stack, first, second = await _two_routers(nursery, make_stack)
    async with stack.admin() as admin:
        loaded = await admin.post("/models/load", json={"model": "a"})
        assert loaded.status_code == 200, loaded.text
        [result] = loaded.json()["results"]
        assert (result["provider"], result["served_model"], result["ok"]) == ("r0", "a", True)
        # The Node probed after the load: the catalog knows before the answer came.
        assert _held(await stack.catalog(), "r0")["a"] == "loaded"

        # r0 holds one model already: b goes to r1, which has room.
        loaded = await admin.post("/models/load", json={"model": "b"})
        assert [r["provider"] for r in loaded.json()["results"]] == ["r1"]
        # A load of a model a provider holds does nothing.
        again = await admin.post("/models/load", json={"model": "a"})
        assert again.json()["outcome"] == "done"
        assert [r.path for r in first.requests].count("/models/load") == 1

        answer = await admin.get("/models")
        listing = answer.json()["models"]
        states = {(p["provider"], m["model"]): p["state"] for m in listing for p in m["providers"]}
        # Every field of a provider's entry is there, and the answer is the schema's record.
        assert all(
            set(p) == set(ProviderLoadState.__struct_fields__) for p in listing[0]["providers"]
        )
        report = msgspec.json.decode(answer.content, type=ModelsReport)
        assert [(m.model, [p.provider for p in m.providers]) for m in report.models] == [
            ("a", ["r0", "r1"]),
            ("b", ["r0", "r1"]),
        ]
        assert {p.max_loaded for m in report.models for p in m.providers} == {1}
        assert states == {
            ("r0", "a"): "loaded",
            ("r0", "b"): "unloaded",
            ("r1", "a"): "unloaded",
            ("r1", "b"): "loaded",
        }

        # An explicit provider: b on r0 too (which evicts a there).
        placed = await admin.post("/models/load", json={"model": "b", "provider": "r0"})
        assert placed.status_code == 200
        unloaded = await admin.post("/models/unload", json={"model": "b"})
        assert sorted(r["provider"] for r in unloaded.json()["results"]) == ["r0", "r1"]
    assert first.loaded == second.loaded == set()

    audit = (stack.config_path.parent / "state-0" / "model-audit.jsonl").read_text().splitlines()
    lines = [json.loads(line) for line in audit]
    assert [(a["action"], a["model"], a["provider"], a["ok"]) for a in lines] == [
        ("load", "a", "r0", True),
        ("load", "b", "r1", True),
        ("load", "b", "r0", True),
        ("unload", "b", "r0", True),
        ("unload", "b", "r1", True),
    ]
    assert {a["source"] for a in lines} == {"admin API"}


async def test_loads_that_cannot_be_done_say_why(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    broken = FakeUpstream(models=["x"], lifecycle="llama_router", failed={"x": 1})
    plain = FakeUpstream(models=["x"])
    providers = []
    for provider_id, fake in (("broken", broken), ("plain", plain)):
        provider = upstream_provider(provider_id, await nursery.start(fake.serve), served="x")
        providers.append(provider)
    models = [{"id": "x", "providers": {"broken": "x", "plain": "x"}}]
    stack = await make_stack(providers, models=models)
    await stack.wait_catalog(lambda c: bool(_held(c, "broken")))
    async with stack.admin() as admin:
        unknown = await admin.post("/models/load", json={"model": "nope"})
        assert (unknown.status_code, unknown.json()["error"]) == (404, "no model 'nope'")
        stranger = await admin.post("/models/load", json={"model": "x", "provider": "r9"})
        assert stranger.status_code == 404
        nowhere = await admin.post("/models/load", json={"model": "x"})
        assert nowhere.status_code == 409
        assert nowhere.json()["error"] == (
            "no provider can load 'x': broken: x failed to load there; "
            "plain: its runtime does not load models on request"
        )
        named = await admin.post("/models/load", json={"model": "x", "provider": "plain"})
        assert named.status_code == 409
        assert named.json()["error"].endswith("plain: its runtime does not load models on request")
        # A runtime that reports no load states: its entry says null, not a guess.
        listing = msgspec.json.decode((await admin.get("/models")).content, type=ModelsReport)
        [model] = listing.models
        plain_entry = next(p for p in model.providers if p.provider == "plain")
        assert (plain_entry.served_model, plain_entry.state, plain_entry.reason) == (
            "x",
            None,
            None,
        )
        bad = await admin.post("/models/load", content=b'{"modle": "x"}')
        assert bad.status_code == 400
        assert "modle" in bad.json()["error"]["message"]


async def test_the_command_line_lists_loads_and_unloads(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    stack, _, _ = await _two_routers(nursery, make_stack)
    admin = stack.admin_flags

    async def cli(*args: str) -> tuple[int, str]:
        command = [sys.executable, "-m", "iop_edge", "models", *args, *admin]
        with trio.fail_after(GUARD_S):
            done = await trio.run_process(command, capture_stdout=True, check=False)
        return done.returncode, done.stdout.decode()

    assert await cli("load", "a") == (0, "load of a on r0 (a): done\n")
    status, listed = await cli()
    assert status == 0
    rows = [line for line in listed.splitlines() if " r0 " in line or " r1 " in line]
    assert len(rows) == 4
    assert sum(" loaded " in row for row in rows) == 1
    assert await cli("load", "nope") == (1, "load of nope: no model 'nope'\n")


# --- placement: runs go where their model is held ----------------------------------------


async def test_a_mix_of_two_models_over_two_routers_that_hold_one_each_loads_each_once(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """Without placement, turns of two models alternating over two providers that each
    hold one model make them load on nearly every request; with it, each model is loaded
    once, on its own provider, and stays there (design §18.4)."""
    stack, first, second = await _two_routers(nursery, make_stack)
    served: dict[str, set[str]] = {"a": set(), "b": set()}
    async with stack.client() as client:
        for model in "aabbababbaab" * 2:
            with trio.fail_after(GUARD_S):
                reply = await client.chat.completions.with_raw_response.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            served[model].add(reply.headers["x-iop-provider"])
    assert first.loads + second.loads == 2
    assert len(served["a"]) == len(served["b"]) == 1
    assert served["a"] != served["b"]


async def test_a_model_that_failed_to_load_on_one_router_is_served_by_the_other(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    broken = FakeUpstream(models=["a"], lifecycle="llama_router", failed={"a": 1})
    working = FakeUpstream(models=["a"], lifecycle="llama_router")
    providers = []
    for provider_id, fake in (("broken", broken), ("working", working)):
        provider = upstream_provider(
            provider_id, await nursery.start(fake.serve), type="openai_api", served="a"
        )
        providers.append(provider)
    stack = await make_stack(
        providers, models=[{"id": "a", "providers": {"broken": "a", "working": "a"}}]
    )
    await stack.wait_catalog(lambda c: bool(_held(c, "broken")) and bool(_held(c, "working")))
    async with stack.client() as client:
        for _ in range(4):
            with trio.fail_after(GUARD_S):
                reply = await client.chat.completions.with_raw_response.create(
                    model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            assert reply.headers["x-iop-provider"] == "working"
    assert broken.requests_total == 0
