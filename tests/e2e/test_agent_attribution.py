"""Claude Code's attribution block through a real Edge + Node with the `anthropic` SDK:
removed before the run, natively and translated, unless the model's
`generation.strip_agent_attribution` is off; the rest of the prompt arrives unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import msgspec
import trio

from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import WAIT_GUARD_S, edge_config, start_stack

ATTRIBUTION = (
    "x-anthropic-billing-header: cc_version=2.1.197.0df; cc_entrypoint=sdk-cli; cch=fa690;"
)
AGENT = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
INSTRUCTIONS = "Answer in one word."
#: `system` as Claude Code sends it.
SYSTEM: list[Any] = [
    {"type": "text", "text": ATTRIBUTION},
    {"type": "text", "text": AGENT, "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": INSTRUCTIONS, "cache_control": {"type": "ephemeral"}},
]
MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]


def _provider(provider_id: str, base_url: str, protocols: list[str]) -> dict[str, Any]:
    return {
        "id": provider_id,
        "type": "vllm",
        "models": ["fake-model"],
        "capacity": 2,
        "adapter": {"base_url": base_url, "protocols": protocols},
    }


async def test_the_attribution_block_never_reaches_the_runtime(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    native = FakeUpstream(native=frozenset({"messages"}))
    chat = FakeUpstream()
    text = edge_config(
        tmp_path / "state",
        providers=[
            _provider("native", await nursery.start(native.serve), ["chat", "messages"]),
            _provider("chat", await nursery.start(chat.serve), ["chat"]),
        ],
        models=[
            {"id": "agent", "providers": {"native": "fake-model"}},
            {
                "id": "agent-as-sent",
                "providers": {"native": "fake-model"},
                "generation": {"strip_agent_attribution": False},
            },
            {"id": "agent-translated", "providers": {"chat": "fake-model"}},
        ],
    )
    stack = await start_stack(
        nursery,
        text,
        tmp_path / "edge.yaml",
        wait_models=("agent", "agent-as-sent", "agent-translated"),
    )
    async with anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url, api_key="open", max_retries=0, timeout=WAIT_GUARD_S
    ) as client:
        for model in ("agent", "agent-as-sent"):
            reply = await client.messages.create(
                model=model, max_tokens=8, system=SYSTEM, messages=MESSAGES
            )
            assert reply.model == model and reply.content
        async with client.messages.stream(
            model="agent-translated", max_tokens=8, system=SYSTEM, messages=MESSAGES
        ) as stream:
            final = await stream.get_final_message()
        assert final.model == "agent-translated" and final.content
        counted = await client.messages.count_tokens(
            model="agent", system=SYSTEM, messages=MESSAGES
        )
        assert counted.input_tokens > 0

    stripped, as_sent = (
        msgspec.json.decode(request.body)
        for request in native.requests
        if request.path == "/v1/messages"
    )
    assert stripped["system"] == SYSTEM[1:]  # natively: the rest byte for byte, cache marks kept
    assert as_sent["system"] == SYSTEM
    assert {k: v for k, v in stripped.items() if k != "system"} == {
        k: v for k, v in as_sent.items() if k != "system"
    }
    [counting] = [r for r in native.requests if r.path == "/v1/messages/count_tokens"]
    assert msgspec.json.decode(counting.body)["system"] == SYSTEM[1:]
    [translated] = [r for r in chat.requests if r.path == "/v1/chat/completions"]
    messages = msgspec.json.decode(translated.body)["messages"]
    assert messages[0] == {"role": "system", "content": f"{AGENT}\n{INSTRUCTIONS}"}
    assert all("x-anthropic-billing-header" not in str(m["content"]) for m in messages)
