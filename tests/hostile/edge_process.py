"""A real `iop-edge serve` process for the tests that kill or stop it (SIGKILL, SIGTERM)."""

from __future__ import annotations

import re
import signal
import subprocess
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio
import yaml

from bench.services import REPO_ROOT, child_env, python_argv
from tests.e2e.stack import edge_config, sim_provider

_LISTENING = re.compile(r"(node websocket|OpenAI API|admin API) listening on (\S+)")


@dataclass
class EdgeProcess:
    process: trio.Process
    urls: dict[str, str]
    output: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    """The process's last output lines (stdout and stderr), for assertions and failures."""

    @property
    def openai_url(self) -> str:
        return self.urls["OpenAI API"]

    @property
    def node_url(self) -> str:
        return self.urls["node websocket"]

    @property
    def admin_url(self) -> str:
        return self.urls["admin API"]

    def signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    async def wait(self) -> int:
        return await self.process.wait()


def write_config(
    folder: Path, *, grace_s: float = 10.0, adapter: dict[str, Any] | None = None, capacity: int = 4
) -> Path:
    text = edge_config(
        folder / "state",
        providers=[sim_provider("sim-1", capacity=capacity, adapter=adapter or {"ttft_ms": 0})],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
    )
    config = yaml.safe_load(text)
    config["edge"]["shutdown_grace_s"] = grace_s
    path = folder / "edge.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


async def start_edge_process(nursery: trio.Nursery, config: Path) -> EdgeProcess:
    """`python -m iop_edge serve --config CONFIG`, returned once its three listeners are
    up. `nursery` owns the process (killed when it is cancelled) and the reader of its
    output; the process may exit (or be killed) at any time without failing the nursery."""
    argv = python_argv("iop_edge", "serve", "--config", str(config))
    process: trio.Process = await nursery.start(
        partial(
            trio.run_process,
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            check=False,
            cwd=str(REPO_ROOT),
            env=child_env(),
        )
    )
    edge = EdgeProcess(process=process, urls={})
    ready = trio.Event()
    nursery.start_soon(_read_output, edge, ready)
    with trio.fail_after(30):
        await ready.wait()
    if len(edge.urls) < 3:
        raise RuntimeError("the Edge exited before it was ready:\n" + "\n".join(edge.output))
    return edge


async def _read_output(edge: EdgeProcess, ready: trio.Event) -> None:
    assert edge.process.stdout is not None
    pending = b""
    while chunk := await edge.process.stdout.receive_some(65536):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", errors="replace")
            edge.output.append(line)
            match = _LISTENING.search(line)
            if match:
                edge.urls[match.group(1)] = match.group(2)
                if len(edge.urls) == 3:
                    ready.set()
    ready.set()  # exited: the caller sees whether it was ready
