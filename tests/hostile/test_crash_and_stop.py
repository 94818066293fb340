"""A killed Edge loses no completed response; a stopped one leaves no caller hanging.

Real `iop-edge serve` processes (SIGKILL, SIGTERM) with an in-process Node; and the
shutdown cut in-process, where every kind of exchange can be watched."""

from __future__ import annotations

import json
import signal
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest
import trio
import yaml

from iop_edge.runtime.metering.usage_ledger.usage import UsageLedger
from iop_node.adapters.sim.adapter import MAX_TOKENS
from tests.e2e.stack import Stack, start_stack
from tests.hostile.served_edge import (
    LONG_STREAM,
    MESSAGES,
    SLOW_SIM,
    start_edge_with_node,
    write_config,
)


def _ledger(state: Path) -> list[tuple[str, int, str | None]]:
    with sqlite3.connect(state / "usage.sqlite3") as db:
        return list(db.execute("SELECT run_id, status, provider FROM usage"))


async def _complete(http: httpx2.AsyncClient, index: int, completed: list[str]) -> None:
    """One request, read to its very end; its id is noted only then."""
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 8, "stream": index % 2 == 0}
    if body["stream"]:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line]
            assert response.status_code == 200 and lines[-1] == "data: [DONE]"
            completed.append(response.headers["x-request-id"])
    else:
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200
        completed.append(response.headers["x-request-id"])


async def test_every_response_received_before_a_sigkill_is_in_the_ledger(tmp_path: Path) -> None:
    config = write_config(tmp_path, adapter={"ttft_ms": 0, "tokens_per_second": 50_000})
    completed: list[str] = []
    async with trio.open_nursery() as nursery:
        edge = await start_edge_with_node(nursery, config)
        async with httpx2.AsyncClient(base_url=edge.urls["openai"], timeout=30) as http:
            async with trio.open_nursery() as load:
                for index in range(80):
                    load.start_soon(_complete, http, index, completed)
            edge.process.send_signal(signal.SIGKILL)  # within a batch window of the last response
        assert await edge.process.wait() == -signal.SIGKILL
        nursery.cancel_scope.cancel()
    state = tmp_path / "state"
    unwritten = set(completed) - {row[0] for row in _ledger(state)}
    # The next start of an Edge on this state_dir replays its journal.
    ledger = UsageLedger(state / "usage.sqlite3")
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        assert ledger.statistics().replayed >= len(unwritten)
        ledger.close()
        await ledger.wait_stopped()
    rows = [row[0] for row in _ledger(state)]
    assert set(completed) <= set(rows)
    assert len(rows) == len(set(rows)) == len(completed)  # each once, nothing invented
    assert not list(state.glob("usage-journal-*"))


async def _next_lines(lines: AsyncIterator[str], count: int) -> list[str]:
    """The next `count` non-empty lines of an SSE stream."""
    taken: list[str] = []
    while len(taken) < count:
        line = await anext(lines)
        if line:
            taken.append(line)
    return taken


async def _rest(lines: AsyncIterator[str]) -> list[str]:
    return [line async for line in lines if line]


async def test_sigterm_past_the_grace_period_ends_every_stream_properly(tmp_path: Path) -> None:
    config = write_config(tmp_path, grace_s=0.5, adapter=SLOW_SIM)
    async with trio.open_nursery() as nursery:
        edge = await start_edge_with_node(nursery, config)
        async with (
            httpx2.AsyncClient(base_url=edge.urls["openai"], timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=LONG_STREAM) as first,
            http.stream("POST", "/v1/chat/completions", json=LONG_STREAM) as second,
        ):
            streams = [first.aiter_lines(), second.aiter_lines()]
            for lines in streams:
                await _next_lines(lines, 2)
            edge.process.send_signal(signal.SIGTERM)
            with trio.fail_after(20):
                await edge.wait_for_line("listeners closed; draining in-flight requests")
            # a new caller is refused at once, not left in a queue until the Edge exits
            host, port = edge.urls["openai"].removeprefix("http://").rsplit(":", 1)
            with pytest.raises(OSError):
                await trio.open_tcp_stream(host, int(port))
            for stream in streams:
                lines = await _rest(stream)
                assert lines[-1] == "data: [DONE]", lines[-3:]
                error = json.loads(lines[-2].removeprefix("data: "))["error"]
                assert error["code"] == "shutting_down"
        with trio.fail_after(20):
            assert await edge.process.wait() == 0
        nursery.cancel_scope.cancel()
    statuses = sorted((status, provider) for _, status, provider in _ledger(tmp_path / "state"))
    assert statuses == [(503, "sim-1"), (503, "sim-1")]


