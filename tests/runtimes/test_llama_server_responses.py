"""A Responses conversation as Codex sends it reaches llama.cpp's own server natively
through IOP, Codex's thread goal included (design §14).

Codex hands the model its thread goal as a `function_call_output` item without a
`call_id`; llama-server refuses that item ("Cannot determine type of 'item'"). IOP sends
it on as a user message, so the runtime answers: checked against the real server, on
which the item as Codex writes it is refused first.

Opt-in (`just test-runtimes`); skipped with the reason when the binary, the CPU it needs
or the model is missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import httpx2
import pytest
import trio

from tests.e2e.upstreams import ALIAS, MakeStack, upstream_provider
from tests.runtimes.conftest import (
    llama_server_and_model,
    llama_server_url,
    running,
)

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

SERVED: Final = "smollm2"
#: Bound on one exchange (a 135M model on 2 busy cores).
GUARD_S: Final = 240.0
GOAL: Final[dict[str, Any]] = {
    "type": "function_call_output",
    "name": "goal_objective",
    "namespace": "agent",
    "output": "count to three",
}
ITEMS: Final[list[dict[str, Any]]] = [
    {"type": "message", "role": "user", "content": "Set the goal: count to three."},
    {"type": "function_call", "call_id": "c1", "name": "create_goal", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": '{"status":"active"}'},
    GOAL,
]
TOOLS: Final = [{"type": "function", "name": "create_goal", "parameters": {"type": "object"}}]


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    """One llama-server process (`.../v1`) for the module."""
    binary, model = llama_server_and_model()
    command = [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "0",
        "-c", "2048", "--parallel", "1", "--threads", "1",
    ]  # fmt: skip
    with running(command, llama_server_url, name="llama-server") as url:
        yield url


async def test_codex_goal_item_is_answered_by_llama_server_natively(
    llama_server: str, make_stack: MakeStack
) -> None:
    body = {"model": SERVED, "input": ITEMS, "tools": TOOLS, "max_output_tokens": 8}
    async with httpx2.AsyncClient(timeout=GUARD_S) as direct:
        refused = await direct.post(f"{llama_server}/responses", json=body)
    assert refused.status_code == 400, refused.text  # the server reads no such item

    provider = upstream_provider(
        "llama",
        llama_server,
        type="openai_api",
        served=SERVED,
        capacity=1,
        protocols=["chat", "responses"],
        request_timeout_s=GUARD_S,
        first_byte_timeout_s=GUARD_S,
    )
    stack = await make_stack([provider])
    async with stack.client(timeout=GUARD_S) as client:
        with trio.fail_after(GUARD_S):
            raw = await client.responses.with_raw_response.create(
                model=ALIAS, input=ITEMS, tools=TOOLS, max_output_tokens=8, store=False
            )
    response = raw.parse()
    assert raw.headers["x-iop-provider"] == "llama"
    assert response.status in ("completed", "incomplete"), response
    assert response.output, response
    assert await stack.requests_by_protocol() == {"responses": 1}
