"""Claude Code's attribution block against a runtime's prompt prefix cache (`--parts agent-cache`).

Claude Code puts a block first in the system prompt of every request,
`x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=...;`, whose values
change from one request to the next. A runtime's prefix cache reuses only what a new
prompt shares with an earlier one from its first token on, so that block makes every
turn of an agent's conversation prefill its whole prompt again. IOP removes it at the
Edge (`generation.strip_agent_attribution`, on by default); this scenario shows what
that is worth.

One upstream in prefix-cache mode (`bench.upstream --prefill-us-per-token`, modelled
by `bench.prefix_cache`), one IOP Edge and Node with two models on it that differ only
in the switch: `agent` (the default, the block removed) and `agent-as-sent` (kept). The
same Claude-Code-shaped conversation goes to each in turn, one request per turn,
non-stream, as a Messages request over the native path: a system prompt (the
attribution block, new values each request; the agent's identity; its instructions),
a tool list, and messages that grow by the assistant's answer and a tool result each
turn. Per turn it records the time to the whole answer and the prompt tokens the
upstream reported reading from its cache (`cache_read_input_tokens`, relayed to the
caller unchanged).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx2
import msgspec
import trio

from bench.gateway import PROVIDER_ID, start_gateway
from bench.upstream import SERVED_MODEL, start_upstream

#: The two models the scenario compares (the gateway's extra models).
STRIPPED: Final = "agent"
AS_SENT: Final = "agent-as-sent"
_TIMEOUT_S: Final = 300.0


@dataclass(frozen=True, slots=True)
class AgentCacheShape:
    """The conversation and the runtime: `turns` requests; a prompt token costs
    `prefill_us` to compute and `cached_us` to reuse; the system prompt has
    `instructions_chars` of instructions and the request `tools` tool definitions."""

    turns: int = 6
    prefill_us: float = 200.0
    cached_us: float = 4.0
    instructions_chars: int = 12_000
    tools: int = 16

    def __post_init__(self) -> None:
        if self.turns < 1 or self.tools < 0 or self.instructions_chars < 0:
            raise ValueError("turns must be >= 1, tools and instructions >= 0")
        if self.prefill_us <= 0 or not 0 <= self.cached_us <= self.prefill_us:
            raise ValueError("prefill costs: 0 < prefill, 0 <= cached <= prefill")

    @property
    def label(self) -> str:
        return (
            f"{self.turns} turns, prefill {self.prefill_us:g} us/token ({self.cached_us:g} cached)"
        )


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of the conversation: its time to the whole answer, and the prompt
    as the upstream counted it."""

    seconds: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class AgentCacheMeasurement:
    shape: AgentCacheShape
    stripped: tuple[Turn, ...]
    """With the switch on (the default): the attribution block removed."""
    as_sent: tuple[Turn, ...]
    """With the switch off: the block reaches the runtime."""

    @staticmethod
    def total_s(turns: tuple[Turn, ...]) -> float:
        return sum(turn.seconds for turn in turns)

    @staticmethod
    def cached_share(turns: tuple[Turn, ...]) -> float:
        """The share of every prompt token of the conversation read from the cache."""
        prompt = sum(turn.prompt_tokens for turn in turns)
        return sum(turn.cached_tokens for turn in turns) / prompt if prompt else 0.0

    @property
    def speedup(self) -> float | None:
        """The conversation's time with the block kept over its time with it removed."""
        stripped = self.total_s(self.stripped)
        return self.total_s(self.as_sent) / stripped if stripped > 0 else None


# --- the conversation ---------------------------------------------------------------------------


def _prose(seed: str, chars: int) -> str:
    """Deterministic text of about `chars` characters (the same for both runs)."""
    sentence = f"When working on {seed}, read the surrounding code before changing it. "
    return (sentence * (chars // len(sentence) + 1))[:chars]


def attribution() -> str:
    """Claude Code's block, with the values it changes per request."""
    return (
        f"x-anthropic-billing-header: cc_version=2.1.197.{secrets.token_hex(2)[:3]}; "
        f"cc_entrypoint=cli; cch={secrets.token_hex(3)[:5]};"
    )


def _tools(count: int) -> list[dict[str, Any]]:
    return [
        {
            "name": f"tool_{n}",
            "description": _prose(f"tool {n}", 600),
            "input_schema": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "An absolute path."},
                    "limit": {"type": "integer", "description": "At most this many lines."},
                },
                "required": ["path"],
            },
        }
        for n in range(count)
    ]


