"""Cache affinity end to end: an agent's turns, through a real Edge and Node with the
official SDKs, land on one of four sim providers that model a prefix cache, and from the
second turn on the runtime reports most of the prompt as cached, in each protocol's own
usage field (chat `prompt_tokens_details.cached_tokens`, Messages
`cache_read_input_tokens`, Responses `input_tokens_details.cached_tokens`); two Edges
sharing the Node send a conversation's turns to the same provider."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anthropic
import pytest
import trio
from trio_websocket import open_websocket_url

from iop_node.main import run_node
from tests.e2e.stack import (
    NODE_TOKEN,
    WAIT_GUARD_S,
    Stack,
    edge_config,
    sim_provider,
    start_stack,
)
from tests.e2e.test_several_edges import _serve_edge

IDS = ("sim-a", "sim-b", "sim-c", "sim-d")
CACHED = {"ttft_ms": 1, "tokens_per_second": 5000, "prefix_cache_tokens": 200_000}
SYSTEM = "You are a careful coding agent. " * 40
TURNS = 4
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    text = edge_config(
        tmp_path / "state",
        providers=[sim_provider(pid, capacity=4, adapter=CACHED) for pid in IDS],
        models=[{"id": "m", "providers": dict.fromkeys(IDS, "sim-small")}],
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


def _later_turns_mostly_cached(cached: list[int], prompt: list[int]) -> None:
    assert cached[0] == 0  # nothing of the conversation was seen before
    for turn in range(1, TURNS):
        assert cached[turn] >= 0.8 * prompt[turn - 1], (cached, prompt)


async def _chat_conversation(edge_of: Callable[[int], Stack]) -> None:
    """A chat conversation of `TURNS` turns, turn N asked of `edge_of(N)`, each sending the
    whole history again: every turn lands on one provider, cached from the second."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Fix the failing test."},
    ]
    landed, cached, prompt = set(), [], []
    for turn in range(TURNS):
        async with edge_of(turn).client() as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="m", messages=messages, max_tokens=8
            )
        completion = raw.parse()
        landed.add(raw.headers["x-iop-provider"])
        usage = completion.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens or 0)
        prompt.append(usage.prompt_tokens)
        messages += [
            {"role": "assistant", "content": completion.choices[0].message.content},
            {"role": "user", "content": f"Now step {turn + 1}: " + "details " * 50},
        ]
    assert len(landed) == 1
    _later_turns_mostly_cached(cached, prompt)


async def test_chat_turns_land_on_one_provider_and_hit_its_cache(stack: Stack) -> None:
    await _chat_conversation(lambda turn: stack)


async def test_a_claude_code_session_lands_on_one_provider(stack: Stack) -> None:
    """Messages with Claude Code's session header (translated to chat on the Node)."""
    client = anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url,
        api_key="unused",
        max_retries=0,
        default_headers={"x-claude-code-session-id": "0b6c5f0e-session"},
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    landed, cached, prompt = set(), [], []
    async with client:
        for turn in range(TURNS):
            raw = await client.messages.with_raw_response.create(
                model="m",
                system=SYSTEM,
                messages=messages,
                max_tokens=8,  # type: ignore[arg-type]
            )
            message = await raw.parse()
            landed.add(raw.headers["x-iop-provider"])
            usage = message.usage
            read = usage.cache_read_input_tokens or 0
            cached.append(read)
            prompt.append(usage.input_tokens + read)
            text = "".join(block.text for block in message.content if block.type == "text")
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"Now step {turn + 1}: " + "details " * 50},
            ]
    assert len(landed) == 1
    _later_turns_mostly_cached(cached, prompt)


async def test_a_responses_chain_lands_on_one_provider(stack: Stack) -> None:
    landed, cached, prompt = set(), [], []
    previous: str | None = None
    async with stack.client() as client:
        for turn in range(TURNS):
            text = "Fix the failing test." if turn == 0 else f"Now step {turn}: " + "details " * 50
            kwargs: dict[str, Any] = {"previous_response_id": previous} if previous else {}
            raw = await client.responses.with_raw_response.create(
                model="m", instructions=SYSTEM, input=text, max_output_tokens=8, **kwargs
            )
            response = raw.parse()
            landed.add(raw.headers["x-iop-provider"])
            assert response.usage is not None
            cached.append(response.usage.input_tokens_details.cached_tokens)
            prompt.append(response.usage.input_tokens)
            previous = response.id
    assert len(landed) == 1
    _later_turns_mostly_cached(cached, prompt)


async def test_two_edges_send_a_conversations_turns_to_one_provider(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Two Edges with nothing shared but the config and the Node: each turn goes to the
    other Edge, and every turn lands on one provider, cached from the second."""
    stacks = []
    for name in ("a", "b"):
        text = edge_config(
            tmp_path / name,
            providers=[sim_provider(pid, capacity=4, adapter=CACHED) for pid in IDS],
            models=[{"id": "m", "providers": dict.fromkeys(IDS, "sim-small")}],
        )
        stacks.append(
            await _serve_edge(nursery, text, tmp_path / f"{name}.yaml", trio.CancelScope())
        )
    urls = [stack.addresses.node_url for stack in stacks]
    await nursery.start(partial(run_node, urls, "node-1", NODE_TOKEN))
    for stack in stacks:
        await stack.wait_servable("m")
    await _chat_conversation(lambda turn: stacks[turn % 2])


@pytest.mark.parametrize(
    "header", ["session_id", "session-id", "x-session-id", "x-session-affinity"]
)
async def test_a_session_header_keeps_unrelated_prompts_together(stack: Stack, header: str) -> None:
    """Codex's `session_id` (an underscore: the Edge's HTTP server keeps it) and the
    others: requests that share nothing but the session land on one provider."""
    landed = set()
    async with stack.client(default_headers={header: "0199a0c2-session"}) as client:
        for n in range(6):
            raw = await client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": f"question {n}"}], max_tokens=2
            )
            landed.add(raw.headers["x-iop-provider"])
    assert len(landed) == 1


@pytest.mark.parametrize("header", ["session_id", "x-session-id", "x-session-affinity"])
async def test_a_session_header_keeps_websocket_connections_together(
    stack: Stack, tmp_path: Path, header: str
) -> None:
    """On the Responses WebSocket the upgrade's session header is the key of every turn,
    whichever header it is; the connection's own id only when it sent none."""
    url = stack.addresses.openai_url.replace("http://", "ws://") + "/v1/responses"
    for n in range(6):
        extra = [(header.encode(), b"0199a0c2-session")]
        async with open_websocket_url(url, extra_headers=extra) as socket:
            create = {"type": "response.create", "model": "m", "input": f"question {n}"}
            await socket.send_message(json.dumps({**create, "max_output_tokens": 2}))
            with trio.fail_after(WAIT_GUARD_S):
                while json.loads(await socket.get_message())["type"] not in TERMINAL:
                    pass
    with trio.fail_after(WAIT_GUARD_S):
        await stack.edge.ledger.wait_flushed()
    with sqlite3.connect(tmp_path / "state" / "usage.sqlite3") as db:
        landed = [provider for (provider,) in db.execute("SELECT provider FROM usage")]
    assert len(landed) == 6 and len(set(landed)) == 1, landed
