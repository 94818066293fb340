"""Thinking blocks and their signatures round trip through IOP, natively and translated.

An agent sends its earlier turns back as it got them: thinking blocks with their
`signature`. Natively they reach the runtime as they were sent. Translated, a runtime's
reasoning (`reasoning_content`) comes back as a thinking block the SDK reads (its
`signature` empty: a runtime signs nothing), and that block, sent back, reaches the
runtime as the turn's `reasoning_content` again; a signature Anthropic made is accepted
and has no meaning to a runtime, so it goes no further.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import anthropic
import pytest
import trio

from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import WAIT_GUARD_S, Stack, edge_config, start_stack

SIGNATURE: Final = "EqQBCkYIBxgCKkDsig" + "x" * 200


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> tuple[Stack, FakeUpstream, FakeUpstream]:
    native = FakeUpstream(native=frozenset({"messages"}))
    chat = FakeUpstream()
    providers = [
        {
            "id": name,
            "type": "vllm",
            "models": ["fake-model"],
            "capacity": 2,
            "adapter": {"base_url": await nursery.start(upstream.serve), "protocols": protocols},
        }
        for name, upstream, protocols in (
            ("native", native, ["chat", "messages"]),
            ("chat", chat, ["chat"]),
        )
    ]
    text = edge_config(
        tmp_path / "state",
        providers=providers,
        models=[
            {"id": "m-native", "providers": {"native": "fake-model"}},
            {"id": "m-translated", "providers": {"chat": "fake-model"}},
        ],
    )
    stack = await start_stack(
        nursery, text, tmp_path / "edge.yaml", wait_models=("m-native", "m-translated")
    )
    return stack, native, chat


def _client(stack: Stack) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url, api_key="open", max_retries=0, timeout=WAIT_GUARD_S
    )


def _history(thinking: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Think, then answer."},
        {"role": "assistant", "content": [*thinking, {"type": "text", "text": "Done."}]},
        {"role": "user", "content": "Again."},
    ]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_translated_reasoning_comes_back_as_thinking_and_goes_out_as_reasoning(
    stack: tuple[Stack, FakeUpstream, FakeUpstream], stream: bool
) -> None:
    edge, _, chat = stack
    first_turn: list[Any] = [{"role": "user", "content": "Think, then answer."}]
    async with _client(edge) as client:
        options: dict[str, Any] = {
            "model": "m-translated",
            "max_tokens": 64,
            "messages": first_turn,
            "thinking": {"type": "enabled", "budget_tokens": 32},
        }
        if stream:
            async with client.messages.stream(**options) as events:
                reply = await events.get_final_message()
        else:
            reply = await client.messages.create(**options)
        # The fake runtime interleaves reasoning and text: a stream has a thinking block
        # for each piece of reasoning.
        blocks = [block for block in reply.content if block.type == "thinking"]
        assert blocks and all(block.signature == "" for block in blocks)
        assert all(block.thinking.startswith("why") for block in blocks)

        # The agent sends the turn back as it got it, signature included.
        assistant = [block.model_dump(exclude_none=True) for block in reply.content]
        options["messages"] = [
            *first_turn,
            {"role": "assistant", "content": assistant},
            {"role": "user", "content": "Again."},
        ]
        await client.messages.create(**{**options, "stream": False})
    sent = json.loads(chat.requests[-1].body)
    [assistant_message] = [m for m in sent["messages"] if m["role"] == "assistant"]
    assert assistant_message["reasoning_content"] == "\n".join(b.thinking for b in blocks)


async def test_anthropic_signed_thinking_is_accepted_translated_and_relayed_natively(
    stack: tuple[Stack, FakeUpstream, FakeUpstream],
) -> None:
    edge, native, chat = stack
    thinking = [
        {"type": "thinking", "thinking": "Let me see.", "signature": SIGNATURE},
        {"type": "redacted_thinking", "data": "EmwKAhgBEgy" + "z" * 64},
    ]
    async with _client(edge) as client:
        for model in ("m-native", "m-translated"):
            reply = await client.messages.create(
                model=model, max_tokens=16, messages=_history(thinking)
            )
            assert reply.content
    [relayed] = [r for r in native.requests if r.path == "/v1/messages"]
    assert json.loads(relayed.body)["messages"][1]["content"][:2] == thinking
    [translated] = [r for r in chat.requests if r.path == "/v1/chat/completions"]
    assistant = json.loads(translated.body)["messages"][1]
    assert assistant["reasoning_content"] == "Let me see."
    assert SIGNATURE not in translated.body.decode()
