"""Claude Code's beta extras (`anthropic-beta`, `context_management`, `cache_control.ttl`)
reach a native Messages runtime that takes them as they are; one that refuses them (400
"Extra inputs are not permitted") gets the run again without them, and every later run
without them, learned once and logged; a 400 the extras did not cause teaches nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Final

import anthropic
import pytest
import trio

from tests.adapters.fake_upstream import FakeUpstream, RecordedRequest
from tests.e2e.stack import WAIT_GUARD_S, Stack, edge_config, start_stack

BETA: Final = "context-management-2025-06-27,prompt-caching-scope-2026-01-05"
CONTEXT_MANAGEMENT: Final = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
SYSTEM: Final[list[Any]] = [
    {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
]
MESSAGES: Final[list[Any]] = [{"role": "user", "content": "Hello."}]


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> tuple[Stack, dict[str, FakeUpstream]]:
    upstreams = {
        "strict": FakeUpstream(native=frozenset({"messages"}), strict_messages=True),
        "lenient": FakeUpstream(native=frozenset({"messages"})),
        "failing": FakeUpstream(
            native=frozenset({"messages"}),
            status=400,
            error_message="messages.0: Extra inputs are not permitted",
        ),
    }
    providers = [
        {
            "id": name,
            "type": "vllm",
            "models": ["fake-model"],
            "capacity": 2,
            "adapter": {"base_url": await nursery.start(upstream.serve)},
        }
        for name, upstream in upstreams.items()
    ]
    text = edge_config(
        tmp_path / "state",
        providers=providers,
        models=[{"id": f"m-{name}", "providers": {name: "fake-model"}} for name in upstreams],
    )
    models = tuple(f"m-{name}" for name in upstreams)
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=models)
    return stack, upstreams


def _client(stack: Stack) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url, api_key="open", max_retries=0, timeout=WAIT_GUARD_S
    )


async def _ask(client: anthropic.AsyncAnthropic, model: str, *, stream: bool = False) -> str:
    """One Messages turn with Claude Code's extras; the reply's text."""
    options: dict[str, Any] = {
        "model": model,
        "max_tokens": 16,
        "system": SYSTEM,
        "messages": MESSAGES,
        "extra_headers": {"anthropic-beta": BETA},
        "extra_body": {"context_management": CONTEXT_MANAGEMENT},
    }
    if stream:
        async with client.messages.stream(**options) as events:
            final = await events.get_final_message()
    else:
        final = await client.messages.create(**options)
    return "".join(block.text for block in final.content if block.type == "text")


def _sent(upstream: FakeUpstream) -> list[RecordedRequest]:
    return [request for request in upstream.requests if request.path == "/v1/messages"]


def _extras(request: RecordedRequest) -> tuple[str | None, object, object]:
    body = json.loads(request.body)
    return (
        request.headers.get("anthropic-beta"),
        body.get("context_management"),
        body["system"][0]["cache_control"],
    )


WITH_EXTRAS: Final = (BETA, CONTEXT_MANAGEMENT, {"type": "ephemeral", "ttl": "1h"})
WITHOUT: Final = (None, None, {"type": "ephemeral"})


async def test_a_runtime_that_takes_them_gets_them_as_they_are(
    stack: tuple[Stack, dict[str, FakeUpstream]],
) -> None:
    edge, upstreams = stack
    async with _client(edge) as client:
        assert await _ask(client, "m-lenient")
        assert await _ask(client, "m-lenient", stream=True)
    assert [_extras(request) for request in _sent(upstreams["lenient"])] == [WITH_EXTRAS] * 2


async def test_a_runtime_that_refuses_them_gets_the_run_again_without_and_later_runs_too(
    stack: tuple[Stack, dict[str, FakeUpstream]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="iop_node.protocol_support")
    edge, upstreams = stack
    async with _client(edge) as client:
        assert await _ask(client, "m-strict", stream=True)
        # Refused once, taken without them: learned; the next runs go without at once.
        assert [_extras(request) for request in _sent(upstreams["strict"])] == [
            WITH_EXTRAS,
            WITHOUT,
        ]
        assert await _ask(client, "m-strict")
        assert await _ask(client, "m-strict", stream=True)
    assert [_extras(request) for request in _sent(upstreams["strict"])] == [
        WITH_EXTRAS,
        WITHOUT,
        WITHOUT,
        WITHOUT,
    ]
    [line] = [r.getMessage() for r in caplog.records if "beta extras" in r.getMessage()]
    assert "provider strict" in line and "anthropic-beta: Extra inputs" in line


async def test_a_refusal_the_extras_did_not_cause_teaches_nothing(
    stack: tuple[Stack, dict[str, FakeUpstream]],
) -> None:
    edge, upstreams = stack
    async with _client(edge) as client:
        for _ in range(2):
            with pytest.raises(anthropic.BadRequestError, match="Extra inputs are not permitted"):
                await _ask(client, "m-failing")
    # Each run was tried with them, then without: the second try failed the same way, so
    # the next run still carries them.
    assert [_extras(request) for request in _sent(upstreams["failing"])] == [
        WITH_EXTRAS,
        WITHOUT,
        WITH_EXTRAS,
        WITHOUT,
    ]
