"""The walkthrough of README.md#run-an-edge-and-two-nodes, as a reader pastes it.

The setup block runs verbatim in bash (tokens, config, `sed`, `check-config`), then the
Edge and both Nodes start as their own processes with the README's command lines and a
request goes through the official `openai` SDK. The one change a test must make: every
listener on a free port (the README's fixed ports may be taken on a shared machine).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import openai
import trio
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
START_GUARD_S = 60


def readme_block(marker: str) -> str:
    """The bash block that follows `<!-- walkthrough:MARKER -->` in the README."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    after = readme.split(f"<!-- walkthrough:{marker} -->", 1)[1]
    match = re.match(r"\s*```bash\n(.*?)```", after, re.DOTALL)
    assert match, f"no bash block after walkthrough:{marker}"
    return match.group(1)


def _environment() -> dict[str, str]:
    """A shell whose `iop-edge`, `iop-node` and `python` are this venv's (README.md#quick-start)."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_the_setup_block_makes_a_config_that_passes_check_config(tmp_path: Path) -> None:
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", readme_block("setup")],
        cwd=tmp_path,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("edge.yaml: OK — 1 model(s), 2 node(s), 2 provider(s)")
    workdir = tmp_path / "walkthrough"
    for node in ("node-a", "node-b"):
        token = workdir / f"{node}.token"
        assert token.stat().st_mode & 0o077 == 0  # only its owner can read it
        assert len(token.read_text(encoding="utf-8").strip()) >= 40
    config = (workdir / "edge.yaml").read_text(encoding="utf-8")
    assert "REPLACE-WITH-HASH-OF-node" not in config
    for node in ("node-a", "node-b"):  # the tokens themselves never reach the config
        assert (workdir / f"{node}.token").read_text(encoding="utf-8").strip() not in config


class Output:
    """What a process wrote so far, read continuously (a full pipe would stall it)."""

    def __init__(self) -> None:
        self.text = ""
        self.ended = False
        self._changed = trio.Event()

    async def pump(self, stream: trio.abc.ReceiveStream) -> None:
        async for chunk in stream:
            self.text += chunk.decode(errors="replace")
            self._changed.set()
            self._changed = trio.Event()
        self.ended = True
        self._changed.set()

    async def wait_for(self, pattern: str) -> str:
        while not (match := re.search(pattern, self.text)):
            assert not self.ended, f"process ended before {pattern!r}:\n{self.text}"
            await self._changed.wait()
        return match.group(1) if match.groups() else match.group(0)


async def test_the_walkthrough_serves_a_request_from_two_node_processes(tmp_path: Path) -> None:
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    setup = await trio.run_process(
        ["bash", "-euo", "pipefail", "-c", readme_block("setup")],
        cwd=tmp_path,
        env=_environment(),
        capture_stdout=True,
        capture_stderr=True,
    )
    assert setup.returncode == 0
    workdir = tmp_path / "walkthrough"
    config_path = workdir / "edge.yaml"
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    for section in ("edge", "admin", "openai"):
        config[section]["listen"] = "127.0.0.1:0"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")

    edge_line, *node_lines = [line for line in readme_block("run").splitlines() if line]
    assert edge_line == "iop-edge serve --config edge.yaml"
    processes: list[trio.Process] = []
    log = Output()
    async with trio.open_nursery() as nursery:
        try:
            edge = await trio.lowlevel.open_process(
                [str(BIN / "iop-edge"), *edge_line.split()[1:]],
                cwd=workdir,
                stderr=subprocess.PIPE,
            )
            processes.append(edge)
            assert edge.stderr is not None
            nursery.start_soon(log.pump, edge.stderr)
            with trio.fail_after(START_GUARD_S):
                node_url = await log.wait_for(r"node websocket listening on (\S+)")
                openai_url = await log.wait_for(r"OpenAI API listening on (\S+)")
            for line in node_lines:
                argv = line.replace("ws://127.0.0.1:7700", node_url).split()
                assert argv[0] == "iop-node"
                processes.append(
                    await trio.lowlevel.open_process(
                        [str(BIN / "iop-node"), *argv[1:]], cwd=workdir, stderr=subprocess.DEVNULL
                    )
                )
            with trio.fail_after(START_GUARD_S):
                for node in ("node-a", "node-b"):
                    await log.wait_for(f"node {node} connected from 127.0.0.1:")
                async with openai.AsyncOpenAI(
                    base_url=f"{openai_url}/v1", api_key="unused", max_retries=0
                ) as client:
                    served: set[str] = set()
                    while served != {"node-a-sim", "node-b-sim"}:  # both Nodes, in turn
                        raw = await client.chat.completions.with_raw_response.create(
                            model="chat",
                            max_tokens=4,
                            messages=[{"role": "user", "content": "Hello!"}],
                        )
                        assert raw.parse().model == "chat"
                        served.add(raw.headers["x-iop-provider"])
            # The access log has a line for every request.
            await log.wait_for(
                r"iop_edge.access: request_id=\S+ principal_ref=anonymous model=chat"
            )
        finally:
            for process in reversed(processes):
                process.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                codes = [await process.wait() for process in processes]
    assert codes == [0] * len(processes), log.text
