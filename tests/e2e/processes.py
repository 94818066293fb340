"""Real `iop-edge serve` processes and a steady mixed load, for the restart and replica tests.

An Edge process is started exactly as an operator starts it (`python -m iop_edge serve
--config F`), with every listener on 127.0.0.1 port 0 unless told otherwise; the URLs
are read from its log. Its output is drained for the whole test (a successor started by
`iop-edge restart` writes to the same pipe) and kept for diagnostics.

`MixedLoad` keeps N streaming and M non-streaming callers busy through the official
`openai` SDK (no retries unless asked: a failure is a failure) and counts what each
request ended as: complete, failed (with why) or truncated (a stream that ended without a
finish reason).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import openai
import trio

from iop_edge.runtime.refresh.config_file import load_config
from tests.e2e.stack import CLIENT_TLS, admin_headers

REPO = Path(__file__).resolve().parents[2]
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]

_URLS = {
    "node": re.compile(r"node websocket listening on (\S+)"),
    "openai": re.compile(r"OpenAI API listening on (\S+)"),
    "admin": re.compile(r"admin API listening on (\S+)"),
}


@dataclass
class EdgeProcess:
    """One `iop-edge serve` (and, after a restart, its successor's output too)."""

    process: trio.Process
    config_path: Path
    urls: dict[str, str] = field(default_factory=dict)
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=400))
    _urls_found: trio.Event = field(default_factory=trio.Event)
    _more_lines: trio.Event = field(default_factory=trio.Event)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    @property
    def admin_flags(self) -> list[str]:
        """What an `iop-edge` command that changes this Edge is given: its admin URL, and
        its config (whose `edge.state_dir` holds the admin credential)."""
        return ["--admin", self.urls["admin"], "--config", str(self.config_path)]

    def admin_headers(self) -> dict[str, str]:
        """The `Authorization` an admin change to this Edge presents."""
        state_dir = load_config(self.config_path).config.edge.state_dir
        return admin_headers(Path(state_dir))

    async def wait_for_line(self, text: str) -> str:
        """The first logged line containing `text`, once there is one."""
        while True:
            for line in self.lines:
                if text in line:
                    return line
            await self._more_lines.wait()

    async def _read(self) -> None:
        assert self.process.stdout is not None
        pending = b""
        async for data in self.process.stdout:
            pending += data
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                line = raw.decode(errors="replace")
                self.lines.append(line)
                for name, pattern in _URLS.items():
                    if name not in self.urls and (match := pattern.search(line)):
                        self.urls[name] = match.group(1)
                if len(self.urls) == len(_URLS):
                    self._urls_found.set()
            self._more_lines.set()
            self._more_lines = trio.Event()
        self._urls_found.set()  # exited: the starter sees whether it was ready


