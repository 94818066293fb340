"""A 20-tool-call agent rollout over HTTP and over the Responses WebSocket mode
(`python -m bench.responses_socket`).

Codex, over HTTP, sends every turn of a rollout as a new `POST /v1/responses` with the
whole conversation so far (`store: false`); a client may instead chain stored responses
(`previous_response_id`, `store: true`); over the WebSocket mode it keeps one connection
and sends only each turn's new items with `previous_response_id`, which the Edge
continues from the connection's memory (`iop_edge.http.responses_socket`). The three
are run here against one IOP Edge and Node (each its own process, `bench.gateway`) in
front of the fast fake upstream (`bench.upstream`, which answers Responses natively):

- `http-full`: a new request per turn with the whole conversation, `store: false`;
- `http-chained`: a new request per turn with the new items, `previous_response_id`,
  `store: true` (the Edge loads the conversation from its store);
- `websocket`: one connection, the new items and `previous_response_id`, `store: false`.

Every turn streams. A turn adds the model's reply, a function call and its output (a
tool result of `--result-chars`) to a conversation that begins with Codex-sized
instructions and tools. The modes run in turns (`--rounds`), one rollout each per
round, so a machine whose speed drifts weighs on each alike; the table gives each mode's
median rollout time and its ratio to `http-full`. The IOP runtime is always sent the
whole conversation (the Edge is the store), so what the mode changes is the caller's
side: bytes sent and parsed per turn, a request's setup, the store's reads and writes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import httpx2
import trio
from trio_websocket import open_websocket_url

from bench.gateway import start_gateway
from bench.upstream import MODEL, start_upstream

MODES: Final = ("http-full", "http-chained", "websocket")
_TERMINAL: Final = ("response.completed", "response.incomplete", "response.failed")
_TIMEOUT_S: Final = 300.0


def _instructions() -> str:
    sentence = "Read the surrounding code before changing it, and run the tests after. "
    return sentence * 160  # about 11 KB, as an agent's system prompt


def _tools() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "name": f"tool_{n}",
            "description": "Runs a command in the workspace and returns its output. " * 8,
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}},
                "required": ["cmd"],
            },
        }
        for n in range(12)
    ]


def _new_items(turn: int, result_chars: int) -> list[dict[str, Any]]:
    """A turn's new input: the first turn's user message, or a tool call and its result."""
    if turn == 0:
        return [{"type": "message", "role": "user", "content": "Fix the failing test."}]
    call = f"call_{turn}"
    return [
        {
            "type": "function_call",
            "call_id": call,
            "name": "tool_0",
            "arguments": json.dumps({"cmd": f"sed -n {turn},+40p src/module.py"}),
        },
        {
            "type": "function_call_output",
            "call_id": call,
            "output": (f"{turn}: def function_{turn}(value):  return value + 1\n" * 200)[
                :result_chars
            ],
        },
    ]


def _body(input_items: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "instructions": _instructions(),
        "tools": _tools(),
        "input": input_items,
        "max_output_tokens": 64,
        **extra,
    }


async def _http_turn(client: httpx2.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed HTTP turn: its final response."""
    response = await client.post(url, json={**body, "stream": True})
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    for line in reversed(response.text.splitlines()):
        if line.startswith("data: "):
            event = json.loads(line[6:])
            if event.get("type") in _TERMINAL:
                final: dict[str, Any] = event["response"]
                return final
    raise RuntimeError("the stream ended with no final event")


async def http_full(base: str, turns: int, result_chars: int) -> float:
    conversation: list[dict[str, Any]] = []
    async with httpx2.AsyncClient(timeout=_TIMEOUT_S) as client:
        began = time.perf_counter()
        for turn in range(turns):
            conversation += _new_items(turn, result_chars)
            final = await _http_turn(
                client, base + "/v1/responses", _body(conversation, store=False)
            )
            conversation += final["output"]
        return time.perf_counter() - began


async def http_chained(base: str, turns: int, result_chars: int) -> float:
    previous: dict[str, Any] = {}
    async with httpx2.AsyncClient(timeout=_TIMEOUT_S) as client:
        began = time.perf_counter()
        for turn in range(turns):
            body = _body(_new_items(turn, result_chars), store=True, **previous)
            final = await _http_turn(client, base + "/v1/responses", body)
            previous = {"previous_response_id": final["id"]}
        return time.perf_counter() - began


async def websocket(base: str, turns: int, result_chars: int) -> float:
    previous: dict[str, Any] = {}
    url = base.replace("http://", "ws://") + "/v1/responses"
    began = time.perf_counter()
    async with open_websocket_url(url, max_message_size=64 * 1024 * 1024) as socket:
        for turn in range(turns):
            body = _body(_new_items(turn, result_chars), store=False, **previous)
            await socket.send_message(json.dumps({"type": "response.create", **body}))
            while True:
                event = json.loads(await socket.get_message())
                if event["type"] == "error":
                    raise RuntimeError(f"error event: {event['error']}")
                if event["type"] in _TERMINAL:
                    break
            previous = {"previous_response_id": event["response"]["id"]}
    return time.perf_counter() - began


RUNNERS: Final[dict[str, Callable[[str, int, int], Awaitable[float]]]] = {
    "http-full": http_full,
    "http-chained": http_chained,
    "websocket": websocket,
}


async def measure(
    turns: int, rounds: int, result_chars: int, workdir: Path
) -> dict[str, list[float]]:
    """Each mode's rollout times, `rounds` of each, the modes in turn."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    async with trio.open_nursery() as services:
        with trio.fail_after(60):
            upstream = await start_upstream(services)
            gateway = await start_gateway(services, upstream.ready, workdir)
        base = gateway.openai_url.rstrip("/")
        for mode in MODES:  # a warm-up rollout each, not counted
            await RUNNERS[mode](base, 2, result_chars)
        for _ in range(rounds):
            for mode in MODES:
                times[mode].append(await RUNNERS[mode](base, turns, result_chars))
        services.cancel_scope.cancel()
    return times


def table(times: dict[str, list[float]], turns: int) -> str:
    full = statistics.median(times["http-full"])
    lines = [
        f"| mode ({turns} turns) | median rollout | per turn | vs http-full |",
        "|---|---|---|---|",
    ]
    for mode in MODES:
        median = statistics.median(times[mode])
        lines.append(
            f"| {mode} | {median * 1000:.0f} ms | {median / turns * 1000:.1f} ms "
            f"| {median / full:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.responses_socket", description=__doc__)
    parser.add_argument("--turns", type=int, default=21, help="requests in a rollout (20 calls)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--result-chars", type=int, default=4000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="iop-bench-ws-") as folder:
        times = trio.run(measure, args.turns, args.rounds, args.result_chars, Path(folder))
    print(table(times, args.turns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