async def test_a_caller_that_reads_nothing_does_not_keep_a_stopping_edge_alive(
    tmp_path: Path,
) -> None:
    """Its run is given up (it fell a whole buffer behind), but a write of its reply waits
    on a full socket, shielded; past the grace the Edge closes that connection."""
    fast = {"ttft_ms": 0, "tokens_per_second": 1_000_000}
    generation = {"max_tokens_limit": MAX_TOKENS}
    config = write_config(tmp_path, grace_s=0.3, adapter=fast, generation=generation)
    async with trio.open_nursery() as nursery:
        edge = await start_edge_with_node(nursery, config)
        body = {"model": "m", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "stream": True}
        request = json.dumps(body).encode()
        host, port = edge.urls["openai"].removeprefix("http://").rsplit(":", 1)
        async with await trio.open_tcp_stream(host, int(port)) as stalled:
            await stalled.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                % (len(request), request)
            )  # and never read
            with trio.fail_after(20):
                await edge.wait_for_line("caller is not reading")
            edge.process.send_signal(signal.SIGTERM)
            with trio.fail_after(20):
                assert await edge.process.wait() == 0
        nursery.cancel_scope.cancel()


async def test_the_cut_answers_every_kind_of_exchange(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """In-process, with a stream, a non-stream run and a queued request in flight."""
    config = yaml.safe_load(
        write_config(tmp_path, grace_s=0.3, capacity=2, adapter=SLOW_SIM).read_text()
    )
    stack: Stack = await start_stack(
        nursery, yaml.safe_dump(config), tmp_path / "edge.yaml", wait_models=("m",)
    )
    results: dict[str, httpx2.Response] = {}

    async def post(name: str) -> None:
        async with stack.http() as http:
            body = {"model": "m", "messages": MESSAGES, "max_tokens": 500}
            results[name] = await http.post("/v1/chat/completions", json=body)

    async with (
        stack.http() as http,
        http.stream("POST", "/v1/chat/completions", json=LONG_STREAM) as stream,
        trio.open_nursery() as callers,
    ):
        stream_lines = stream.aiter_lines()
        await _next_lines(stream_lines, 1)
        callers.start_soon(post, "running")
        await stack.wait_catalog(lambda c: c["providers"][0]["in_flight"] == 2)
        callers.start_soon(post, "queued")
        await stack.wait_catalog(lambda c: c["models"][0]["queued"] == 1)
        stack.edge.stop()
        lines = await _rest(stream_lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    for name in ("running", "queued"):
        assert results[name].status_code == 503, name
        assert results[name].json()["error"]["code"] == "shutting_down"
        assert results[name].headers["retry-after"] == "1"
    with trio.fail_after(10):
        await stack.edge.ledger.wait_stopped()
    statuses = sorted(status for _, status, _ in _ledger(tmp_path / "state"))
    assert statuses == [503, 503]  # the runs that reached the provider
    metrics = stack.edge.metrics_text().decode().splitlines()
    cut = [
        line
        for line in metrics
        if line.startswith("iop_requests_total{")
        and 'code="shutting_down"' in line
        and 'status="503"' in line
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in cut) == 3  # the queued one too


async def test_stop_now_answers_every_caller_before_the_edge_ends(tmp_path: Path) -> None:
    """A second stop signal (`main`): the runs are cut at once, and the Edge ends only
    once their callers have been told (`Edge.answered`), not with a bare 500."""
    config = write_config(tmp_path, grace_s=60, capacity=1, adapter=SLOW_SIM).read_text()
    results: dict[str, httpx2.Response] = {}
    async with trio.open_nursery() as callers, trio.open_nursery() as serving:
        stack: Stack = await start_stack(
            serving, config, tmp_path / "edge.yaml", wait_models=("m",)
        )

        async def post(name: str) -> None:
            async with stack.http() as http:
                body = {"model": "m", "messages": MESSAGES, "max_tokens": 500}
                results[name] = await http.post("/v1/chat/completions", json=body)

        callers.start_soon(post, "running")
        await stack.wait_catalog(lambda c: c["providers"][0]["in_flight"] == 1)
        callers.start_soon(post, "queued")
        await stack.wait_catalog(lambda c: c["models"][0]["queued"] == 1)
        stack.edge.stop()
        assert stack.edge.stop_now("the Edge was stopped at once") == 2
        with trio.fail_after(10):
            await stack.edge.answered()
        serving.cancel_scope.cancel()  # as `main` ends the process
    for name in ("running", "queued"):
        assert results[name].status_code == 503, (name, results[name].text)
        assert results[name].json()["error"]["code"] == "shutting_down"
        assert results[name].headers["retry-after"] == "1"
