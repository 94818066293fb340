"""Each runtime's lifecycle API, as a probe reads it: the served models' load states
(design §18), against a fake upstream speaking that runtime's dialect."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from iop_node.adapters import runtime_lifecycle
from iop_node.adapters.base import AdapterError, ModelCommandFailed
from iop_node.adapters.lmstudio import LmStudioAdapter
from iop_node.adapters.ollama import OllamaAdapter
from iop_node.adapters.openai_compat import OpenAICompatAdapter
from iop_node.registry import create_adapter
from schemas.config import AdapterSettings, ProviderConfig, ProviderType
from schemas.wire import FailureCode, ModelState, ProviderStatus, Run
from tests.timing import GUARD_S

from .fake_upstream import FakeUpstream


async def _probe(nursery: trio.Nursery, fake: FakeUpstream, type_: ProviderType) -> ProviderStatus:
    adapter = await _adapter(nursery, fake, type_)
    with trio.fail_after(GUARD_S):
        status: ProviderStatus = await adapter.probe()
    return status


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
    adapter = await _adapter(nursery, fake, "vllm")
    with trio.fail_after(GUARD_S):
        asleep = await adapter.probe()
        fake.sleeping = False
        awake = await adapter.probe()
    assert asleep.model_states == [ModelState(name="m", state="sleeping")]
    assert awake.model_states == [ModelState(name="m", state="loaded")]


async def test_a_vllm_without_sleep_mode_is_asked_once(nursery: trio.Nursery) -> None:
    fake = FakeUpstream(models=["m"])  # /is_sleeping: 404
    adapter = await _adapter(nursery, fake, "vllm")
    with trio.fail_after(GUARD_S):
        first = await adapter.probe()
        second = await adapter.probe()
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


# --- loads and unloads ------------------------------------------------------------------------


async def _adapter(nursery: trio.Nursery, fake: FakeUpstream, type_: ProviderType) -> Any:
    """An adapter of `type_` in front of `fake` (started), closed when the test ends."""
    await nursery.start(fake.serve)
    provider = ProviderConfig(
        id="p",
        type=type_,
        models=list(fake.models),
        capacity=1,
        adapter=AdapterSettings(base_url=fake.base_url),
    )
    adapter = create_adapter(provider)
    nursery.start_soon(_closed_at_exit, adapter)
    return adapter


async def _commanded(nursery: trio.Nursery, fake: FakeUpstream, type_: ProviderType) -> Any:
    """`_adapter`, probed once: what the runtime is, learnt as the health monitor would."""
    adapter = await _adapter(nursery, fake, type_)
    with trio.fail_after(GUARD_S):
        await adapter.probe()
    return adapter


async def _closed_at_exit(adapter: Any) -> None:
    try:
        await trio.sleep_forever()
    finally:
        with trio.move_on_after(GUARD_S, shield=True):
            await adapter.aclose()


def _held(status: ProviderStatus) -> dict[str, str]:
    return {state.name: state.state for state in status.model_states or ()}


async def test_a_llama_router_loads_and_waits_until_the_model_answers(
    nursery: trio.Nursery,
) -> None:
    fake = FakeUpstream(models=["a", "b"], lifecycle="llama_router", loaded={"a"}, max_loaded=1)
    fake.load_order = ["a"]
    adapter = await _commanded(nursery, fake, "openai_api")
    with trio.fail_after(GUARD_S):
        await adapter.load_model("b")
        assert _held(await adapter.probe()) == {"a": "unloaded", "b": "loaded"}
        await adapter.load_model("b")  # already running: done at once
        await adapter.unload_model("b")
        await adapter.unload_model("b")  # not running: done
        assert _held(await adapter.probe()) == {"a": "unloaded", "b": "unloaded"}
    loads = [r for r in fake.requests if r.path == "/models/load"]
    assert [json.loads(r.body) for r in loads] == [{"model": "b"}, {"model": "b"}]


async def test_a_model_that_fails_to_load_fails_the_command_with_the_reason(
    nursery: trio.Nursery,
) -> None:
    fake = FakeUpstream(models=["broken"], lifecycle="llama_router", failed={"broken": 1})
    adapter = await _commanded(nursery, fake, "openai_api")
    with trio.fail_after(GUARD_S), pytest.raises(ModelCommandFailed) as failed:
        await adapter.load_model("broken")
    assert str(failed.value) == "broken failed to load (exit code 1)"


async def test_a_load_outlives_a_listing_the_runtime_drops_and_fails_when_it_stays_silent(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look at the router's listing while a model loads that gets no answer (a dropped
    keep-alive connection) is taken again; a runtime that answers none of
    `LOOKS_UNANSWERED` in a row fails the command, saying why, instead of raising."""
    monkeypatch.setattr(runtime_lifecycle, "LOAD_POLL_S", 0.01)
    fake = FakeUpstream(models=["a", "b"], lifecycle="llama_router", loaded={"a"})
    adapter = await _commanded(nursery, fake, "openai_api")
    fake.listings_dropped = runtime_lifecycle.LOOKS_UNANSWERED - 1
    with trio.fail_after(GUARD_S):
        await adapter.load_model("b")
    assert fake.loaded == {"a", "b"}
    assert fake.dropped == runtime_lifecycle.LOOKS_UNANSWERED - 1

    with trio.fail_after(GUARD_S):
        await adapter.unload_model("b")
    fake.listings_dropped = runtime_lifecycle.LOOKS_UNANSWERED
    with trio.fail_after(GUARD_S), pytest.raises(ModelCommandFailed) as failed:
        await adapter.load_model("b")
    assert str(failed.value).startswith(
        f"{runtime_lifecycle.LOOKS_UNANSWERED} looks at the runtime's listing found no load "
        "of b under way (the last: GET "
    )
    assert "Server disconnected" in str(failed.value)


