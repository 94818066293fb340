"""The `sim` provider serving Anthropic Messages and OpenAI Responses: it speaks chat only,
so the Node translates every such run (design §14), stream events included."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import trio
import trio.testing

from iop_node.adapters.sim.adapter import SimAdapter
from iop_node.health import HealthMonitor
from iop_node.protocols import messages_request_to_chat, responses_request_to_chat
from iop_node.runs.protocol_run import estimate_prompt_tokens
from iop_node.runs.runner import Chunk, Outbound, RunHandle, execute_run
from schemas.config import AdapterSettings, ProviderConfig
from schemas.tokens import estimate_input_tokens, template_tokens, text_tokens
from schemas.wire import FailureCode, Operation, ProviderStatus, Run, RunDone, RunFailed, Usage
from tests.node_runs import run_to_end, sse_events
from tests.timing import GUARD_S

ALIAS = "claude-local"
MAX_TOKENS = 4
SIM = ProviderConfig(
    id="sim-1",
    type="sim",
    models=["sim-small"],
    capacity=4,
    adapter=AdapterSettings(ttft_ms=1, tokens_per_second=1000),
)
MESSAGES: dict[str, Any] = {
    "model": "sim-small",
    "max_tokens": MAX_TOKENS,
    "system": [{"type": "text", "text": "You are terse."}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
}
RESPONSES: dict[str, Any] = {
    "model": "sim-small",
    "max_output_tokens": MAX_TOKENS,
    "instructions": "You are terse.",
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
}


def make_run(
    operation: Operation,
    body: dict[str, Any],
    *,
    stream: bool = False,
    keep_output: bool = False,
) -> Run:
    return Run(
        run_id="r1",
        provider_id="sim-1",
        target="sim-small",
        operation=operation,
        body=msgspec.json.encode({**body, "stream": stream} if stream else body),
        stream=stream,
        reply_model=ALIAS,
        request_id="req_7",
        keep_output=keep_output,
    )


async def execute(run: Run) -> tuple[list[bytes], RunDone | RunFailed]:
    return await run_to_end(SimAdapter(SIM), run)


def sim_usage(chat_body: bytes) -> Usage:
    """What the sim reports: the estimator's prompt tokens, `MAX_TOKENS` generated."""
    prompt = estimate_input_tokens(json.loads(chat_body))
    return Usage(
        prompt_tokens=prompt, completion_tokens=MAX_TOKENS, total_tokens=prompt + MAX_TOKENS
    )


# --- Messages -------------------------------------------------------------------------------


async def test_messages_non_stream() -> None:
    chunks, end = await execute(make_run("messages", MESSAGES))
    assert chunks == []
    assert isinstance(end, RunDone) and end.response is not None
    message = json.loads(end.response)
    assert (message["type"], message["id"], message["model"]) == ("message", "msg_req_7", ALIAS)
    [block] = message["content"]
    assert block["type"] == "text" and len(block["text"].split()) == MAX_TOKENS
    assert message["stop_reason"] == "max_tokens"  # the sim always stops at the length
    usage = sim_usage(messages_request_to_chat(make_run("messages", MESSAGES).body))
    assert (end.usage, end.usage_source) == (usage, "provider")
    assert message["usage"]["input_tokens"] == usage.prompt_tokens
    assert message["usage"]["output_tokens"] == MAX_TOKENS


async def test_messages_stream_events_arrive_as_the_sim_generates() -> None:
    chunks, end = await execute(make_run("messages", MESSAGES, stream=True))
    events = sse_events(chunks)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * MAX_TOKENS,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    # One delta per token, each its own chunk: the stream is relayed as it is made.
    assert len(chunks) >= MAX_TOKENS
    assert events[0][1]["message"]["model"] == ALIAS
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2][1]["usage"]["output_tokens"] == MAX_TOKENS
    assert isinstance(end, RunDone)
    assert end.response is None  # a stream's result went out as events
    chat = messages_request_to_chat(make_run("messages", MESSAGES, stream=True).body)
    assert (end.usage, end.usage_source) == (sim_usage(chat), "provider")


# --- Responses ------------------------------------------------------------------------------


async def test_responses_non_stream() -> None:
    _, end = await execute(make_run("responses", RESPONSES))
    assert isinstance(end, RunDone) and end.response is not None
    response = json.loads(end.response)
    assert (response["object"], response["id"], response["model"]) == (
        "response",
        "resp_req_7",
        ALIAS,
    )
    assert response["status"] == "incomplete"  # stopped at `max_output_tokens`
    assert response["instructions"] == "You are terse."
    [item] = response["output"]
    assert item["type"] == "message"
    assert len(item["content"][0]["text"].split()) == MAX_TOKENS
    usage = sim_usage(responses_request_to_chat(make_run("responses", RESPONSES).body))
    assert end.usage == usage
    assert response["usage"]["input_tokens"] == usage.prompt_tokens


