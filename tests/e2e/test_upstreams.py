"""Real upstream adapters through a real Edge and Node, called with the official `openai` SDK.

The upstream is the fake OpenAI-compatible server of `tests/adapters/fake_upstream.py` on
a real loopback socket, so every hop is the production one: SDK -> Edge HTTP -> wire ->
Node -> adapter -> HTTP upstream and back. These tests pin what a caller and an upstream
each see: the alias on every response and chunk, the served name upstream, provider
fields passed through, usage asked for upstream and metered, and the operations.

The stacks and helpers are `tests/e2e/upstreams.py`'s, shared with the other upstream
modules.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import openai
import pytest
import trio

from tests.adapters.fake_upstream import EMBEDDING, EXTRA, PROMPT_TOKENS, FakeUpstream
from tests.e2e.stack import Stack
from tests.e2e.upstreams import (
    ALIAS,
    MESSAGES,
    SERVED,
    MakeStack,
    all_idle,
    extra,
    metered,
    posts,
    provider_of,
    upstream_provider,
    wait_idle,
)
from tests.timing import GUARD_S

# --- vllm: chat ---------------------------------------------------------------------------


@pytest.fixture
async def vllm(nursery: trio.Nursery, make_stack: MakeStack) -> tuple[Stack, FakeUpstream]:
    fake = FakeUpstream(chunks=3)
    base_url = await nursery.start(fake.serve)
    stack = await make_stack([upstream_provider("gpu-vllm", base_url)])
    return stack, fake


async def test_non_stream_chat_relabels_and_passes_provider_fields(
    vllm: tuple[Stack, FakeUpstream],
) -> None:
    stack, fake = vllm
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            raw = await client.chat.completions.with_raw_response.create(
                model=ALIAS, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=2
            )
    completion = raw.parse()
    assert raw.headers["x-iop-provider"] == "gpu-vllm"
    assert completion.model == ALIAS
    assert completion.choices[0].message.content == "tok0 tok1 tok2 "
    assert extra(completion.choices[0].message)["reasoning_content"] == "why"
    assert extra(completion)["provider_extra"] == EXTRA["provider_extra"]
    assert completion.system_fingerprint == "fp_fake"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == PROMPT_TOKENS
    assert completion.usage.completion_tokens == 3

    [sent] = posts(fake)
    assert sent["model"] == SERVED  # the served name, never the alias
    assert sent["messages"] == MESSAGES
    assert (sent["max_tokens"], sent["logprobs"], sent["top_logprobs"]) == (8, True, 2)
    assert "stream_options" not in sent
    assert metered(stack, "gpu-vllm", "prompt") == PROMPT_TOKENS
    assert metered(stack, "gpu-vllm", "completion") == 3
    assert all_idle(await stack.catalog())


async def test_stream_chat_relabels_every_chunk_and_meters_stripped_usage(
    vllm: tuple[Stack, FakeUpstream],
) -> None:
    stack, fake = vllm
    content: list[str] = []
    reasoning: list[str] = []
    finish: str | None = None
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            stream = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, max_tokens=8, stream=True
            )
            async for chunk in stream:
                assert chunk.model == ALIAS
                assert chunk.usage is None  # asked for upstream, stripped for the caller
                assert extra(chunk)["provider_extra"] == EXTRA["provider_extra"]
                assert chunk.choices, "the usage-only chunk must not reach this caller"
                choice = chunk.choices[0]
                assert choice.logprobs is None  # present upstream, relayed as it was
                content.append(choice.delta.content or "")
                reasoning.append(extra(choice.delta).get("reasoning_content", ""))
                finish = choice.finish_reason or finish
    assert "".join(content) == "tok0 tok1 tok2 "
    assert "".join(reasoning) == "why0why1why2"
    assert finish == "stop"

    [sent] = posts(fake)
    assert sent["model"] == SERVED
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}  # the Edge asked, for metering
    assert metered(stack, "gpu-vllm", "prompt") == PROMPT_TOKENS
    assert metered(stack, "gpu-vllm", "completion") == 3
    assert all_idle(await stack.catalog())


async def test_stream_usage_reaches_a_caller_who_asked(vllm: tuple[Stack, FakeUpstream]) -> None:
    stack, fake = vllm
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            stream = await client.chat.completions.create(
                model=ALIAS,
                messages=MESSAGES,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
    assert all(chunk.model == ALIAS for chunk in chunks)
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (PROMPT_TOKENS, 3)
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert posts(fake)[0]["stream_options"] == {"include_usage": True}
    assert metered(stack, "gpu-vllm", "completion") == 3


async def test_raw_stream_is_well_formed_sse(vllm: tuple[Stack, FakeUpstream]) -> None:
    """What a non-SDK client sees: `data:` events, non-ASCII intact, one final `[DONE]`."""
    stack, _ = vllm
    body = {"model": ALIAS, "messages": MESSAGES, "stream": True}
    with trio.fail_after(GUARD_S):
        async with (
            stack.http() as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-iop-provider"] == "gpu-vllm"
            events = [line async for line in response.aiter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert len(payloads) == 4  # 3 tokens + the finish chunk; the usage chunk is stripped
    assert all(p["model"] == ALIAS for p in payloads)
    assert all(p["provider_extra"]["note"] == "caf\u00e9" for p in payloads)


async def test_concurrent_streams_stay_within_capacity(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    most_active = 0

    async def observe(_index: int) -> None:
        nonlocal most_active
        most_active = max(most_active, fake.active)

    fake = FakeUpstream(chunks=20, pace=observe)
    base_url = await nursery.start(fake.serve)
    provider = upstream_provider("gpu-vllm", base_url, capacity=2)
    stack = await make_stack([provider])
    texts: list[str] = []

    async def one(client: openai.AsyncOpenAI) -> None:
        stream = await client.chat.completions.create(model=ALIAS, messages=MESSAGES, stream=True)
        texts.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))

    with trio.fail_after(GUARD_S):
        async with stack.client() as client, trio.open_nursery() as callers:
            for _ in range(6):
                callers.start_soon(one, client)
    expected = "".join(f"tok{i} " for i in range(20))
    assert texts == [expected] * 6
    assert fake.requests_total == 6
    assert most_active == 2  # the Edge's admission bounds what reaches the upstream
    assert all_idle(await stack.catalog())


async def test_api_key_env_is_resolved_on_the_node(
    nursery: trio.Nursery, make_stack: MakeStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "sk-e2e-upstream-key-not-real"
    monkeypatch.setenv("IOP_E2E_UPSTREAM_KEY", secret)
    fake = FakeUpstream()
    base_url = await nursery.start(fake.serve)
    provider = upstream_provider("gpu-vllm", base_url, api_key_env="IOP_E2E_UPSTREAM_KEY")
    stack = await make_stack([provider])
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
    assert {r.headers.get("authorization") for r in fake.requests} == {f"Bearer {secret}"}
    async with stack.admin() as admin:
        for path in ("/catalog", "/status"):
            assert secret not in (await admin.get(path)).text


async def test_every_openai_compatible_type_relays(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(chunks=2)
    base_url = await nursery.start(fake.serve)
    types = ["vllm", "sglang", "lemonade", "openai_api"]
    stack = await make_stack(
        [upstream_provider(f"p-{t}", base_url, type=t) for t in types],
        models=[{"id": f"m-{t}", "providers": {f"p-{t}": SERVED}} for t in types],
    )
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            for t in types:
                raw = await client.chat.completions.with_raw_response.create(
                    model=f"m-{t}", messages=MESSAGES, stream=True
                )
                chunks = [chunk async for chunk in raw.parse()]
                assert raw.headers["x-iop-provider"] == f"p-{t}"
                assert {chunk.model for chunk in chunks} == {f"m-{t}"}
                got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert got == "tok0 tok1 "
    categories = {p["id"]: p["category"] for p in (await stack.catalog())["providers"]}
    assert categories == {
        "p-vllm": "local_inference",
        "p-sglang": "local_inference",
        "p-lemonade": "local_inference",
        "p-openai_api": "api",
    }
    assert [json.loads(r.body)["model"] for r in fake.requests if r.method == "POST"] == [
        SERVED
    ] * 4


# --- vllm: completions and embeddings -----------------------------------------------------


async def test_completions_non_stream_and_stream(vllm: tuple[Stack, FakeUpstream]) -> None:
    stack, fake = vllm
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            whole = await client.completions.create(model=ALIAS, prompt="once upon", max_tokens=5)
            stream = await client.completions.create(
                model=ALIAS, prompt="once upon", max_tokens=5, stream=True
            )
            chunks = [chunk async for chunk in stream]
    assert whole.model == ALIAS
    assert whole.object == "text_completion"
    assert whole.choices[0].text == "tok0 tok1 tok2 "
    assert whole.usage is not None and whole.usage.completion_tokens == 3
    assert all(chunk.model == ALIAS for chunk in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "tok0 tok1 tok2 "
    assert all(chunk.usage is None for chunk in chunks)

    plain, streamed = posts(fake)
    assert [r.path for r in fake.requests if r.method == "POST"] == ["/v1/completions"] * 2
    assert plain["model"] == streamed["model"] == SERVED
    assert plain["prompt"] == "once upon"
    assert streamed["stream_options"] == {"include_usage": True}
    assert metered(stack, "gpu-vllm", "completion") == 6
    assert all_idle(await stack.catalog())


async def test_embeddings(vllm: tuple[Stack, FakeUpstream]) -> None:
    stack, fake = vllm
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            raw = await client.embeddings.with_raw_response.create(
                model=ALIAS, input=["hello", "world"], encoding_format="float"
            )
    response = raw.parse()
    assert raw.headers["x-iop-provider"] == "gpu-vllm"
    assert response.model == ALIAS
    assert response.data[0].embedding == EMBEDDING
    assert response.usage.prompt_tokens == PROMPT_TOKENS

    [request] = [r for r in fake.requests if r.method == "POST"]
    assert request.path == "/v1/embeddings"
    sent = json.loads(request.body)
    assert sent == {"model": SERVED, "input": ["hello", "world"], "encoding_format": "float"}
    assert metered(stack, "gpu-vllm", "prompt") == PROMPT_TOKENS
    assert all_idle(await stack.catalog())


# --- ollama ---------------------------------------------------------------------------------


async def test_ollama_health_from_native_api_and_runs_through_v1(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(chunks=2, models=["llama3.2:latest", "qwen3:8b"])
    base_url = await nursery.start(fake.serve)
    provider = upstream_provider("box-ollama", base_url, type="ollama", served="llama3.2:latest")
    stack = await make_stack([provider])

    catalog = await stack.catalog()
    listed = provider_of(catalog, "box-ollama")
    assert listed["type"] == "ollama"
    assert listed["health"] == "available"
    assert listed["discovered_models"] == ["llama3.2:latest", "qwen3:8b"]  # from /api/tags
    # The flags the native API offers (per /api/version), beside the configured ones.
    assert listed["discovered_lifecycle"] == dict.fromkeys(
        ("list_models", "load_model", "unload_model", "pull_model", "delete_model"), True
    )
    probed = {r.path for r in fake.requests if r.method == "GET"}
    assert "/api/tags" in probed
    assert "/v1/models" not in probed

    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            whole = await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
            stream = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert whole.model == ALIAS
    assert whole.choices[0].message.content == "tok0 tok1 "
    assert "".join(pieces) == "tok0 tok1 "
    inference = [r for r in fake.requests if r.method == "POST"]
    assert [r.path for r in inference] == ["/v1/chat/completions"] * 2
    assert all(json.loads(r.body)["model"] == "llama3.2:latest" for r in inference)
    assert metered(stack, "box-ollama", "completion") == 4
    assert all_idle(await stack.catalog())


# --- cli ------------------------------------------------------------------------------------

#: Echoes the model name it was started for, then the prompt, one word per write.
ECHO_SCRIPT = """
import sys
print(sys.argv[1], end=" ", flush=True)
for word in sys.stdin.read().split():
    print(word, end=" ", flush=True)