class Conversation:
    """The Claude-Code-shaped conversation of one run (module docstring)."""

    def __init__(self, shape: AgentCacheShape, model: str) -> None:
        self._model = model
        self._system_rest = [
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {
                "type": "text",
                "text": _prose("the user's repository", shape.instructions_chars),
                "cache_control": {"type": "ephemeral"},
            },
        ]
        self._tools = _tools(shape.tools)
        self._messages: list[dict[str, Any]] = [
            {"role": "user", "content": [{"type": "text", "text": "Fix the failing test."}]}
        ]

    def request(self) -> bytes:
        """The next turn's request body: a fresh attribution block, then the rest."""
        body = {
            "model": self._model,
            "max_tokens": 64,
            "system": [{"type": "text", "text": attribution()}, *self._system_rest],
            "tools": self._tools,
            "messages": self._messages,
        }
        return json.dumps(body).encode()

    def answered(self, turn: int, text: str) -> None:
        """The assistant's answer and the tool result that follows it join the history."""
        self._messages.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
        result = _prose(f"the output of step {turn}", 1500)
        self._messages.append({"role": "user", "content": [{"type": "text", "text": result}]})


class _Text(msgspec.Struct):
    text: str = ""


class _Usage(msgspec.Struct):
    input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class _Message(msgspec.Struct):
    content: list[_Text]
    usage: _Usage


_decode_message: Final = msgspec.json.Decoder(_Message).decode


async def converse(
    client: httpx2.AsyncClient, url: str, shape: AgentCacheShape, model: str
) -> tuple[Turn, ...]:
    """Hold the conversation with `model` at `url` (`/v1/messages`), one turn at a time."""
    conversation = Conversation(shape, model)
    turns: list[Turn] = []
    for turn in range(shape.turns):
        began = time.perf_counter()
        response = await client.post(
            url,
            content=conversation.request(),
            headers={"content-type": "application/json", "anthropic-version": "2023-06-01"},
        )
        seconds = time.perf_counter() - began
        if response.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {response.status_code}: {response.text[:300]}")
        message = _decode_message(response.content)
        usage = message.usage
        cached = usage.cache_read_input_tokens
        prompt = usage.input_tokens + cached + usage.cache_creation_input_tokens
        turns.append(Turn(seconds=seconds, prompt_tokens=prompt, cached_tokens=cached))
        conversation.answered(turn, "".join(block.text for block in message.content))
    return tuple(turns)


async def measure_agent_cache(shape: AgentCacheShape, workdir: Path) -> AgentCacheMeasurement:
    """Start the prefix-cache upstream and IOP, hold the conversation with the block
    removed and then kept, stop them. The caller owns the deadline."""
    models = [
        {"id": STRIPPED, "providers": {PROVIDER_ID: SERVED_MODEL}},
        {
            "id": AS_SENT,
            "providers": {PROVIDER_ID: SERVED_MODEL},
            "generation": {"strip_agent_attribution": False},
        },
    ]
    async with trio.open_nursery() as services:
        upstream = await start_upstream(
            services,
            "--prefill-us-per-token", f"{shape.prefill_us:g}",
            "--cached-prefill-us-per-token", f"{shape.cached_us:g}",
        )  # fmt: skip
        gateway = await start_gateway(services, upstream.ready, workdir, extra_models=models)
        url = gateway.openai_url.rstrip("/") + "/v1/messages"
        async with httpx2.AsyncClient(timeout=_TIMEOUT_S) as client:
            stripped = await converse(client, url, shape, STRIPPED)
            as_sent = await converse(client, url, shape, AS_SENT)
        services.cancel_scope.cancel()
    return AgentCacheMeasurement(shape=shape, stripped=stripped, as_sent=as_sent)
