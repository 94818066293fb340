"""Tools only a vendor's service runs (OpenAI's `web_search`, Anthropic's server tools) are
left out of a translated run, which then succeeds, with the `iop-dropped-tools` header
and a Node log line saying so; a model set to refuse them answers 400 naming the tool; a
native runtime gets them as they are."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import Stack, edge_config, sim_provider, start_stack

SHELL: Final = {"type": "function", "name": "shell", "parameters": {"type": "object"}}
RESPONSES: Final[dict[str, Any]] = {
    "input": "Find it.",
    "max_output_tokens": 4,
    "tools": [SHELL, {"type": "web_search"}, {"type": "code_interpreter", "container": "auto"}],
}
MESSAGES: Final[dict[str, Any]] = {
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "Find it."}],
    "tools": [
        {"name": "Bash", "input_schema": {"type": "object"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
    ],
}
PATHS: Final = {"responses": "/v1/responses", "messages": "/v1/messages"}
BODIES: Final = {"responses": RESPONSES, "messages": MESSAGES}
DROPPED: Final = {"responses": "web_search, code_interpreter", "messages": "web_search_20250305"}


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> tuple[Stack, FakeUpstream]:
    native = FakeUpstream(native=frozenset({"messages", "responses"}))
    native_provider = {
        "id": "native",
        "type": "vllm",
        "models": ["fake-model"],
        "capacity": 2,
        "adapter": {"base_url": await nursery.start(native.serve)},
    }
    text = edge_config(
        tmp_path / "state",
        providers=[sim_provider("sim-1"), native_provider],
        models=[
            {"id": "m", "providers": {"sim-1": "sim-small"}},
            {
                "id": "m-refuse",
                "providers": {"sim-1": "sim-small"},
                "generation": {"hosted_tools": "refuse"},
            },
            {"id": "m-native", "providers": {"native": "fake-model"}},
        ],
    )
    stack = await start_stack(
        nursery, text, tmp_path / "edge.yaml", wait_models=("m", "m-refuse", "m-native")
    )
    return stack, native


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("protocol", ["responses", "messages"])
async def test_a_translated_run_leaves_hosted_tools_out_and_says_so(
    stack: tuple[Stack, FakeUpstream],
    protocol: str,
    stream: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="iop_node.runs.protocol_run")
    edge, _ = stack
    body = {**BODIES[protocol], "model": "m", "stream": stream}
    async with edge.http() as client:
        response = await client.post(PATHS[protocol], json=body)
    assert response.status_code == 200, response.text
    assert response.headers["iop-dropped-tools"] == DROPPED[protocol]
    if stream:
        assert "event: error" not in response.text
        last = response.text.rstrip().rsplit("data: ", 1)[-1]
        # The sim writes `max_output_tokens` tokens: a Responses stream ends incomplete.
        assert json.loads(last)["type"] in ("message_stop", "response.incomplete")
    else:
        assert response.json()["usage"]
    [line] = [
        r.getMessage() for r in caplog.records if "left out the hosted tools" in r.getMessage()
    ]
    assert DROPPED[protocol] in line and "sim-1" in line


@pytest.mark.parametrize("protocol", ["responses", "messages"])
async def test_a_model_set_to_refuse_them_answers_400_naming_the_tool(
    stack: tuple[Stack, FakeUpstream], protocol: str
) -> None:
    edge, _ = stack
    async with edge.http() as client:
        response = await client.post(
            PATHS[protocol], json={**BODIES[protocol], "model": "m-refuse"}
        )
    assert response.status_code == 400, response.text
    assert "iop-dropped-tools" not in response.headers
    assert "tools[1].type" in response.text and "web_search" in response.text


@pytest.mark.parametrize("protocol", ["responses", "messages"])
async def test_a_native_runtime_gets_them_as_they_are(
    stack: tuple[Stack, FakeUpstream], protocol: str
) -> None:
    edge, native = stack
    body = {**BODIES[protocol], "model": "m-native"}
    async with edge.http() as client:
        response = await client.post(PATHS[protocol], json=body)
    assert response.status_code == 200, response.text
    assert "iop-dropped-tools" not in response.headers
    [sent] = [r for r in native.requests if r.path == PATHS[protocol]]
    assert json.loads(sent.body)["tools"] == BODIES[protocol]["tools"]


async def test_counting_tokens_leaves_them_out_too(stack: tuple[Stack, FakeUpstream]) -> None:
    edge, _ = stack
    body = {key: value for key, value in MESSAGES.items() if key != "max_tokens"}
    async with edge.http() as client:
        response = await client.post("/v1/messages/count_tokens", json={**body, "model": "m"})
    assert response.status_code == 200, response.text
    assert response.json()["input_tokens"] > 0
