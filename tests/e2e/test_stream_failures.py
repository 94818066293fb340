"""A Messages or Responses stream that fails after it began ends with the protocol's own
failure event, whoever diagnosed the failure (design §14).

The upstream cuts its connection in the middle of a stream: the Node reports the failure
in `run_failed`, and the Edge, having recorded the run's end, writes Anthropic's
`event: error` or a Responses `response.failed` into the caller's stream, so the official
SDKs raise instead of seeing a stream that merely stops. Native (the fake speaks the
protocol) and translated (the fake speaks chat only) alike.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
import trio

from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import Stack
from tests.e2e.upstreams import ALIAS, MakeStack, upstream_provider
from tests.timing import GUARD_S

CUT_AFTER = 3
PATHS = ("native", "translated")


async def _stack(make_stack: MakeStack, nursery: trio.Nursery, protocol: str, path: str) -> Stack:
    native = path == "native"
    fake = FakeUpstream(
        chunks=8,
        native=frozenset({protocol}) if native else frozenset(),
        drop_after_chunks=CUT_AFTER,
    )
    base_url = await nursery.start(fake.serve)
    protocols = ["chat", protocol] if native else ["chat"]
    return await make_stack([upstream_provider("gpu", base_url, protocols=protocols)])


@pytest.mark.parametrize("path", PATHS)
async def test_a_messages_stream_cut_upstream_ends_with_an_anthropic_error_event(
    make_stack: MakeStack, nursery: trio.Nursery, path: str
) -> None:
    stack = await _stack(make_stack, nursery, "messages", path)
    seen: list[str] = []
    async with anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url, api_key="open", max_retries=0
    ) as client:
        with trio.fail_after(GUARD_S):
            async with client.messages.stream(
                model=ALIAS, max_tokens=32, messages=[{"role": "user", "content": "hi"}]
            ) as stream:
                with pytest.raises(anthropic.APIStatusError) as caught:
                    async for event in stream:
                        seen.append(event.type)
    assert "message_start" in seen and "message_stop" not in seen
    body: Any = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "api_error"
    assert body["error"]["message"].startswith("upstream_stream_error: ")


@pytest.mark.parametrize("path", PATHS)
async def test_a_responses_stream_cut_upstream_ends_with_response_failed(
    make_stack: MakeStack, nursery: trio.Nursery, path: str
) -> None:
    stack = await _stack(make_stack, nursery, "responses", path)
    seen: list[Any] = []
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="open", max_retries=0) as client:
        with trio.fail_after(GUARD_S):
            stream = await client.responses.create(
                model=ALIAS, input="hi", stream=True, store=False
            )
            async for event in stream:
                seen.append(event)
    types = [event.type for event in seen]
    assert types[0] == "response.created"
    assert types[-1] == "response.failed" and "response.completed" not in types
    failed = seen[-1].response
    assert failed.status == "failed"
    # OpenAI's code for it (the SDK knows a fixed set); IOP's own leads the message.
    assert failed.error is not None and failed.error.code == "server_error"
    assert failed.error.message.startswith("upstream_stream_error: ")
