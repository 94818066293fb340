"""Reading each runtime's answer about its models' load states (`adapters.model_states`)."""

from __future__ import annotations

import json

from iop_node.adapters.model_states import (
    LLAMA_LISTING_DECODER,
    from_llama_listing,
    from_lmstudio,
    from_ollama,
    from_vllm_sleep,
    llama_router_max_loaded,
)
from schemas.wire import ModelState


def _listing(*entries: dict[str, object]) -> bytes:
    return json.dumps({"object": "list", "data": list(entries)}).encode()


def test_a_llama_router_listing_gives_each_model_its_state() -> None:
    body = _listing(
        {"id": "a", "status": {"value": "loaded", "args": ["llama-server"]}},
        {"id": "b", "status": {"value": "loading"}},
        {"id": "c", "status": {"value": "unloaded"}},
        {"id": "d", "status": {"value": "sleeping"}},
    )
    assert from_llama_listing(LLAMA_LISTING_DECODER.decode(body)) == [
        ModelState(name="a", state="loaded"),
        ModelState(name="b", state="loading"),
        ModelState(name="c", state="unloaded"),
        ModelState(name="d", state="sleeping"),
    ]


def test_a_model_that_failed_to_start_is_failed_with_the_exit_code() -> None:
    body = _listing(
        {"id": "broken", "status": {"value": "unloaded", "failed": True, "exit_code": 1}}
    )
    assert from_llama_listing(LLAMA_LISTING_DECODER.decode(body)) == [
        ModelState(name="broken", state="failed", reason="failed to load (exit code 1)")
    ]


def test_a_listing_without_status_says_nothing_of_states() -> None:
    """A server of one model (or any OpenAI API) lists no status: rule 1, not guessed."""
    body = _listing({"id": "m", "object": "model", "owned_by": "llamacpp"})
    assert from_llama_listing(LLAMA_LISTING_DECODER.decode(body)) is None


def test_an_unknown_status_value_is_unloaded_and_named() -> None:
    body = _listing({"id": "m", "status": {"value": "downloading"}})
    [state] = from_llama_listing(LLAMA_LISTING_DECODER.decode(body)) or []
    assert state == ModelState(
        name="m", state="unloaded", reason="the runtime reports 'downloading'"
    )


def test_a_name_listed_twice_keeps_its_first_state() -> None:
    body = _listing(
        {"id": "m", "status": {"value": "loaded"}}, {"id": "m", "status": {"value": "unloaded"}}
    )
    assert from_llama_listing(LLAMA_LISTING_DECODER.decode(body)) == [
        ModelState(name="m", state="loaded")
    ]


def test_the_router_props_say_how_many_models_it_holds() -> None:
    assert llama_router_max_loaded(b'{"role": "router", "max_instances": 2}') == 2
    assert llama_router_max_loaded(b'{"role": "router", "max_instances": 0}') is None
    assert llama_router_max_loaded(b'{"default_generation_settings": {"n_ctx": 4096}}') is None
    assert llama_router_max_loaded(b"not json") is None


def test_ollama_models_in_memory_are_loaded_the_rest_unloaded() -> None:
    ps = b'{"models": [{"name": "qwen3:8b", "size_vram": 1}, {"name": "gone:latest"}]}'
    assert from_ollama(["llama3.2:latest", "qwen3:8b"], ps) == [
        ModelState(name="llama3.2:latest", state="unloaded"),
        ModelState(name="qwen3:8b", state="loaded"),
        ModelState(name="gone:latest", state="loaded"),
    ]
    assert from_ollama(["m"], b'{"models": null}') == [ModelState(name="m", state="unloaded")]
    assert from_ollama(["m"], b"<html>") is None


def test_lm_studio_models_with_an_instance_are_loaded() -> None:
    body = json.dumps(
        {
            "models": [
                {"type": "llm", "key": "qwen/qwen3-4b", "loaded_instances": [{"id": "q"}]},
                {"type": "llm", "key": "google/gemma-3-4b", "loaded_instances": []},
                {"type": "embedding", "key": "nomic-embed", "loaded_instances": [{"id": "n"}]},
            ]
        }
    ).encode()
    assert from_lmstudio(body) == [
        ModelState(name="qwen/qwen3-4b", state="loaded"),
        ModelState(name="google/gemma-3-4b", state="unloaded"),
    ]
    assert from_lmstudio(b'{"data": []}') is None


def test_a_sleeping_vllm_holds_its_models_asleep() -> None:
    assert from_vllm_sleep(["m"], b'{"is_sleeping": true}') == [
        ModelState(name="m", state="sleeping")
    ]
    assert from_vllm_sleep(["m"], b'{"is_sleeping": false}') == [
        ModelState(name="m", state="loaded")
    ]
    assert from_vllm_sleep(["m"], b"{}") is None
