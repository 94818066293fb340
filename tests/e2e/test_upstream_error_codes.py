"""Errors callers act on keep their code through the Edge and the Node: an upstream's
refusal reaches the caller with the upstream's `code` and `param` (OpenAI's names, which
clients branch on), and a context overflow is `context_length_exceeded` whether llama.cpp
says so with a 400 or, streamed, with an empty 200."""

from __future__ import annotations

import logging
from typing import Any

import openai
import pytest
import trio

from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.upstreams import (
    ALIAS,
    MakeStack,
    provider_of,
    upstream_provider,
    wait_idle,
)
from tests.timing import GUARD_S

#: llama.cpp's context in these tests (`-c 256`), and a prompt far past it.
CONTEXT = 256
LONG = [{"role": "user", "content": "tell me everything " * 300}]
SHORT = [{"role": "user", "content": "hello there"}]


async def _chat(stack: Any, messages: list[dict[str, str]], *, stream: bool) -> None:
    async with stack.client() as client:
        if not stream:
            await client.chat.completions.create(model=ALIAS, messages=messages)
            return
        response = await client.chat.completions.create(model=ALIAS, messages=messages, stream=True)
        async for _ in response:
            pass


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_context_overflow_is_context_length_exceeded(
    nursery: trio.Nursery, make_stack: MakeStack, stream: bool
) -> None:
    llama = FakeUpstream(context_tokens=CONTEXT)
    stack = await make_stack([upstream_provider("llama", await nursery.start(llama.serve))])
    with trio.fail_after(GUARD_S), pytest.raises(openai.BadRequestError) as caught:
        await _chat(stack, LONG, stream=stream)
    error = caught.value
    assert (error.status_code, error.code, error.param) == (
        400,
        "context_length_exceeded",
        "messages",
    )
    assert f"({CONTEXT} tokens)" in error.message or f"context of {CONTEXT} tokens" in error.message
    entry = provider_of(await stack.catalog(), "llama")
    assert entry["consecutive_failures"] == 0  # the request's fault, not the provider's
    await wait_idle(stack)


async def test_an_empty_stream_within_the_context_is_still_a_broken_stream(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    llama = FakeUpstream(context_tokens=CONTEXT, empty_streams=True)
    stack = await make_stack([upstream_provider("llama", await nursery.start(llama.serve))])
    with trio.fail_after(GUARD_S), pytest.raises(openai.APIStatusError) as caught:
        await _chat(stack, SHORT, stream=True)
    assert caught.value.status_code == 502
    assert "stream ended before [DONE]" in caught.value.message
    await wait_idle(stack)


async def test_an_upstream_refusal_keeps_its_code_and_param(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    strict = FakeUpstream(
        status=400,
        error_message="temperature must be at most 2",
        error_code="invalid_value",
        error_param="temperature",
    )
    stack = await make_stack([upstream_provider("strict", await nursery.start(strict.serve))])
    for stream in (False, True):
        with trio.fail_after(GUARD_S), pytest.raises(openai.BadRequestError) as caught:
            await _chat(stack, SHORT, stream=stream)
        error = caught.value
        assert (error.code, error.param) == ("invalid_value", "temperature")
        assert isinstance(error.body, dict)
        assert error.body["message"] == "temperature must be at most 2"  # the upstream's words
    await wait_idle(stack)


async def test_an_upstream_code_or_param_holding_its_key_reaches_nobody(
    nursery: trio.Nursery, make_stack: MakeStack, caplog: pytest.LogCaptureFixture
) -> None:
    """An upstream that puts the key it was sent in its error's `code` and `param` (or
    anything not shaped like an identifier) has them left out: the caller, the access
    log and the metrics never see the key (`core.caller_text` Rule 5)."""
    key = "sk-upstream-" + "S3CRET" * 4
    echo = FakeUpstream(status=400, error_message="bad", error_code=key, error_param=key)
    stack = await make_stack([upstream_provider("echo", await nursery.start(echo.serve))])
    caplog.set_level(logging.INFO)
    for stream in (False, True):
        with trio.fail_after(GUARD_S), pytest.raises(openai.BadRequestError) as caught:
            await _chat(stack, SHORT, stream=stream)
        assert (caught.value.code, caught.value.param) == ("upstream_rejected", None)
    echo.error_code, echo.error_param = "bad code!", "see http://10.1.2.3:8000/v1"
    with trio.fail_after(GUARD_S), pytest.raises(openai.BadRequestError) as caught:
        await _chat(stack, SHORT, stream=False)
    assert (caught.value.code, caught.value.param) == ("upstream_rejected", None)
    await wait_idle(stack)
    async with stack.admin() as admin:
        metrics = (await admin.get("/metrics")).text
    assert 'code="upstream_rejected"' in metrics
    assert "S3CRET" not in metrics
    assert not [record for record in caplog.records if "S3CRET" in record.getMessage()]


async def test_a_refusal_without_a_code_is_upstream_rejected(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    plain = FakeUpstream(status=400, error_message="no")
    stack = await make_stack([upstream_provider("plain", await nursery.start(plain.serve))])
    with trio.fail_after(GUARD_S), pytest.raises(openai.BadRequestError) as caught:
        await _chat(stack, SHORT, stream=False)
    assert (caught.value.code, caught.value.param) == ("upstream_rejected", None)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_translated_runs_refusal_names_the_callers_field(
    nursery: trio.Nursery, make_stack: MakeStack, stream: bool
) -> None:
    """A Responses caller on a chat-only runtime is told `input`, its own field, where
    the runtime said `messages`; a field both protocols share stays as named."""
    llama = FakeUpstream(context_tokens=CONTEXT)
    strict = FakeUpstream(
        status=400,
        error_message="temperature must be at most 2",
        error_code="invalid_value",
        error_param="temperature",
    )
    stack = await make_stack(
        [upstream_provider("llama", await nursery.start(llama.serve), protocols=["chat"])]
    )
    other = await make_stack(
        [upstream_provider("strict", await nursery.start(strict.serve), protocols=["chat"])]
    )
    found: list[tuple[str | None, str | None]] = []
    for target, text in ((stack, LONG[0]["content"]), (other, SHORT[0]["content"])):
        async with target.client() as client:
            with trio.fail_after(GUARD_S), pytest.raises(openai.BadRequestError) as caught:
                if stream:
                    async for _ in await client.responses.create(
                        model=ALIAS, input=text, stream=True
                    ):
                        pass
                else:
                    await client.responses.create(model=ALIAS, input=text)
        found.append((caught.value.code, caught.value.param))
    assert found == [("context_length_exceeded", "input"), ("invalid_value", "temperature")]
    await wait_idle(stack)
