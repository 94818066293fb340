"""A caller that leaves at any stage still leaves a record (design §7):
queued, dispatched before the first event (stream or not), or mid-stream."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
import trio.testing

from tests.e2e.stack import Stack, edge_config, sim_provider, start_stack
from tests.timing import GUARD_S

MESSAGES = [{"role": "user", "content": "hi"}]


async def _stack(nursery: trio.Nursery, tmp_path: Path, **adapter: Any) -> Stack:
    text = edge_config(
        tmp_path,
        providers=[sim_provider("sim-1", capacity=1, adapter=adapter)],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


async def _rows(stack: Stack) -> list[tuple[int, str, str | None]]:
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    with sqlite3.connect(stack.edge.ledger.path) as db:
        return list(db.execute("SELECT status, provider, node FROM usage"))


async def _leave_when(
    stack: Stack,
    body: dict[str, Any],
    ready: Callable[[dict[str, Any]], bool],
    chunks: int = 0,
    gone: Callable[[dict[str, Any]], bool] = lambda c: c["providers"][0]["in_flight"] == 0,
) -> None:
    """Send `body`, read `chunks` stream lines, leave once the catalog says `ready`."""
    async with trio.open_nursery() as nursery:

        async def call() -> None:
            async with (
                httpx2.AsyncClient(base_url=stack.addresses.openai_url, timeout=30) as http,
                http.stream("POST", "/v1/chat/completions", json=body) as response,
            ):
                lines = response.aiter_lines()
                for _ in range(chunks):
                    while not await anext(lines):
                        pass
                await trio.sleep_forever()

        nursery.start_soon(call)
        await stack.wait_catalog(ready)
        if chunks:  # the caller must have its chunks before it leaves
            await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()  # the caller hangs up
    await stack.wait_catalog(gone)


def _in_flight(c: dict[str, Any]) -> bool:
    return bool(c["providers"][0]["in_flight"] == 1)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_leaving_before_the_first_event_is_metered(
    nursery: trio.Nursery, tmp_path: Path, stream: bool
) -> None:
    stack = await _stack(nursery, tmp_path, ttft_ms=60_000)  # the first event never comes
    body = {"model": "m", "messages": MESSAGES, "stream": stream}
    await _leave_when(stack, body, _in_flight)
    assert await _rows(stack) == [(499, "sim-1", "node-1")]


async def test_leaving_a_non_stream_run_mid_generation_is_metered(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path, ttft_ms=0, tokens_per_second=20)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 500}
    await _leave_when(stack, body, _in_flight)
    assert await _rows(stack) == [(499, "sim-1", "node-1")]


async def test_leaving_mid_stream_is_metered(nursery: trio.Nursery, tmp_path: Path) -> None:
    stack = await _stack(nursery, tmp_path, ttft_ms=0, tokens_per_second=20)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 500, "stream": True}
    await _leave_when(stack, body, _in_flight, chunks=2)
    assert await _rows(stack) == [(499, "sim-1", "node-1")]


async def test_leaving_the_queue_is_counted_but_bills_nothing(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path, ttft_ms=60_000)
    body = {"model": "m", "messages": MESSAGES}
    async with trio.open_nursery() as holder:

        async def hold_the_only_slot() -> None:
            async with stack.http() as http:
                await http.post("/v1/chat/completions", json=body)

        holder.start_soon(hold_the_only_slot)
        await stack.wait_catalog(_in_flight)
        await _leave_when(
            stack,
            {**body, "stream": True},
            ready=lambda c: c["models"][0]["queued"] == 1,
            gone=lambda c: c["models"][0]["queued"] == 0,
        )
        holder.cancel_scope.cancel()
    await stack.wait_catalog(lambda c: c["providers"][0]["in_flight"] == 0)
    # The holder left too (its run reached the provider); the queued caller left no row.
    assert await _rows(stack) == [(499, "sim-1", "node-1")]
    metrics = stack.edge.metrics_text().decode().splitlines()
    assert any(
        line.startswith("iop_requests_total{")
        and 'provider=""' in line
        and 'status="499"' in line
        and line.endswith(" 1.0")
        for line in metrics
    )