async def test_a_load_is_over_when_the_runtime_let_the_model_go_and_failed_if_never_begun(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model listed `loading`, then `unloaded` (evicted between two looks) was loaded:
    the load is done, not waited on until its bound. One listed `unloaded` with no load
    ever seen under way fails the command after `LOOKS_UNANSWERED` looks."""
    monkeypatch.setattr(runtime_lifecycle, "LOAD_POLL_S", 0.01)
    fake = FakeUpstream(models=["a", "b"], lifecycle="llama_router", loaded={"a"})
    adapter = await _commanded(nursery, fake, "openai_api")
    fake.loads_evicted = True
    with trio.fail_after(GUARD_S):
        await adapter.load_model("b")
    assert fake.loaded == {"a"}

    fake.loads_evicted, fake.loads_ignored = False, True
    with trio.fail_after(GUARD_S), pytest.raises(ModelCommandFailed) as failed:
        await adapter.load_model("b")
    assert str(failed.value) == (
        f"{runtime_lifecycle.LOOKS_UNANSWERED} looks at the runtime's listing found no load "
        "of b under way (the last: the runtime lists b unloaded, not loading)"
    )


async def test_a_runtime_refusal_is_the_command_s_error(nursery: trio.Nursery) -> None:
    fake = FakeUpstream(models=["a"], lifecycle="llama_router")
    adapter = await _commanded(nursery, fake, "openai_api")
    with trio.fail_after(GUARD_S), pytest.raises(ModelCommandFailed) as failed:
        await adapter.load_model("nope")
    assert str(failed.value) == "POST /models/load returned 404: File Not Found"


async def test_ollama_loads_with_the_edge_owning_keep_alive(nursery: trio.Nursery) -> None:
    fake = FakeUpstream(models=["m1", "m2"], lifecycle="ollama")
    adapter = await _commanded(nursery, fake, "ollama")
    with trio.fail_after(GUARD_S):
        await adapter.load_model("m2")
        assert _held(await adapter.probe()) == {"m1": "unloaded", "m2": "loaded"}
        await adapter.unload_model("m2")
        assert _held(await adapter.probe()) == {"m1": "unloaded", "m2": "unloaded"}
    generate = [json.loads(r.body) for r in fake.requests if r.path == "/api/generate"]
    assert [g["keep_alive"] for g in generate] == [-1, 0]


async def test_lm_studio_loads_once_and_unloads_every_instance(nursery: trio.Nursery) -> None:
    fake = FakeUpstream(models=["q"], lifecycle="lmstudio")
    adapter = await _commanded(nursery, fake, "lmstudio")
    with trio.fail_after(GUARD_S):
        await adapter.load_model("q")
        await adapter.load_model("q")  # a second load would make a second instance
        assert _held(await adapter.probe()) == {"q": "loaded"}
        await adapter.unload_model("q")
        assert _held(await adapter.probe()) == {"q": "unloaded"}
    assert [r.path for r in fake.requests if r.method == "POST"] == [
        "/api/v1/models/load",
        "/api/v1/models/unload",
    ]


async def test_a_vllm_in_sleep_mode_wakes_for_a_load_and_sleeps_for_an_unload(
    nursery: trio.Nursery,
) -> None:
    fake = FakeUpstream(models=["m"], lifecycle="vllm_sleep", sleeping=True)
    adapter = await _commanded(nursery, fake, "vllm")
    with trio.fail_after(GUARD_S):
        await adapter.load_model("m")
        assert _held(await adapter.probe()) == {"m": "loaded"}
        await adapter.unload_model("m")
        assert _held(await adapter.probe()) == {"m": "sleeping"}


async def test_a_runtime_without_a_lifecycle_api_refuses_commands(nursery: trio.Nursery) -> None:
    fake = FakeUpstream(models=["m"])
    adapter = await _commanded(nursery, fake, "openai_api")
    with pytest.raises(ModelCommandFailed, match="does not load models on request"):
        await adapter.load_model("m")


async def test_a_run_that_finds_a_vllm_asleep_wakes_it_first_once_for_all(
    nursery: trio.Nursery,
) -> None:
    fake = FakeUpstream(models=["m"], lifecycle="vllm_sleep", sleeping=True)
    adapter = await _commanded(nursery, fake, "vllm")
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'

    async def run(run_id: str) -> None:
        async def emit(data: bytes, parsed: object = None, /) -> None:
            pass

        await adapter.execute(
            Run(run_id=run_id, provider_id="p", target="m", operation="chat", body=body), emit
        )

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as runs:
            runs.start_soon(run, "r1")
            runs.start_soon(run, "r2")
        status = await adapter.probe()
    paths = [r.path for r in fake.requests if r.method == "POST"]
    assert paths == ["/wake_up", "/v1/chat/completions", "/v1/chat/completions"]
    assert _held(status) == {"m": "loaded"}
    assert status.lifecycle == ["list_models", "load_model", "unload_model"]


async def test_a_vllm_that_does_not_wake_fails_the_run_as_the_provider_s(
    nursery: trio.Nursery,
) -> None:
    fake = FakeUpstream(models=["m"], lifecycle="vllm_sleep", sleeping=True)
    adapter = await _commanded(nursery, fake, "vllm")
    fake.lifecycle = None  # /wake_up now answers 404
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'

    async def emit(data: bytes, parsed: object = None, /) -> None:
        pass

    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as failed:
        await adapter.execute(
            Run(run_id="r", provider_id="p", target="m", operation="chat", body=body), emit
        )
    assert failed.value.code == FailureCode.UPSTREAM_UNREACHABLE
    assert failed.value.retryable
    assert str(failed.value).startswith("the runtime did not wake: POST /wake_up returned 404")
    assert "/v1/chat/completions" not in [r.path for r in fake.requests]
