"""Finding and running the real agent CLIs (Claude Code, Codex CLI) as subprocesses.

The CLIs come from npm: CI installs the versions pinned in `.ci/agents/package.json` into
`.ci/agents/node_modules` (`.ci/run`); elsewhere a global install on PATH serves. Without
one a test skips, saying how to install it; under CI (`CI=true`) it fails instead, so CI
can never pass without running the agents.

A run is bounded (`within_s`): on time-out the CLI's whole process group (its shells
included) is killed and the test fails with everything the CLI printed so far. The CLI
gets a minimal environment (PATH, a throwaway HOME, no proxy, no inherited vendor keys),
so nothing from the developer's machine decides what it does.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Final

import pytest
import trio

from tests.agents.settings import ROOT

#: Where `.ci/run` installs the pinned CLIs.
LOCAL_BIN: Final = ROOT / ".ci" / "agents" / "node_modules" / ".bin"
#: The npm package of each CLI, for the skip message.
PACKAGES: Final = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def find_cli(name: str) -> Path | None:
    """The CLI `name`: the pinned install first, then PATH."""
    local = LOCAL_BIN / name
    if local.exists():
        return local
    found = shutil.which(name)
    return None if found is None else Path(found)


def require_cli(name: str) -> Path:
    """The CLI `name`, or skip (fail under CI) saying how to install it."""
    path = find_cli(name)
    if path is not None:
        return path
    reason = (
        f"the {name!r} CLI is not installed (npm ci --prefix .ci/agents, as .ci/run does, "
        f"or npm install -g {PACKAGES.get(name, name)})"
    )
    if _under_ci():
        pytest.fail(f"CI must run the agent CLI tests, but {reason}")
    pytest.skip(reason)


def base_environment(home: Path) -> dict[str, str]:
    """What every CLI run gets before the settings under test: PATH (node and the shell
    tools), a throwaway HOME, no colour, loopback never proxied."""
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


@dataclass(frozen=True, slots=True)
class Outcome:
    argv: tuple[str, ...]
    returncode: int | None
    """None: killed at the time limit."""
    stdout: str
    stderr: str

    def report(self) -> str:
        """Everything a failure message needs: the command, how it ended, its output."""
        ended = "timed out" if self.returncode is None else f"exit {self.returncode}"
        return (
            f"$ {shlex.join(self.argv)}\n({ended})\n"
            f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"
        )


def _kill_group(pid: int) -> None:
    """Kill the process group `pid` leads (the CLI started its own session), shells and
    helpers included; nothing to do if none is left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _deliver_cancel(process: trio.Process) -> None:
    """At the time limit, `trio.run_process` stops the CLI with this: at once and whole."""
    _kill_group(process.pid)


async def run_cli(
    argv: list[str], *, cwd: Path, env: dict[str, str], within_s: float, logs: Path
) -> Outcome:
    """Run `argv` to completion or for at most `within_s`; stdout and stderr go to files
    under `logs` so that a run killed at the limit still shows what it printed. Whatever
    the CLI left running when it ended is killed with it."""
    await trio.Path(logs).mkdir(parents=True, exist_ok=True)
    out_path, err_path = trio.Path(logs / "stdout.txt"), trio.Path(logs / "stderr.txt")
    returncode: int | None = None
    async with await out_path.open("wb") as out, await err_path.open("wb") as err:
        run = partial(
            trio.run_process,
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out.wrapped,
            stderr=err.wrapped,
            check=False,
            start_new_session=True,
            deliver_cancel=_deliver_cancel,
        )
        process: trio.Process | None = None
        try:
            with trio.move_on_after(within_s):
                async with trio.open_nursery() as nursery:
                    process = await nursery.start(run)
                returncode = process.returncode
        finally:
            if process is not None:
                _kill_group(process.pid)
    return Outcome(
        argv=tuple(argv),
        returncode=returncode,
        stdout=await out_path.read_text(errors="replace"),
        stderr=await err_path.read_text(errors="replace"),
    )
