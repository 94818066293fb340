"""A user's machine, for the tests of the installed package: a fresh virtual environment
with the package installed from a built distribution, and a shell that runs commands the
way a user types them (`bash -c`, from a folder of their own, the environment's `bin`
first on `PATH`, nothing of the repository or its venv in sight).

Also: reading the install guide's commands, and the few substitutions a test must make
to them (ports it did not choose, folders of a host it is not root on).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parents[2]
#: Variables that would make the fresh environment see something other than itself.
_LEAKY_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "IOP_NODE_TOKEN")


def build_distributions(out: Path) -> dict[str, Path]:
    """The guide's `just dist` (`python -m build`: the sdist, then the wheel built from
    it, as a release is made), into `out` rather than the repository's `dist/`."""
    just = Path(sys.executable).parent / "just"
    built = subprocess.run(
        [str(just), "dist", str(out)], cwd=REPO, check=False, capture_output=True, text=True
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = out.glob("iop_gateway-*.whl")
    (sdist,) = out.glob("iop_gateway-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


@dataclass(frozen=True)
class Installation:
    """The package, installed into `venv` from one distribution."""

    kind: str
    venv: Path
    pip_output: str
    seconds: float

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def environ(self) -> dict[str, str]:
        """A user's environment with this installation on `PATH` (and no other IOP)."""
        env = {key: value for key, value in os.environ.items() if key not in _LEAKY_ENV}
        path = [
            entry
            for entry in env.get("PATH", "").split(os.pathsep)
            if entry and not entry.startswith(str(REPO))
        ]
        env["PATH"] = os.pathsep.join([str(self.bin), *path])
        env["PYTHONUNBUFFERED"] = "1"
        env["COLUMNS"] = "200"
        return env


def install(kind: str, distribution: Path, venv: Path) -> Installation:
    """A fresh venv (no system site-packages: a dependency the package forgot to declare
    is missing here), then `pip install` of the distribution file. Its dependencies come
    from the registry, as a user's do; pip's cache is used, as a user's is."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    started = time.monotonic()
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", str(distribution)],
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return Installation(kind=kind, venv=venv, pip_output=output, seconds=seconds)


@dataclass
class Running:
    """A long-running command (`serve`, `run`): its output read as it comes."""

    command: str
    process: trio.Process
    lines: list[str] = field(default_factory=list)
    _more: trio.Event = field(default_factory=trio.Event)
    _ended: bool = False

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    async def wait_for(self, pattern: str, *, count: int = 1) -> re.Match[str]:
        """The `count`-th output line matching `pattern`, once there is one."""
        regex = re.compile(pattern)
        with trio.move_on_after(60):
            while True:
                matches = [m for line in self.lines if (m := regex.search(line))]
                if len(matches) >= count:
                    return matches[count - 1]
                if self._ended:
                    break
                await self._more.wait()
        raise AssertionError(f"{self.command!r} printed no line like {pattern!r}:\n{self.log}")

    async def stop(self, signum: int = signal.SIGTERM) -> int:
        """Signal the command (bash runs it in place of itself: the last command of a
        `bash -c` line is exec'd) and wait for its exit status."""
        self.process.send_signal(signum)
        with trio.fail_after(60):
            return await self.process.wait()

    async def _read(self) -> None:
        assert self.process.stdout is not None
        pending = b""
        async for data in self.process.stdout:
            pending += data
            *complete, pending = pending.split(b"\n")
            self.lines.extend(raw.decode(errors="replace") for raw in complete)
            self._more.set()
            self._more = trio.Event()
        if pending:
            self.lines.append(pending.decode(errors="replace"))
        self._ended = True
        self._more.set()  # waiters look once more, then give up


@dataclass(frozen=True)
class Shell:
    """Runs commands as the user types them, in `cwd`, with `installation` on `PATH`."""

    installation: Installation
    cwd: Path
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return {**self.installation.environ(), **self.extra_env, **(env or {})}

    async def run(
        self, command: str, *, stdin: str = "", env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        """Run `command` to its end; a non-zero exit fails, with what it printed."""
        with trio.fail_after(120):
            result = await trio.run_process(
                ["bash", "-c", command],
                stdin=stdin.encode(),
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                cwd=self.cwd,
                env=self._env(env),
            )
        assert result.returncode == 0, (
            f"{command!r} exited {result.returncode}:\n"
            f"{result.stdout.decode()}{result.stderr.decode()}"
        )
        return result

    async def start(
        self,
        nursery: trio.Nursery,
        command: str,
        *,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Running:
        """Start `command`; `nursery` owns it (killed if the test fails) and its reader."""
        process: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                ["bash", "-c", command],
                stdin=subprocess.DEVNULL if stdin is None else stdin.encode(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                check=False,
                cwd=cwd or self.cwd,
                env=self._env(env),
            )
        )
        running = Running(command=command, process=process)
        nursery.start_soon(running._read)
        return running


# --- the guide ----------------------------------------------------------------------------

_FENCE = re.compile(r"^```sh\n(.*?)^```", re.MULTILINE | re.DOTALL)
#: Any fenced block (a `yaml` one too): not prose, so no inline code span in it.
_ANY_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_INLINE = re.compile(r"`([^`]+)`")
#: An inline code span is a command when it starts with one of these.
COMMAND_WORDS = ("iop-edge ", "iop-node ", "pipx ", "pip ", "systemctl ", "journalctl ", "apt ")


def guide_commands(text: str) -> list[str]:
    """Every command of the guide: each line of its `sh` blocks (a line ending in `\\`
    joined with the next) and each inline code span that starts with a command word."""
    commands: list[str] = []
    for block in _FENCE.findall(text):
        commands.extend(line for line in block.replace("\\\n", "").splitlines() if line)
    prose = _ANY_FENCE.sub("", text)
    commands.extend(span for span in _INLINE.findall(prose) if span.startswith(COMMAND_WORDS))
    return commands


def substitute(command: str, replacements: Mapping[str, str]) -> str:
    for old, new in replacements.items():
        command = command.replace(old, new)
    return command