async def test_responses_stream_keeps_the_final_response_when_asked() -> None:
    chunks, end = await execute(make_run("responses", RESPONSES, stream=True, keep_output=True))
    events = sse_events(chunks)
    assert [name for name, _ in events[:2]] == ["response.created", "response.in_progress"]
    assert [value["sequence_number"] for _, value in events] == list(range(len(events)))
    deltas = [value["delta"] for name, value in events if name == "response.output_text.delta"]
    assert len(deltas) == MAX_TOKENS
    last_name, last = events[-1]
    assert last_name == "response.incomplete"
    assert isinstance(end, RunDone) and end.response is not None
    assert json.loads(end.response) == last["response"]
    assert last["response"]["output"][0]["content"][0]["text"] == "".join(deltas)


async def test_a_stream_without_keep_output_returns_no_response() -> None:
    _, end = await execute(make_run("responses", RESPONSES, stream=True))
    assert isinstance(end, RunDone) and end.response is None


# --- what cannot be translated --------------------------------------------------------------


async def test_an_untranslatable_request_is_an_invalid_request_naming_the_field() -> None:
    body = {**RESPONSES, "background": True}
    chunks, end = await execute(make_run("responses", body, stream=True))
    assert chunks == []
    assert isinstance(end, RunFailed)
    assert (end.code, end.status, end.retryable) == (FailureCode.INVALID_REQUEST, 400, False)
    assert end.param == "background"
    assert end.message.startswith("background: ")


async def test_a_body_that_is_not_json_is_an_invalid_request() -> None:
    run = msgspec.structs.replace(make_run("messages", MESSAGES), body=b"{not json")
    _, end = await execute(run)
    assert isinstance(end, RunFailed)
    assert (end.code, end.status) == (FailureCode.INVALID_REQUEST, 400)


# --- usage of a run cut short ---------------------------------------------------------------


async def test_a_cancelled_stream_is_estimated_from_what_went_out() -> None:
    handle = RunHandle("r1")
    run = make_run("messages", {**MESSAGES, "max_tokens": 1000}, stream=True)
    sent: list[Outbound] = []

    async def send(message: Outbound) -> None:
        sent.append(message)
        deltas = b"".join(m.data for m in sent if isinstance(m, Chunk)).count(b"text_delta")
        if deltas == 3:
            handle.cancel(FailureCode.CANCELLED, "caller went away")

    with trio.fail_after(GUARD_S):
        await execute_run(run, SimAdapter(SIM), handle, send)
    end = sent[-1]
    assert isinstance(end, RunFailed) and end.code == FailureCode.CANCELLED
    # Prompt tokens: over the request as the runtime read it (translated to chat).
    prompt = estimate_input_tokens(json.loads(messages_request_to_chat(run.body)))
    assert estimate_prompt_tokens(run) == prompt
    assert end.usage is not None and end.usage_source == "estimated"
    assert end.usage.prompt_tokens == prompt
    assert end.usage.completion_tokens == 3


# --- count_tokens ---------------------------------------------------------------------------


async def test_count_tokens_on_the_sim_is_the_estimate() -> None:
    tools = [
        {
            "name": "read_file",
            "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
    ]
    body = {**MESSAGES, "tools": tools}
    del body["max_tokens"]  # a count_tokens request has none
    chunks, end = await execute(make_run("count_tokens", body))
    assert chunks == []
    assert isinstance(end, RunDone) and end.response is not None
    rendered = "\n".join(
        [
            "read_file",
            "Read a file",
            json.dumps(tools[0]["input_schema"], separators=(",", ":")),
            "system",
            "You are terse.",
            "user",
            "Say hello.",
        ]
    )
    chat = json.loads(messages_request_to_chat(make_run("count_tokens", body).body))
    expected = text_tokens(rendered) + template_tokens(chat)
    assert json.loads(end.response) == {"input_tokens": expected}
    assert (end.usage, end.usage_source) == (Usage(), "estimated")


async def test_the_sim_reports_that_it_speaks_chat_only() -> None:
    reports: list[list[ProviderStatus]] = []

    async def report(statuses: list[ProviderStatus], probed: list[str]) -> None:
        reports.append(statuses)

    async with trio.open_nursery() as nursery:
        await nursery.start(HealthMonitor({"sim-1": SimAdapter(SIM)}, report).run)
        nursery.cancel_scope.cancel()
    assert [status.protocols for status in reports[0]] == [["chat"]]
