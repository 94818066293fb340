"""The soak's reliability phases: the scripted runtime they misbehave with, and how
each phase judges its books (the phases themselves run real processes: `just soak`)."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
import trio

from bench.hostile_upstream import (
    FAIL_MARK,
    MALFORMED_TOOL,
    REUSED_ID,
    SERVED,
    HostileUpstream,
    turn_text,
)
from bench.soak_budgets import BUDGET, REPLICAS
from bench.soak_budgets import _report as budget_report
from bench.soak_fairness import WINDOW_S, _Books
from bench.soak_fairness import _report as fairness_report
from bench.soak_stack import error_code
from tests.timing import GUARD_S

ASK = [{"role": "user", "content": "hello"}]


async def _post(url: str, path: str, body: dict[str, Any]) -> httpx2.Response:
    async with httpx2.AsyncClient(base_url=url, timeout=GUARD_S) as http:
        return await http.post(path, json=body)


async def test_the_scripted_runtime_misbehaves_as_it_says(nursery: trio.Nursery) -> None:
    runtime = HostileUpstream(nursery)
    base = await runtime.start()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    shape = {"messages": ASK, "stream": True, "tools": tools, "tool_choice": "auto"}
    empty = await _post(base, "/chat/completions", shape)
    assert (empty.status_code, empty.content) == (200, b"")
    malformed = [{"type": "function", "function": {"name": MALFORMED_TOOL, "parameters": {}}}]
    call = await _post(base, "/chat/completions", {"messages": ASK, "stream": True,
                                                   "tools": malformed})  # fmt: skip
    pieces = [
        json.loads(line.removeprefix("data: "))
        for line in call.text.splitlines()
        if line.startswith("data: {")
    ]
    arguments = "".join(
        tc["function"].get("arguments", "")
        for piece in pieces
        for choice in piece["choices"]
        for tc in choice["delta"].get("tool_calls", [])
    )
    with pytest.raises(ValueError):
        json.loads(arguments)
    failed = await _post(base, "/chat/completions", {"messages": [{"content": FAIL_MARK}]})
    assert failed.status_code == 500 and runtime.root in failed.text
    answered = await _post(base, "/chat/completions", {"messages": ASK})
    assert answered.json()["choices"][0]["message"]["content"] == "ok then"
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}]  # fmt: skip
    response = (await _post(base, "/responses", {"model": SERVED, "input": turns})).json()
    assert response["id"] == REUSED_ID
    assert response["output"][0]["content"][0]["text"] == turn_text(2)


async def test_the_scripted_runtime_comes_back_on_its_port(nursery: trio.Nursery) -> None:
    runtime = HostileUpstream(nursery)
    base = await runtime.start()
    await runtime.stop()
    with pytest.raises(httpx2.ConnectError):
        await _post(base, "/chat/completions", {"messages": ASK})
    assert await runtime.start() == base
    assert (await _post(base, "/chat/completions", {"messages": ASK})).status_code == 200


def _ends(admitted: list[int], refused: int, code: str = "budget_exceeded") -> Any:
    ends = [(index % REPLICAS, 200, "", tokens) for index, tokens in enumerate(admitted)]
    return ends + [(0, 429, code, 0)] * refused


@pytest.mark.parametrize(
    ("ends", "verdict"),
    [
        (_ends([210] * 20, 40), "held"),  # 4,200 <= 4,000 + 2 x 210
        (_ends([210] * 22, 38), "FAILED"),  # 4,620: past one request per replica
        (_ends([210] * 20, 40, "rate_limit_tokens"), "FAILED"),  # not the budget's refusal
        ([(0, 200, "", 210)] * 19 + [(0, 429, "budget_exceeded", 0)], "FAILED"),  # one Edge
    ],
)
def test_the_budget_phase_holds_at_one_request_per_replica_over(ends: Any, verdict: str) -> None:
    assert sum(tokens for *_, tokens in ends) > 0 and BUDGET == 4_000
    assert budget_report(ends).state == verdict


@pytest.mark.parametrize(
    ("huge_s", "small_s", "verdict"),
    [(30.0, 25.0, "held"), (25.0, 30.0, "held"), (46.0, 14.0, "FAILED"), (0.0, 50.0, "FAILED")],
)
def test_the_fairness_phase_holds_within_one_and_a_half(
    huge_s: float, small_s: float, verdict: str
) -> None:
    books = _Books(window=(0.0, WINDOW_S))
    books.held = {"huge": huge_s, "small": small_s}
    books.small_waits = [0.3, 0.5]
    assert fairness_report(books).state == verdict


def test_an_error_body_says_its_code_in_either_protocol() -> None:
    assert error_code(b'{"error": {"code": "budget_exceeded", "type": "x"}}') == "budget_exceeded"
    assert error_code(b'{"type": "error", "error": {"type": "rate_limit_error"}}') == (
        "rate_limit_error"
    )
    assert error_code(b"not json") == "?"
