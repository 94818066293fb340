"""A CLI run is bounded and leaves nothing behind (`clis.run_cli`), shown with a shell.

An agent CLI starts shells and helpers of its own; a test must neither hang on a stuck
one nor leave its children running into the next test.
"""

from __future__ import annotations

import os
from pathlib import Path

import trio

from tests.agents.clis import base_environment, run_cli
from tests.timing import GUARD_S


async def _wait_gone(pid: int) -> None:
    """Until process `pid` has ended (a pidfd turns readable then; no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # ended and reaped already
    try:
        with trio.fail_after(GUARD_S):
            await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


async def test_a_run_past_its_limit_is_killed_with_what_it_started(tmp_path: Path) -> None:
    script = "sleep 60 & echo $! > child.pid; echo started; echo trouble >&2; wait"
    outcome = await run_cli(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=base_environment(tmp_path),
        within_s=2.0,
        logs=tmp_path / "logs",
    )
    assert outcome.returncode is None
    assert (outcome.stdout, outcome.stderr) == ("started\n", "trouble\n")
    assert "(timed out)" in outcome.report() and "trouble" in outcome.report()
    await _wait_gone(int((tmp_path / "child.pid").read_text()))


async def test_what_a_finished_run_left_running_is_killed(tmp_path: Path) -> None:
    outcome = await run_cli(
        ["bash", "-c", "sleep 60 > /dev/null & echo $! > child.pid; exit 3"],
        cwd=tmp_path,
        env=base_environment(tmp_path),
        within_s=10.0,
        logs=tmp_path / "logs",
    )
    assert outcome.returncode == 3, outcome.report()
    await _wait_gone(int((tmp_path / "child.pid").read_text()))