async def start_edge(
    nursery: trio.Nursery, config_path: Path, *extra: str, env: dict[str, str] | None = None
) -> EdgeProcess:
    """Start `iop-edge serve` and return once it logged all three URLs. `nursery` owns
    the process (killed when it is cancelled) and the reader of its output; the process
    may exit, or be killed, at any time without failing the nursery."""
    argv = [sys.executable, "-m", "iop_edge", "serve", "--config", str(config_path), *extra]
    process: trio.Process = await nursery.start(
        partial(
            trio.run_process,
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            check=False,
            cwd=str(REPO),
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    )
    edge = EdgeProcess(process=process, config_path=config_path)
    nursery.start_soon(edge._read)
    with trio.move_on_after(30):
        await edge._urls_found.wait()
    if len(edge.urls) < len(_URLS):
        process.kill()
        raise AssertionError(f"the Edge did not start:\n{edge.log}")
    return edge


async def admin_get(admin_url: str, path: str) -> dict[str, Any]:
    """`GET path` on an Edge process's admin API: its JSON document (an error status fails)."""
    async with httpx2.AsyncClient(base_url=admin_url, timeout=10, verify=CLIENT_TLS) as admin:
        response = await admin.get(path)
        response.raise_for_status()
        document: dict[str, Any] = response.json()
        return document


def stop_pid(pid: int) -> None:
    """SIGKILL a process the test started (or that an Edge it started spawned)."""
    if pid <= 0:  # not known (0 would be our own process group)
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def run_cli(*argv: str) -> subprocess.CompletedProcess[bytes]:
    """`iop-edge ARGV` as its own process (as an operator runs it)."""
    return await trio.run_process(
        [sys.executable, "-m", "iop_edge", *argv],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=str(REPO),
    )


@dataclass(frozen=True)
class Failure:
    """A request that did not complete: when it ran, its run id if any chunk said it."""

    started: float
    ended: float
    run_id: str | None
    reason: str


@dataclass
class Tally:
    complete: int = 0
    failed: list[str] = field(default_factory=list)
    truncated: int = 0
    failures: list[Failure] = field(default_factory=list)
    """Every failed or truncated request, with its times (trio clock) and run id."""

    @property
    def total(self) -> int:
        return self.complete + len(self.failed) + self.truncated


class MixedLoad:
    """Closed-loop callers through `base_url` until `stop()` (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        *,
        streams: int,
        non_streams: int,
        max_tokens: int = 20,
        retries: int = 0,
        api_key: str = "unused",
    ) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.streams = streams
        self.non_streams = non_streams
        self.max_tokens = max_tokens
        self.retries = retries
        self.tally = Tally()
        self.streaming: set[str] = set()
        """Run ids of the streams under way that have had a chunk: what a kill cuts."""
        self._stop = trio.Event()
        self._progress = trio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def wait_total(self, total: int) -> None:
        """Return once `total` requests have ended, however."""
        while self.tally.total < total:
            await self._progress.wait()

    async def wait_progress(self) -> None:
        """Return once a request ended or a stream had its first chunk."""
        await self._progress.wait()

    def _notify(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for index in range(self.streams + self.non_streams):
                nursery.start_soon(self._caller, index < self.streams)

    async def _caller(self, stream: bool) -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key,
            max_retries=self.retries,
            http_client=openai.DefaultAsyncHttpxClient(verify=CLIENT_TLS),
        )
        async with client:
            while not self._stop.is_set():
                await self._one(client, stream)
                self._notify()

    async def _one(self, client: openai.AsyncOpenAI, stream: bool) -> None:
        tally = self.tally
        started = trio.current_time()
        run_id: str | None = None
        try:
            if stream:
                chunks = await client.chat.completions.create(
                    model="m", stream=True, max_tokens=self.max_tokens, messages=MESSAGES
                )
                finish = None
                try:
                    async for chunk in chunks:
                        if run_id is None:
                            run_id = _run_id(chunk.id)
                            self.streaming.add(run_id)
                            self._notify()
                        if chunk.choices and chunk.choices[0].finish_reason:
                            finish = chunk.choices[0].finish_reason
                finally:
                    self.streaming.discard(run_id or "")
                if finish is None:
                    tally.truncated += 1
                    tally.failures.append(
                        Failure(started, trio.current_time(), run_id, "no finish reason")
                    )
                    return
            else:
                await client.chat.completions.create(
                    model="m", max_tokens=self.max_tokens, messages=MESSAGES
                )
        except openai.APIError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            tally.failed.append(reason)
            tally.failures.append(Failure(started, trio.current_time(), run_id, reason))
            return
        tally.complete += 1


def _run_id(completion_id: str) -> str:
    """The run id in a sim completion id (`chatcmpl-<run id>`)."""
    return completion_id.split("-", 1)[-1]


def sim_config(
    state_dir: Path,
    token_hash: str,
    *,
    capacity: int,
    tokens_per_second: float,
    listen: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An Edge config (as data) with one sim provider on node `node-1` serving model `m`."""
    ports = {"edge": "127.0.0.1:0", "admin": "127.0.0.1:0", "openai": "127.0.0.1:0"}
    ports.update(listen or {})
    return {
        "edge": {"id": "edge-test", "listen": ports["edge"], "state_dir": str(state_dir)},
        "admin": {"listen": ports["admin"]},
        "openai": {"listen": ports["openai"]},
        "dispatch": {"max_queue": 1024, "queue_timeout_ms": 60_000},
        "models": [{"id": "m", "providers": {"sim-1": "sim-small"}}],
        "nodes": [
            {
                "id": "node-1",
                "token_hash_sha256": token_hash,
                "providers": [
                    {
                        "id": "sim-1",
                        "type": "sim",
                        "models": ["sim-small"],
                        "capacity": capacity,
                        "adapter": {"ttft_ms": 5, "tokens_per_second": tokens_per_second},
                    }
                ],
            }
        ],
        **(extra or {}),
    }
