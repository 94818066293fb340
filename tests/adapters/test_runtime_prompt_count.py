"""The usage of a run whose upstream reported none: its prompt is counted by the runtime's
own tokenizer when the runtime has one (plus the chat template's share), else estimated.
The runner and a real adapter against the fake upstream, as the Node runs them."""

from __future__ import annotations

import json
from typing import Any

import trio

from iop_node.runs.runner import Outbound, RunHandle, execute_run
from schemas.tokens import estimate_input_tokens, template_tokens
from schemas.wire import Run, RunDone
from tests.timing import GUARD_S

from .conftest import MODEL, MakeAdapter
from .fake_upstream import FakeUpstream

BODY: dict[str, Any] = {
    "model": MODEL,
    "stream": True,
    "messages": [
        {"role": "system", "content": "answer in one short line"},
        {"role": "user", "content": "what is the capital of France"},
    ],
}
#: The fake tokenizer counts words: 5 + 6.
WORDS = sum(len(str(m["content"]).split()) for m in BODY["messages"])


async def _usage_of_a_stream(adapter: Any, body: dict[str, Any] = BODY) -> RunDone:
    run = Run(
        run_id="r1",
        provider_id="p1",
        target=MODEL,
        operation="chat",
        body=json.dumps(body).encode(),
        stream=True,
    )
    sent: list[Outbound] = []

    async def send(message: Outbound) -> None:
        sent.append(message)

    with trio.fail_after(GUARD_S):
        await execute_run(run, adapter, RunHandle("r1"), send)
    done = sent[-1]
    assert isinstance(done, RunDone), done
    return done


async def test_a_runtime_with_a_tokenizer_counts_the_prompt(
    nursery: trio.Nursery, make_adapter: MakeAdapter
) -> None:
    llama = FakeUpstream(ignore_stream_options=True, tokenizer="llama_cpp")
    await nursery.start(llama.serve)
    done = await _usage_of_a_stream(make_adapter(llama.base_url))
    assert done.usage_source == "estimated"  # the upstream reported none
    assert done.usage.prompt_tokens == WORDS + template_tokens(BODY)
    assert [r.path for r in llama.requests][-1] == "/tokenize"  # after the run, not before


async def test_without_a_tokenizer_the_prompt_is_estimated(
    nursery: trio.Nursery, make_adapter: MakeAdapter
) -> None:
    plain = FakeUpstream(ignore_stream_options=True)
    await nursery.start(plain.serve)
    done = await _usage_of_a_stream(make_adapter(plain.base_url))
    assert done.usage_source == "estimated"
    assert done.usage.prompt_tokens == estimate_input_tokens(BODY)


async def test_a_runtime_that_reports_usage_is_not_asked_to_count(
    nursery: trio.Nursery, make_adapter: MakeAdapter
) -> None:
    vllm = FakeUpstream(tokenizer="vllm")
    await nursery.start(vllm.serve)
    body = {**BODY, "stream_options": {"include_usage": True}}
    done = await _usage_of_a_stream(make_adapter(vllm.base_url), body)
    assert done.usage_source == "provider"
    assert all(r.path != "/tokenize" for r in vllm.requests)
