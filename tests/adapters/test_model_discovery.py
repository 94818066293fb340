"""Each runtime's lifecycle API, as a probe reads it: the served models' load states
(design §18), against a fake upstream speaking that runtime's dialect."""

from __future__ import annotations

import pytest
import trio

from iop_node.adapters.lmstudio import LmStudioAdapter
from iop_node.adapters.ollama import OllamaAdapter
from iop_node.adapters.openai_compat import OpenAICompatAdapter
from iop_node.registry import create_adapter
from schemas.config import AdapterSettings, ProviderConfig, ProviderType
from schemas.wire import ModelState, ProviderStatus
from tests.timing import GUARD_S

from .fake_upstream import FakeUpstream


async def _probe(nursery: trio.Nursery, fake: FakeUpstream, type_: ProviderType) -> ProviderStatus:
    await nursery.start(fake.serve)
    provider = ProviderConfig(
        id="p",
        type=type_,
        models=list(fake.models),
        capacity=1,
        adapter=AdapterSettings(base_url=fake.base_url),
    )
    adapter = create_adapter(provider)
    try:
        with trio.fail_after(GUARD_S):
            return await adapter.probe()
    finally:
        await adapter.aclose()


async def test_a_llama_router_reports_each_model_and_how_many_it_holds(
    nursery: trio.Nursery,
) -> None:
    fake = FakeUpstream(
        models=["smol-a", "smol-b", "broken"],
        lifecycle="llama_router",
        loaded={"smol-a"},
        failed={"broken": 1},
        max_loaded=1,
    )
    status = await _probe(nursery, fake, "openai_api")
    assert status.health == "available"
    assert status.models == ["smol-a", "smol-b", "broken"]
    assert status.model_states == [
        ModelState(name="smol-a", state="loaded"),
        ModelState(name="smol-b", state="unloaded"),
        ModelState(name="broken", state="failed", reason="failed to load (exit code 1)"),
    ]
    assert status.max_loaded == 1
    assert status.lifecycle == ["list_models", "load_model", "unload_model"]


async def test_an_openai_server_reports_no_states(nursery: trio.Nursery) -> None:
    """Rule 1: a runtime that says nothing of load states is not guessed at (and not asked
    more than its listing)."""
    fake = FakeUpstream(models=["m"])
    status = await _probe(nursery, fake, "openai_api")
    assert (status.health, status.model_states, status.max_loaded) == ("available", None, None)
    assert [r.path for r in fake.requests] == ["/v1/models"]


async def test_ollama_reports_the_models_in_memory(nursery: trio.Nursery) -> None:
    fake = FakeUpstream(models=["llama3.2:latest", "qwen3:8b"], lifecycle="ollama")
    fake.loaded = {"qwen3:8b"}
    status = await _probe(nursery, fake, "ollama")
    assert status.model_states == [
        ModelState(name="llama3.2:latest", state="unloaded"),
        ModelState(name="qwen3:8b", state="loaded"),
    ]


async def test_an_ollama_without_ps_is_healthy_and_says_no_states(nursery: trio.Nursery) -> None:
    fake = FakeUpstream(models=["m"])  # no /api/ps: 404
    status = await _probe(nursery, fake, "ollama")
    assert (status.health, status.model_states) == ("available", None)


async def test_lm_studio_reports_loaded_instances(nursery: trio.Nursery) -> None:
    fake = FakeUpstream(models=["qwen/qwen3-4b", "gemma"], lifecycle="lmstudio", loaded={"gemma"})
    status = await _probe(nursery, fake, "lmstudio")
    assert status.models == ["qwen/qwen3-4b", "gemma"]
    assert status.model_states == [
        ModelState(name="qwen/qwen3-4b", state="unloaded"),
        ModelState(name="gemma", state="loaded"),
    ]
    assert status.lifecycle == ["list_models", "load_model", "unload_model"]


async def test_an_lm_studio_before_the_native_api_is_listed_from_v1(
    nursery: trio.Nursery,
) -> None:
    fake = FakeUpstream(models=["m"])
    status = await _probe(nursery, fake, "lmstudio")
    assert (status.health, status.models, status.model_states) == ("available", ["m"], None)


async def test_a_sleeping_vllm_reports_its_models_asleep_then_awake(
    nursery: trio.Nursery,
) -> None:
    fake = FakeUpstream(models=["m"], lifecycle="vllm_sleep", sleeping=True)
    await nursery.start(fake.serve)
    provider = ProviderConfig(
        id="p",
        type="vllm",
        models=["m"],
        capacity=1,
        adapter=AdapterSettings(base_url=fake.base_url),
    )
    adapter = OpenAICompatAdapter(provider)
    try:
        with trio.fail_after(GUARD_S):
            asleep = await adapter.probe()
            fake.sleeping = False
            awake = await adapter.probe()
    finally:
        await adapter.aclose()
    assert asleep.model_states == [ModelState(name="m", state="sleeping")]
    assert awake.model_states == [ModelState(name="m", state="loaded")]


async def test_a_vllm_without_sleep_mode_is_asked_once(nursery: trio.Nursery) -> None:
    fake = FakeUpstream(models=["m"])  # /is_sleeping: 404
    await nursery.start(fake.serve)
    provider = ProviderConfig(
        id="p",
        type="vllm",
        models=["m"],
        capacity=1,
        adapter=AdapterSettings(base_url=fake.base_url),
    )
    adapter = OpenAICompatAdapter(provider)
    try:
        with trio.fail_after(GUARD_S):
            first = await adapter.probe()
            second = await adapter.probe()
    finally:
        await adapter.aclose()
    assert first.model_states is None and second.model_states is None
    assert [r.path for r in fake.requests].count("/is_sleeping") == 1


@pytest.mark.parametrize(
    ("type_", "cls"),
    [("lmstudio", LmStudioAdapter), ("ollama", OllamaAdapter), ("vllm", OpenAICompatAdapter)],
)
def test_each_runtime_type_has_its_adapter(type_: ProviderType, cls: type) -> None:
    provider = ProviderConfig(
        id="p",
        type=type_,
        models=["m"],
        capacity=1,
        adapter=AdapterSettings(base_url="http://127.0.0.1:9/v1"),
    )
    assert type(create_adapter(provider)) is cls
