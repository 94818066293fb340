"""The models' lifecycle policy end to end (design §18.4): idle unloads kept by the Node,
pins that placement never evicts and that are loaded again, preloads at start, a refresh
that changes the policy live, and the operator's `iop-edge models pin`."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import trio
import yaml

from iop_edge.core.routing.affinity import placement_key, rendezvous_order
from iop_node.main import run_node
from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import NODE_TOKEN, Stack, edge_config
from tests.e2e.test_several_edges import _serve_edge
from tests.e2e.upstreams import MakeStack, provider_of, upstream_provider
from tests.timing import GUARD_S


def _held(catalog: dict[str, Any], provider_id: str) -> dict[str, str]:
    states = provider_of(catalog, provider_id).get("model_states") or []
    return {state["name"]: state["state"] for state in states}


async def _routers(
    nursery: trio.Nursery,
    make_stack: MakeStack,
    count: int,
    models: list[dict[str, Any]],
    **fake: Any,
) -> tuple[Stack, list[FakeUpstream]]:
    """`count` llama.cpp routers that hold one model at a time, each serving every model."""
    names = [model["id"] for model in models]
    fakes = [
        FakeUpstream(models=names, lifecycle="llama_router", max_loaded=1, **fake)
        for _ in range(count)
    ]
    providers = []
    for index, upstream in enumerate(fakes):
        base_url = await nursery.start(upstream.serve)
        provider = upstream_provider(
            f"r{index}", base_url, type="openai_api", served=names[0], health_interval_s=0.2
        )
        provider["models"] = names
        providers.append(provider)
    ids = [f"r{index}" for index in range(count)]
    for model in models:
        model["providers"] = {provider_id: model["id"] for provider_id in ids}
    stack = await make_stack(providers, models=models)
    await stack.wait_catalog(lambda c: all(_held(c, p) for p in ids))
    return stack, fakes


def _loads_asked(fake: FakeUpstream) -> int:
    return [request.path for request in fake.requests].count("/models/load")


def _audit(stack: Stack) -> list[dict[str, Any]]:
    path = stack.config_path.parent / "state-0" / "model-audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_preload_loads_the_model_at_start_on_its_rendezvous_providers(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    stack, fakes = await _routers(
        nursery, make_stack, 3, [{"id": "warm", "lifecycle": {"preload": 2}}]
    )
    expected = sorted(rendezvous_order(placement_key("warm"), ["r0", "r1", "r2"])[:2])
    catalog = await stack.wait_catalog(
        lambda c: sum(_held(c, p).get("warm") == "loaded" for p in ("r0", "r1", "r2")) == 2
    )
    loaded = sorted(p for p in ("r0", "r1", "r2") if _held(catalog, p)["warm"] == "loaded")
    assert loaded == expected  # every Edge sharing these Nodes picks the same two
    assert sum("warm" in fake.loaded for fake in fakes) == 2
    assert [_loads_asked(fake) for fake in fakes] == [
        int(f"r{index}" in expected) for index in range(3)
    ]


async def test_a_pinned_model_survives_the_pressure_that_moves_the_others_around(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    models = [{"id": "kept", "lifecycle": {"keep_loaded": True}}, {"id": "b"}, {"id": "c"}]
    stack, fakes = await _routers(nursery, make_stack, 2, models)
    [home] = rendezvous_order(placement_key("kept"), ["r0", "r1"])[:1]
    other = "r1" if home == "r0" else "r0"
    await stack.wait_catalog(lambda c: _held(c, home).get("kept") == "loaded")
    served: set[str] = set()
    async with stack.client() as client:
        for model in "bcbccbbc":
            with trio.fail_after(GUARD_S):
                reply = await client.chat.completions.with_raw_response.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            served.add(reply.headers["x-iop-provider"])
    # b and c took turns on the other router; the pinned copy was never evicted for them
    assert served == {other}
    home_fake = fakes[int(home[1])]
    assert home_fake.loaded == {"kept"}
    assert home_fake.loads == 0  # no run of b or c ever made it load

    # The runtime drops the pinned model by itself: it is loaded again.
    home_fake.loaded = set()
    await stack.wait_catalog(
        lambda c: (
            _loads_asked(home_fake) == 2
            and home_fake.loaded == {"kept"}
            and _held(c, home)["kept"] == "loaded"
        )
    )
    assert _loads_asked(fakes[int(other[1])]) == 0


async def test_a_refresh_that_sets_idle_unload_s_unloads_the_idle_model_live(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    stack, fakes = await _routers(nursery, make_stack, 1, [{"id": "a"}], loaded={"a"})
    await stack.wait_catalog(lambda c: _held(c, "r0").get("a") == "loaded")
    candidate = yaml.safe_load(stack.config_path.read_text())
    candidate["models"][0]["lifecycle"] = {"idle_unload_s": 0.2}
    async with stack.admin() as admin:
        response = await admin.post(
            "/refresh", json={"mode": "apply", "config_yaml": yaml.safe_dump(candidate)}
        )
    assert response.status_code == 200, response.text
    assert response.json()["nodes"][0]["status"] == "applied"
    await stack.wait_catalog(lambda c: _held(c, "r0").get("a") == "unloaded")
    assert fakes[0].loaded == set()
    assert [r.path for r in fakes[0].requests].count("/models/unload") == 1


async def test_the_operator_pins_and_unpins_a_model_from_the_command_line(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    stack, fakes = await _routers(nursery, make_stack, 2, [{"id": "a"}, {"id": "b"}])
    admin = stack.admin_flags

    async def cli(*args: str) -> tuple[int, str]:
        command = [sys.executable, "-m", "iop_edge", "models", *args, *admin]
        with trio.fail_after(GUARD_S):
            done = await trio.run_process(command, capture_stdout=True, check=False)
        return done.returncode, done.stdout.decode()

    assert await cli("pin", "a", "--provider", "r1") == (0, "pin of a on r1 (a): done\n")
    assert _held(await stack.catalog(), "r1")["a"] == "loaded"
    assert provider_of(await stack.catalog(), "r1")["pinned"] == ["a"]
    status, listed = await cli()
    assert status == 0
    [row] = [line for line in listed.splitlines() if " r1 " in line and "│ a " in line]
    assert "loaded, pinned" in row
    # placement will not evict it there: b's run goes to r0
    async with stack.client() as client:
        with trio.fail_after(GUARD_S):
            reply = await client.chat.completions.with_raw_response.create(
                model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    assert reply.headers["x-iop-provider"] == "r0"
    # nor will an unload: the pin would load it back at once
    status, said = await cli("unload", "a")
    assert status == 1 and "unload of a on r1 (a): pinned here: `iop-edge models unpin a`" in said
    assert fakes[1].loaded == {"a"}
    assert await cli("unpin", "a") == (0, "unpin of a on r1 (a): done\n")
    status, said = await cli("unpin", "a")
    assert status == 1
    assert "'a' has no pin set by the operator" in said
    assert fakes[1].loaded == {"a"}  # an unpin unloads nothing
    assert provider_of(await stack.catalog(), "r1")["pinned"] == []
    lines = [(a["action"], a["model"], a["provider"], a["ok"], a["source"]) for a in _audit(stack)]
    assert lines == [("pin", "a", "r1", True, "admin API"), ("unpin", "a", "r1", True, "admin API")]


async def test_a_run_no_runtime_could_load_says_why_when_its_wait_ends(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """The one router holds one model, pinned: a run of another model waits (a pin may be
    lifted), and its 503 names the pin, not just an empty queue."""
    models = [{"id": "a"}, {"id": "b", "queue": {"queue_timeout_ms": 300}}]
    stack, fakes = await _routers(nursery, make_stack, 1, models)
    async with stack.admin() as admin:
        pinned = await admin.post("/models/pin", json={"model": "a", "provider": "r0"})
    assert pinned.status_code == 200, pinned.text
    async with stack.http() as http:
        body = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with trio.fail_after(GUARD_S):
            refused = await http.post("/v1/chat/completions", json=body)
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "queue_timeout"
    assert (
        "no provider holds it or could load it: r0: it holds 1 model(s), all pinned (a)"
        in (error["message"])
    )
    assert fakes[0].loaded == {"a"}


async def test_a_run_wakes_a_sleeping_vllm_rather_than_cold_load_elsewhere(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    router = FakeUpstream(models=["m"], lifecycle="llama_router", max_loaded=1)
    vllm = FakeUpstream(models=["m"], lifecycle="vllm_sleep", sleeping=True)
    providers = [
        upstream_provider(
            "router", await nursery.start(router.serve), type="openai_api", served="m"
        ),
        upstream_provider("vllm", await nursery.start(vllm.serve), type="vllm", served="m"),
    ]
    # the model's rendezvous choice is the router: the wake-up wins over it
    assert rendezvous_order(placement_key("big"), ["router", "vllm"])[0] == "router"
    stack = await make_stack(
        providers, models=[{"id": "big", "providers": {"router": "m", "vllm": "m"}}]
    )
    await stack.wait_catalog(
        lambda c: _held(c, "vllm") == {"m": "sleeping"} and _held(c, "router") == {"m": "unloaded"}
    )
    async with stack.client() as client:
        for _ in range(3):
            with trio.fail_after(GUARD_S):
                reply = await client.chat.completions.with_raw_response.create(
                    model="big", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            assert reply.headers["x-iop-provider"] == "vllm"
    posts = [r.path for r in vllm.requests if r.method == "POST"]
    assert posts == ["/wake_up", *["/v1/chat/completions"] * 3]
    assert router.loads == 0
    assert not vllm.sleeping


async def test_callers_and_browser_pages_cannot_pin(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    stack, fakes = await _routers(nursery, make_stack, 1, [{"id": "a"}])
    body = {"model": "a"}
    async with stack.admin() as admin:
        for headers in ({"Origin": "http://127.0.0.1:8080"}, {"Sec-Fetch-Site": "cross-site"}):
            refused = await admin.post("/models/pin", json=body, headers=headers)
            assert refused.status_code == 403, headers
    async with stack.http() as http:  # the callers' port has no such route
        assert (await http.post("/models/pin", json=body)).status_code == 404
    assert _loads_asked(fakes[0]) == 0
    assert not (stack.config_path.parent / "state-0" / "model-audit.jsonl").exists()


async def test_two_edges_sharing_a_node_pin_the_same_copy(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Nothing shared but the config and the Node: both Edges pin the model on the same
    provider, and only there is it ever loaded."""
    fakes = [
        FakeUpstream(models=["kept", "b"], lifecycle="llama_router", max_loaded=1) for _ in range(3)
    ]
    providers = []
    for index, fake in enumerate(fakes):
        provider = upstream_provider(
            f"r{index}", await nursery.start(fake.serve), type="openai_api", served="kept"
        )
        provider["models"] = ["kept", "b"]
        providers.append(provider)
    ids = [provider["id"] for provider in providers]
    models = [
        {"id": "kept", "providers": dict.fromkeys(ids, "kept"), "lifecycle": {"keep_loaded": True}},
        {"id": "b", "providers": dict.fromkeys(ids, "b")},
    ]
    stacks = []
    for name in ("a", "b"):
        text = edge_config(tmp_path / name, providers=providers, models=models)
        stacks.append(
            await _serve_edge(nursery, text, tmp_path / f"{name}.yaml", trio.CancelScope())
        )
    urls = [stack.addresses.node_url for stack in stacks]
    await nursery.start(partial(run_node, urls, "node-1", NODE_TOKEN))
    [home] = rendezvous_order(placement_key("kept"), ids)[:1]
    for stack in stacks:
        await stack.wait_catalog(lambda c: _held(c, home).get("kept") == "loaded")
    assert [fake.loaded for fake in fakes] == [
        {"kept"} if f"r{index}" == home else set() for index in range(3)
    ]
    assert [_loads_asked(fake) > 0 for fake in fakes] == [f"r{i}" == home for i in range(3)]
    for stack in stacks:  # each Edge counts it pinned: placement does not evict it for b
        async with stack.client() as client:
            with trio.fail_after(GUARD_S):
                reply = await client.chat.completions.with_raw_response.create(
                    model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
        assert reply.headers["x-iop-provider"] != home
    assert fakes[ids.index(home)].loaded == {"kept"}


async def test_a_runtime_that_holds_all_it_can_keeps_its_pin_while_others_take_turns(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """One router that holds two models, one of them pinned: the router would unload its
    least recently used one (the pin) to load another; its Node unloads the other first."""
    models = [{"id": "kept", "lifecycle": {"keep_loaded": True}}, {"id": "b"}, {"id": "c"}]
    stack, [router] = await _routers(nursery, make_stack, 1, models)
    router.max_loaded = 2
    await stack.wait_catalog(
        lambda c: _held(c, "r0").get("kept") == "loaded" and provider_of(c, "r0")["max_loaded"] == 2
    )
    async with stack.client() as client:
        for model in "bcbcbc":
            with trio.fail_after(GUARD_S):
                await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            assert "kept" in router.loaded, model
    assert _loads_asked(router) == 1  # the pin's own load, never again
    unloads = [json.loads(r.body)["model"] for r in router.requests if r.path == "/models/unload"]
    assert unloads and "kept" not in unloads


async def test_an_operator_s_pin_on_one_edge_is_kept_by_every_edge_sharing_the_node(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The Node marks the pin in its statuses: the other Edge's runs of other models never
    evict it, and its catalog lists it, until the operator unpins it."""
    fakes = [
        FakeUpstream(models=["a", "b", "c"], lifecycle="llama_router", max_loaded=1)
        for _ in range(2)
    ]
    providers = []
    for index, fake in enumerate(fakes):
        provider = upstream_provider(
            f"r{index}", await nursery.start(fake.serve), type="openai_api", served="a"
        )
        provider["models"] = ["a", "b", "c"]
        providers.append(provider)
    models = [{"id": m, "providers": {"r0": m, "r1": m}} for m in "abc"]
    pinning, other = [
        await _serve_edge(
            nursery,
            edge_config(tmp_path / name, providers=providers, models=models),
            tmp_path / f"{name}.yaml",
            trio.CancelScope(),
        )
        for name in ("a", "b")
    ]
    urls = [pinning.addresses.node_url, other.addresses.node_url]
    await nursery.start(partial(run_node, urls, "node-1", NODE_TOKEN))
    for stack in (pinning, other):
        await stack.wait_catalog(lambda c: all(_held(c, p) for p in ("r0", "r1")))
    async with pinning.admin() as admin:
        pinned = await admin.post("/models/pin", json={"model": "a", "provider": "r1"})
    assert pinned.status_code == 200, pinned.text
    await other.wait_catalog(lambda c: provider_of(c, "r1")["pinned"] == ["a"])

    served: set[str] = set()
    async with other.client() as client:
        for model in "bcbccbbc":
            with trio.fail_after(GUARD_S):
                reply = await client.chat.completions.with_raw_response.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            served.add(reply.headers["x-iop-provider"])
    assert served == {"r0"}  # b and c took turns there; the pin on r1 was never evicted
    assert fakes[1].loaded == {"a"} and _loads_asked(fakes[1]) == 1

    async with pinning.admin() as admin:
        unpinned = await admin.post("/models/unpin", json={"model": "a"})
    assert unpinned.status_code == 200, unpinned.text
    await other.wait_catalog(lambda c: provider_of(c, "r1")["pinned"] == [])
