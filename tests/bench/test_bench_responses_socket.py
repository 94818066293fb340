"""The WebSocket rollout bench (`bench.responses_socket`) in a tiny run, on real
processes: every mode completes its rollouts without an error and the table has a row
for each. No timing is asserted (docs/benchmarks.md has the numbers)."""

from __future__ import annotations

from pathlib import Path

from bench.responses_socket import MODES, measure, table


async def test_every_mode_completes_its_rollouts(tmp_path: Path) -> None:
    times = await measure(turns=4, rounds=2, result_chars=200, workdir=tmp_path)
    assert set(times) == set(MODES)
    assert all(len(runs) == 2 and all(t > 0 for t in runs) for runs in times.values())
    rows = table(times, 4).splitlines()
    assert [row.split("|")[1].strip() for row in rows[2:]] == list(MODES)
    assert rows[2].endswith("| 1.00x |")
