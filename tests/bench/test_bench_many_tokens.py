"""`python -m bench --tokens`: its configs are what they say, and a tiny run measures every
number with real processes (the targets are judged at 10,000 tokens, never here)."""

from __future__ import annotations

from pathlib import Path

import trio
from rich.console import Console

from bench.many_tokens import (
    ManyTokensShape,
    caller_tokens,
    measure_many_tokens,
    render_many_tokens,
    tokens_config,
)
from bench.run import build_parser
from iop_edge.core.configuration.config import parse_config
from iop_edge.core.refresh.refresh_plan import plan_apply


def test_the_configs_hold_the_tokens_and_limits_and_differ_in_live_limits_only(
    tmp_path: Path,
) -> None:
    shape = ManyTokensShape(tokens=501, limited_every=10)
    tokens = caller_tokens(shape.tokens, shape.tokens_per_principal)
    running = parse_config(tokens_config(shape, tmp_path, tokens, rpm=600)).config
    candidate = parse_config(tokens_config(shape, tmp_path, tokens, rpm=601)).config

    assert len(running.openai.principal_tokens) == 501
    assert len({t.token_hash_sha256 for t in running.openai.principal_tokens}) == 501
    assert len({t.principal_ref for t in running.openai.principal_tokens}) == shape.principals
    assert len(running.principals) == shape.limited + 1  # and "*"
    plan = plan_apply(running, candidate)
    assert len(plan.diff.changes) == shape.limited and not plan.errors
    assert plan.diff.restart_required_paths == ()


def test_the_command_line_takes_a_token_count() -> None:
    parser = build_parser()
    assert parser.parse_args(["--tokens"]).tokens == 10_000
    assert parser.parse_args(["--tokens", "2000"]).tokens == 2_000
    assert parser.parse_args([]).tokens is None


async def test_a_tiny_run_measures_startup_checks_and_the_stall(tmp_path: Path) -> None:
    shape = ManyTokensShape(tokens=300, starts=1, dry_runs=1)
    progress: list[str] = []
    with trio.fail_after(120):
        m = await measure_many_tokens(shape, tmp_path, progress.append)

    assert m.startup_small_s > 0 and m.startup_large_s > 0
    assert m.check_small_s > 0 and m.check_large_s > 0
    assert len(m.dry_run_s) == 1 and m.dry_run_changes == shape.limited
    assert m.pings_during and m.pings_control  # the stall and its control were measured
    assert m.stall_s == max(m.pings_during)
    assert any(line.startswith("tokens: dry run") for line in progress)
    console = Console(width=120, record=True)
    console.print(render_many_tokens(m))
    text = console.export_text()
    assert "startup, 300 tokens" in text and "request held during a dry run" in text
