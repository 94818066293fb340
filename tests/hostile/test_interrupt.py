"""Ctrl-C on the real processes: `iop-edge serve`, `iop-edge demo` and `iop-node run` exit
with 130 as a shell reports an interrupted command (SIGTERM, a service manager's stop, is
a clean stop: 0); and runs cut by a second Ctrl-C (stop now) are metered as the Edge's
`shutting_down`, never as callers who left (499 `client_closed`)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx2
import trio

from iop_edge.runtime.metering.usage_ledger.usage import UsageLedger
from schemas.runtime.stop_signal import EXIT_INTERRUPTED
from tests.e2e.processes import REPO, start_edge
from tests.e2e.stack import NODE_TOKEN, WAIT_GUARD_S, one_sim_config, start_stack
from tests.hostile.served_edge import (
    LONG_STREAM,
    SLOW_SIM,
    start_edge_with_node,
    write_config,
)

#: A process given a stop signal exits within this (drain included, nothing in flight).
EXIT_GUARD_S = 20.0


async def _ledger_after_replay(state: Path) -> list[tuple[str, int, str | None]]:
    """The ledger's rows once what the stopped Edge left in its journal is inserted (as
    the next Edge on this `state_dir` does at start-up)."""
    ledger = UsageLedger(state / "usage.sqlite3")
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        ledger.close()
        await ledger.wait_stopped()
    with sqlite3.connect(state / "usage.sqlite3") as db:
        return list(db.execute("SELECT run_id, status, provider FROM usage"))


async def test_ctrl_c_stops_the_edge_with_130_and_sigterm_with_0(tmp_path: Path) -> None:
    for signum, status in ((signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, 0)):
        folder = tmp_path / signum.name
        folder.mkdir()
        async with trio.open_nursery() as nursery:
            edge = await start_edge(nursery, write_config(folder))
            edge.process.send_signal(signum)
            with trio.fail_after(EXIT_GUARD_S):
                assert await edge.process.wait() == status, edge.log
            assert "IOP Edge stopped" in edge.log


async def test_a_second_ctrl_c_tells_the_caller_and_meters_the_run_it_cuts_as_shutting_down(
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, grace_s=60, adapter=SLOW_SIM)
    async with trio.open_nursery() as nursery:
        edge = await start_edge_with_node(nursery, config)
        async with (
            httpx2.AsyncClient(base_url=edge.urls["openai"], timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=LONG_STREAM) as stream,
        ):
            lines = stream.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass  # the run is live: it produced output
            run_id = stream.headers["x-request-id"]
            edge.process.send_signal(signal.SIGINT)
            with trio.fail_after(WAIT_GUARD_S):
                await edge.wait_for_line("SIGINT: stopping")
            edge.process.send_signal(signal.SIGINT)  # stop now
            rest = [line async for line in lines if line]
            with trio.fail_after(EXIT_GUARD_S):
                assert await edge.process.wait() == EXIT_INTERRUPTED, edge.log
        nursery.cancel_scope.cancel()
    assert rest[-1] == "data: [DONE]"
    assert '"shutting_down"' in rest[-2]
    rows = await _ledger_after_replay(tmp_path / "state")
    assert [(rid, status) for rid, status, _ in rows] == [(run_id, 503)], rows


async def test_ctrl_c_stops_the_demo_with_130(tmp_path: Path) -> None:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "iop_edge", "demo", "--ephemeral-ports", "--no-request"],
        cwd=str(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)},
    )
    assert process.stdout is not None
    try:
        output = b""
        with trio.fail_after(EXIT_GUARD_S):
            while b"press Ctrl-C to stop" not in output:
                data = await process.stdout.receive_some()
                assert data, output.decode(errors="replace")
                output += data
            process.send_signal(signal.SIGINT)
            assert await process.wait() == EXIT_INTERRUPTED
    finally:
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(5, shield=True):
                await process.wait()


async def test_ctrl_c_stops_a_node_with_130_and_sigterm_with_0(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await start_stack(nursery, one_sim_config(tmp_path), tmp_path / "edge.yaml", nodes=())
    command = [
        sys.executable,
        "-m",
        "iop_node",
        "run",
        "--edge",
        stack.addresses.node_url,
        "--node-id",
        "node-1",
    ]
    for signum, status in ((signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, 0)):
        process = await trio.lowlevel.open_process(
            command,
            env={**os.environ, "IOP_NODE_TOKEN": NODE_TOKEN},
            stdin=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            await stack.wait_servable("m")
            process.send_signal(signum)
            with trio.fail_after(EXIT_GUARD_S):
                assert await process.wait() == status
            with trio.fail_after(WAIT_GUARD_S):
                while "node-1" in stack.edge.connected_nodes():
                    await stack.edge.wait_pool_change()
        finally:
            if process.returncode is None:
                process.kill()
                with trio.move_on_after(5, shield=True):
                    await process.wait()
