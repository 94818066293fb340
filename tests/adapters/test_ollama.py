"""OllamaAdapter: runs through the OpenAI-compatible /v1 API, health through /api/tags."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import trio

from iop_node.adapters.ollama import OllamaAdapter, lifecycle_of, native_root, without_keep_alive
from iop_node.reply import ParsedChunk
from schemas.config import AdapterSettings, ProviderConfig
from schemas.wire import Run
from tests.timing import GUARD_S

from .fake_upstream import FakeUpstream, expected_events

MODEL = "llama3.2:latest"


def provider(base_url: str) -> ProviderConfig:
    return ProviderConfig(
        id="gpu2-ollama",
        type="ollama",
        models=[MODEL],
        capacity=2,
        adapter=AdapterSettings(base_url=base_url),
    )


@pytest.fixture
async def upstream(nursery: trio.Nursery) -> FakeUpstream:
    fake = FakeUpstream(models=[MODEL, "nomic-embed-text:latest"], version="0.6.2")
    await nursery.start(fake.serve)
    return fake


@pytest.fixture
async def adapter(upstream: FakeUpstream) -> AsyncIterator[OllamaAdapter]:
    adapter = OllamaAdapter(provider(upstream.base_url))
    yield adapter
    await adapter.aclose()


async def test_probe_uses_the_native_api(upstream: FakeUpstream, adapter: OllamaAdapter) -> None:
    with trio.fail_after(GUARD_S):
        status = await adapter.probe()
    assert status.health == "available"
    assert status.models == [MODEL, "nomic-embed-text:latest"]
    assert status.detail == "ollama 0.6.2"
    assert status.lifecycle == [
        "list_models",
        "load_model",
        "unload_model",
        "pull_model",
        "delete_model",
    ]
    assert [r.path for r in upstream.requests] == ["/api/tags", "/api/version", "/api/ps"]


async def test_probe_unavailable_when_down() -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    adapter = OllamaAdapter(provider(f"http://127.0.0.1:{port}/v1"))
    try:
        with trio.fail_after(GUARD_S):
            status = await adapter.probe()
    finally:
        await adapter.aclose()
    assert status.health == "unavailable"
    assert status.models == []


async def test_stream_runs_through_the_openai_endpoint(
    upstream: FakeUpstream, adapter: OllamaAdapter
) -> None:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    run = Run(
        run_id="run-7",
        provider_id="gpu2-ollama",
        target=MODEL,
        operation="chat",
        body=json.dumps(body).encode(),
        stream=True,
    )
    chunks: list[bytes] = []

    async def emit(data: bytes, parsed: ParsedChunk | None = None, /) -> None:
        chunks.append(data)

    with trio.fail_after(GUARD_S):
        await adapter.execute(run, emit)
    assert chunks == expected_events(MODEL, 3)
    assert upstream.requests[-1].path == "/v1/chat/completions"
    assert upstream.requests[-1].body == run.body


async def test_a_caller_s_keep_alive_never_reaches_ollama(
    upstream: FakeUpstream, adapter: OllamaAdapter
) -> None:
    """The Edge owns keep-alive: `keep_alive: 0` would unload the model for everyone."""
    body = {"model": MODEL, "keep_alive": 0, "messages": [{"role": "user", "content": "hi"}]}
    run = Run(
        run_id="run-8",
        provider_id="gpu2-ollama",
        target=MODEL,
        operation="chat",
        body=json.dumps(body).encode(),
    )

    async def emit(data: bytes, parsed: ParsedChunk | None = None, /) -> None:
        pass

    with trio.fail_after(GUARD_S):
        await adapter.execute(run, emit)
    sent = json.loads(upstream.requests[-1].body)
    assert "keep_alive" not in sent
    assert sent == {k: v for k, v in body.items() if k != "keep_alive"}


def test_a_body_without_keep_alive_is_sent_as_it_came() -> None:
    run = Run(run_id="r", provider_id="p", target=MODEL, operation="chat", body=b'{"a": 1}')
    assert without_keep_alive(run) is run
    text = Run(run_id="r", provider_id="p", target=MODEL, operation="chat", body=b'"keep_alive"')
    assert without_keep_alive(text) is text  # not an object: the upstream says what is wrong


@pytest.mark.parametrize(
    ("base_url", "root"),
    [
        ("http://127.0.0.1:11434/v1", "http://127.0.0.1:11434"),
        ("http://gpu2:11434/v1/", "http://gpu2:11434"),
        ("https://proxy.example/ollama/v1", "https://proxy.example/ollama"),
    ],
)
def test_native_root(base_url: str, root: str) -> None:
    assert native_root(base_url) == root


@pytest.mark.parametrize(
    ("version", "can_load"),
    [
        ("0.1.22", False),  # before `keep_alive`: no load or unload through the API
        ("0.1.23", True),
        ("0.1.23-rc2", True),
        ("0.6.2", True),
        ("1.0", True),
        ("0.0.0", True),  # a source build: taken to be current
        ("", True),
    ],
)
def test_lifecycle_follows_the_server_version(version: str, can_load: bool) -> None:
    flags = lifecycle_of(version)
    assert {"list_models", "pull_model", "delete_model"} <= set(flags)
    assert ("load_model" in flags) is can_load
    assert ("unload_model" in flags) is can_load