"""

#: Connects back to the test, prints a word, then one more for every byte the test sends,
#: forever: the test paces it without sleeping, and sees its death as EOF on that link
#: (so the test sends a byte only once the process has consumed the previous one).
PACED_SCRIPT = """
import socket, sys
link = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sys.stdin.read()
print("word", end=" ", flush=True)
while link.recv(1):
    print("word", end=" ", flush=True)
"""


def cli_provider(provider_id: str, script: str, *args: str) -> dict[str, Any]:
    return {
        "id": provider_id,
        "type": "cli",
        "models": ["echo-model"],
        "capacity": 2,
        "adapter": {"command": [sys.executable, "-c", script, *args], "request_timeout_s": 10},
    }


async def test_cli_provider_streams_through_the_edge(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    provider = cli_provider("local-cli", ECHO_SCRIPT, "{model}")
    stack = await make_stack([provider])
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            stream = await client.chat.completions.create(
                model=ALIAS,
                messages=[{"role": "user", "content": "the quick brown fox"}],
                stream=True,
            )
            chunks = [chunk async for chunk in stream]
            whole = await client.chat.completions.create(
                model=ALIAS, messages=[{"role": "user", "content": "jumps"}]
            )
    assert all(chunk.model == ALIAS for chunk in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo-model the quick brown fox "  # {model} became the served name
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert whole.model == ALIAS
    assert whole.choices[0].message.content == "echo-model jumps "
    assert metered(stack, "local-cli", "completion") > 0
    assert all_idle(await stack.catalog())


async def test_cli_caller_gone_kills_the_process(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    provider = cli_provider("local-cli", PACED_SCRIPT, str(port))
    stack = await make_stack([provider])
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            stream = await client.chat.completions.create(
                model=ALIAS, messages=MESSAGES, stream=True
            )
            link = await listeners[0].accept()  # the process is running
            received = ""
            async for chunk in stream:  # a word may come in several chunks
                if chunk.choices:
                    received += chunk.choices[0].delta.content or ""
                if received == "word ":
                    await link.send_all(b"w")  # one more word, please
                elif received == "word word ":
                    break
            await stream.close()  # the caller hangs up mid-stream
        # The Node kills the process: its end of the link closes.
        assert await link.receive_some() == b""
    await wait_idle(stack)
    await link.aclose()
    await listeners[0].aclose()


async def test_cli_non_zero_exit_is_a_502_with_the_stderr_tail(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    script = "import sys; sys.stdin.read(); sys.stderr.write('model file missing'); sys.exit(3)"
    stack = await make_stack([cli_provider("local-cli", script)])
    with trio.fail_after(GUARD_S):
        async with stack.client() as client:
            with pytest.raises(openai.InternalServerError) as caught:
                await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
    assert caught.value.status_code == 502
    assert caught.value.code == "cli_failed"
    assert "status 3" in caught.value.message
    assert "model file missing" in caught.value.message
    assert all_idle(await stack.catalog())
