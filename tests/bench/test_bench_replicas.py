"""`python -m bench --replicas` works end to end: both set-ups start as real processes
(one Edge; two replicas sharing the caller port, each Node linked to both), serve every
request of a tiny run, and the table has a row for each. No timing is asserted."""

from __future__ import annotations

import io
from pathlib import Path

import trio
from rich.console import Console

from bench.load import Budget, Scenario
from bench.replicas import render_replicas, run_replicas_bench

SMOKE_GUARD_S = 120


async def test_a_tiny_replicas_run(tmp_path: Path) -> None:
    lines: list[str] = []
    with trio.fail_after(SMOKE_GUARD_S):
        setups = await run_replicas_bench(
            [Scenario(concurrency=4, stream=False)],
            Budget(requests=8, warmup_requests=4),
            tmp_path,
            lines.append,
            rounds=1,
        )
    assert [setup.name for setup in setups] == ["one Edge", "2 replicas"]
    for setup in setups:
        assert (setup.measurement.ok, setup.measurement.errors) == (8, 0)
    assert set(setups[1].cpu_s) >= {"edge 1", "edge 2", "nodes", "upstream", "load"}
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render_replicas(setups, cores=2))
    output = console.file
    assert isinstance(output, io.StringIO)
    text = output.getvalue()
    assert "one Edge" in text and "2 replicas" in text and "1.00x" in text
