"""A caller that hangs up the instant it reads a stream's last event left a completed run.

Codex CLI closes its connection as soon as `response.completed` arrives, and an Anthropic
client may do the same at `message_stop`. Those events tell the caller the reply is
whole, so the Edge must have recorded the run's end before they reach the caller: the
Node holds them back and sends them inside its `run_done` (`tail`), and the Edge writes
them only after metering the run (design §3, §14). Otherwise the caller's hang-up races
the Node's report of the end, and a whole reply is metered as 499 `client_closed` with
estimated tokens.

The caller here is a raw HTTP/1.1 client that closes its socket the moment the last
event is in. The fake upstream keeps its body open after its last event until every task
of the test is blocked (`before_end`): a Node that sent the last event ahead of the end
gives that caller all the time it needs to hang up first, so the race is decided the same
way on every run, not by scheduling luck. Native (the fake speaks the protocol) and
translated (the fake speaks chat only) alike.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any, Final

import h11
import pytest
import trio
import trio.testing

from tests.adapters.fake_data import PROMPT_TOKENS
from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import Stack
from tests.e2e.upstreams import ALIAS, MakeStack, upstream_provider, wait_idle
from tests.timing import GUARD_S

CHUNKS: Final = 4
#: The event that tells a caller of each protocol that its reply is whole.
LAST_EVENT: Final = {"messages": b"message_stop", "responses": b"response.completed"}
BODIES: Final[dict[str, dict[str, Any]]] = {
    "messages": {
        "model": ALIAS,
        "max_tokens": 32,
        "stream": True,
        "messages": [{"role": "user", "content": "hello there"}],
    },
    "responses": {"model": ALIAS, "input": "hello there", "stream": True, "store": False},
}


async def _settle() -> None:
    """Hold the upstream's end of body until nothing else in the test can move."""
    await trio.testing.wait_all_tasks_blocked()


async def _stack(make_stack: MakeStack, nursery: trio.Nursery, protocol: str, path: str) -> Stack:
    native = path == "native"
    fake = FakeUpstream(
        chunks=CHUNKS, native=frozenset({protocol}) if native else frozenset(), before_end=_settle
    )
    base_url = await nursery.start(fake.serve)
    protocols = ["chat", protocol] if native else ["chat"]
    return await make_stack([upstream_provider("gpu", base_url, protocols=protocols)])


async def _read_until_last_event(stack: Stack, protocol: str) -> list[tuple[str, Any]]:
    """POST a stream and hang up the moment its last event is in; the events read."""
    body = json.dumps(BODIES[protocol]).encode()
    host, port = stack.addresses.openai_url.removeprefix("http://").split("/")[0].split(":")
    headers = [
        ("host", f"{host}:{port}"),
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        ("anthropic-version", "2023-06-01"),
    ]
    target = b"/v1/" + protocol.encode()
    connection = h11.Connection(h11.CLIENT)
    received = b""
    marker = b"event: " + LAST_EVENT[protocol] + b"\ndata: "
    stream = await trio.open_tcp_stream(host, int(port))
    try:
        await stream.send_all(
            connection.send(h11.Request(method="POST", target=target, headers=headers))
            + connection.send(h11.Data(data=body))
            + connection.send(h11.EndOfMessage())
        )
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                assert data, f"the stream ended before its {LAST_EVENT[protocol]!r} event"
                connection.receive_data(data)
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
            elif isinstance(event, h11.Data):
                received += event.data
                at = received.find(marker)
                if at >= 0 and received.find(b"\n\n", at) >= 0:
                    break
            else:
                raise AssertionError(f"unexpected {event!r} before the last event")
    finally:
        await stream.aclose()  # at once: the caller has all it wanted
    events = []
    for block in received.strip().split(b"\n\n"):
        name, data = block.split(b"\n", 1)
        events.append((name.removeprefix(b"event: ").decode(), json.loads(data[6:])))
    return events


async def _ledger(stack: Stack) -> list[dict[str, Any]]:
    await wait_idle(stack)
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    with sqlite3.connect(stack.edge.ledger.path) as db:
        db.row_factory = sqlite3.Row
        return [dict(row) for row in db.execute("SELECT * FROM usage ORDER BY time")]


@pytest.mark.parametrize("path", ["native", "translated"])
@pytest.mark.parametrize("protocol", ["messages", "responses"])
async def test_a_caller_that_hangs_up_at_the_last_event_got_a_completed_run(
    nursery: trio.Nursery, make_stack: MakeStack, protocol: str, path: str
) -> None:
    stack = await _stack(make_stack, nursery, protocol, path)
    with trio.fail_after(GUARD_S):
        events = await _read_until_last_event(stack, protocol)
    names = [name for name, _ in events]
    assert names[-1] == LAST_EVENT[protocol].decode() and names.count(names[-1]) == 1
    if protocol == "messages":
        assert names[-2] == "message_delta"  # with the usage and the stop reason
        assert events[-2][1]["usage"]["output_tokens"] == CHUNKS
    else:
        assert events[-1][1]["response"]["usage"]["output_tokens"] == CHUNKS
    [record] = await _ledger(stack)
    assert (record["status"], record["usage_source"]) == (200, "provider")
    assert record["protocol"] == protocol
    assert (record["prompt_tokens"], record["completion_tokens"]) == (PROMPT_TOKENS, CHUNKS)
