"""The benchmark harness works end to end: a tiny run, every scenario on every target.

No timing is asserted (a shared CI machine makes any number noise); what is asserted is
that the harness starts the upstream, the Hypercorn floor, an Edge and a Node as real
processes, drives every target through stream and non-stream scenarios without a single
failed request, skips LiteLLM with a note when it is not installed, and prints the table
with all its rows.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import trio
from rich.console import Console

from bench.load import Budget, Measurement, Scenario, percentile
from bench.report import (
    DIRECT,
    HYPERCORN,
    IOP,
    LITELLM,
    BenchResult,
    Machine,
    check_targets,
    render,
    to_json,
)
from bench.run import BenchOptions, build_parser, run_bench
from bench.upstream import STREAM_CHUNKS, stream_events

#: Startup of three Python processes plus a handful of requests, on a slow CI machine.
SMOKE_GUARD_S = 120


def _text(result: BenchResult) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render(result))
    output = console.file
    assert isinstance(output, io.StringIO)
    return output.getvalue()


async def test_tiny_run_measures_every_scenario_and_prints_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_BENCH_LITELLM", str(tmp_path / "no-litellm-here"))
    options = BenchOptions(
        budget=Budget(requests=4, warmup_requests=2),
        concurrency=(1, 2),
        only=(DIRECT, HYPERCORN, IOP, LITELLM),
    )
    lines: list[str] = []
    with trio.fail_after(SMOKE_GUARD_S):
        result = await run_bench(options, tmp_path, lines.append)

    scenarios = [Scenario(c, stream) for c in (1, 2) for stream in (False, True)]
    assert result.scenarios() == scenarios
    for scenario in scenarios:
        for target in (DIRECT, HYPERCORN, IOP):
            measured = result.get(target, scenario)
            assert measured is not None, (target, scenario)
            assert (measured.ok, measured.errors) == (4, 0), measured.first_error
        assert result.get(LITELLM, scenario) is None
    assert any(note.startswith("litellm: not installed, skipped") for note in result.notes)
    assert any(line.startswith("iop: http://127.0.0.1:") for line in lines)

    text = _text(result)
    for label in ("c=1 non-stream", "c=1 stream", "c=2 non-stream", "c=2 stream"):
        assert label in text
    rows = re.findall(r"│ (direct|Hypercorn|IOP) +│ +(\d+) │ +(\d+) │", text)  # target, ok, err
    expected = [("direct", "4", "0"), ("Hypercorn", "4", "0"), ("IOP", "4", "0")]
    assert sorted(rows) == sorted(expected * 4)
    assert "litellm: not installed, skipped" in text
    assert "Targets from the issue" in text
    assert "machine: " in text

    document = json.loads(to_json(result))
    assert len(document["measurements"]) == 12


def _measurement(target: str, scenario: Scenario, latency_ms: float, rps: float) -> Measurement:
    count = 100
    return Measurement(
        target=target,
        scenario=scenario,
        latencies_s=(latency_ms / 1000,) * count,
        errors=0,
        wall_s=count / rps,
    )


def test_targets_are_judged_from_the_measured_numbers() -> None:
    c1, c1s = Scenario(1, False), Scenario(1, True)
    c32, c32s = Scenario(32, False), Scenario(32, True)
    result = BenchResult(
        machine=Machine.this(),
        measurements=(
            _measurement(DIRECT, c1, 1.0, 1000),
            _measurement(IOP, c1, 2.0, 500),  # +1 ms: within 1.5 ms
            _measurement(DIRECT, c1s, 1.0, 1000),
            _measurement(IOP, c1s, 5.0, 200),  # +4 ms: over 3 ms
            _measurement(IOP, c32, 10.0, 1000),
            _measurement(LITELLM, c32, 10.0, 100),  # 10x
            _measurement(IOP, c32s, 10.0, 1000),
        ),
    )
    verdicts = [(check.measured, check.verdict) for check in check_targets(result)]
    assert verdicts == [
        ("+1.00 ms", "PASS"),
        ("+4.00 ms", "MISS"),
        ("10.00x", "PASS"),
        ("not measured (litellm)", "n/a"),
    ]


def test_percentile_interpolates_between_ranks() -> None:
    values = (1.0, 2.0, 3.0, 4.0)
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile((7.0,), 99) == 7.0


def test_the_upstream_stream_has_the_documented_shape() -> None:
    plain = stream_events(include_usage=False)
    assert len(plain) == STREAM_CHUNKS == 22
    assert b'"finish_reason":"stop"' in plain[-1]
    with_usage = stream_events(include_usage=True)
    assert with_usage[:-1] == plain
    assert b'"usage"' in with_usage[-1]


def test_command_line_rejects_unknown_targets_and_bad_concurrency() -> None:
    parser = build_parser()
    args = parser.parse_args(["--only", "iop,direct", "--concurrency", "4,1"])
    assert args.only == (DIRECT, IOP)
    assert args.concurrency == (4, 1)
    for bad in (["--only", "nginx"], ["--concurrency", "0"], ["--concurrency", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
