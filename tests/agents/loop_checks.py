"""What a completed tool-use loop through IOP must leave behind, whichever agent ran it.

An agent printing the final text is necessary but not enough; these checks pin the rest
of the path:

- the runtime saw the run in the protocol the path implies (the agent's own natively,
  chat completions when translated) and under the served model name, never the alias;
- exactly one tool call went out, and its result came back to the runtime under the same
  call id with the shell's output, through both translations where there are two;
- natively, the caller's `anthropic-*` headers reached the runtime unchanged;
- the Edge metered every run once, in the agent's protocol, for the agent's token, and
  logged an access line for each with that protocol.
"""

from __future__ import annotations

import json
import logging

import pytest

from schemas.runtime.log_lines import JsonLinesFormatter
from tests.agents.agent_stack import SERVED, TOKEN_REF, AgentStack
from tests.agents.clis import Outcome
from tests.agents.script import DONE, MARKER, Call, Protocol, Text

FINAL_TEXT = f"{DONE} {MARKER}"


def check_output(outcome: Outcome) -> None:
    """The CLI ended well and showed the final text, which quotes the tool's output."""
    assert outcome.returncode == 0, outcome.report()
    assert FINAL_TEXT in outcome.stdout, outcome.report()


def check_upstream(agent: AgentStack, protocol: Protocol, outcome: Outcome) -> None:
    upstream = agent.upstream
    runs = upstream.inference()
    wire = protocol if agent.path == "native" else "chat"
    seen = [(ex.method, ex.path, ex.status) for ex in upstream.exchanges]
    assert runs, f"no inference request reached the runtime: {seen}\n{outcome.report()}"
    assert {ex.protocol for ex in runs} == {wire}, seen
    assert {ex.turn.model for ex in runs if ex.turn is not None} == {SERVED}
    # Every exchange answered, but the Node's question whether a vLLM sleeps, which a
    # runtime without sleep mode answers 404 (as this one does, and is then not asked).
    answered = [ex for ex in upstream.exchanges if ex.path != "/is_sleeping"]
    assert all(ex.status == 200 for ex in answered), seen

    calls = upstream.calls()
    assert len(calls) == 1, f"expected one tool call, the runtime made {len(calls)}: {seen}"
    call = calls[0][1]
    assert isinstance(call, Call)
    results = [
        result
        for ex in runs
        if ex.turn is not None
        for result in ex.turn.tool_results
        if result.call_id == call.call_id
    ]
    assert results, (
        f"no request carried the result of {call.call_id}; the tool results were "
        f"{[ex.turn.tool_results for ex in runs if ex.turn is not None]}"
    )
    assert MARKER in results[-1].text, results[-1]
    finals = [ex.reply for ex in runs if isinstance(ex.reply, Text) and DONE in ex.reply.text]
    assert finals == [Text(FINAL_TEXT)], [ex.reply for ex in runs]

    if agent.path == "native" and protocol == "messages":
        for ex in runs:
            assert ex.headers.get("anthropic-version") == "2023-06-01", ex.headers
            assert "anthropic-beta" in ex.headers, ex.headers


async def check_metering(
    agent: AgentStack, protocol: Protocol, caplog: pytest.LogCaptureFixture
) -> None:
    runs = len(agent.upstream.inference())
    rows = await agent.usage("protocol", "token_ref", "status")
    assert rows == [
        {
            "protocol": protocol,
            "token_ref": TOKEN_REF,
            "status": 200,
            "requests": runs,
            "prompt_tokens": rows[0]["prompt_tokens"] if rows else 0,
            "completion_tokens": rows[0]["completion_tokens"] if rows else 0,
            "cached_tokens": 0,  # the scripted runtime reports no prompt cache
            "estimated_requests": 0,
            "estimated_tokens": 0,
        }
    ], rows
    assert rows[0]["prompt_tokens"] > 0 and rows[0]["completion_tokens"] > 0, rows

    agent.stack.edge.books.settle()  # access lines are written in batches
    formatter = JsonLinesFormatter()
    lines = [
        json.loads(formatter.format(record))
        for record in caplog.records
        if record.name == "iop_edge.access"
    ]
    assert [(line["protocol"], line["status"]) for line in lines] == [(protocol, 200)] * runs


def watch_access_log(caplog: pytest.LogCaptureFixture) -> None:
    """Capture the Edge's access lines (call before the agent runs)."""
    caplog.set_level(logging.INFO, logger="iop_edge.access")
