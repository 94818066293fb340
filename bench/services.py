"""The servers under test, each in its own process, owned by one Trio task.

The load generator must not share a GIL or an event loop with what it measures, so the
upstream, the Edge, the Node and LiteLLM each run as a child process. `start_service`
starts one and returns once the child printed the line that says it is ready (its URL);
the task that owns the process keeps draining its output (a full pipe would stall the
child) and remembers the last lines, so a child that dies is reported with its own words.
Cancelling the owning nursery terminates the child: SIGTERM, then SIGKILL once its
`stop_grace_s` (5 s by default, as `trio.run_process` does) has passed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

import trio

from iop_edge.runtime.lifecycle import admin_credential

#: The repository root: children import `iop_edge`, `iop_node` and `bench` from here.
REPO_ROOT: Final = Path(__file__).resolve().parent.parent
_TAIL_LINES: Final = 40
_READ_BYTES: Final = 64 * 1024
DEFAULT_STOP_GRACE_S: Final = 5.0

T = TypeVar("T")


class ServiceFailed(Exception):
    """A child process exited before it was ready, or while the bench still needed it."""

    def __init__(self, name: str, reason: str, tail: Sequence[str]) -> None:
        lines = "\n".join(f"    {line}" for line in tail) or "    (no output)"
        super().__init__(f"{name}: {reason}; its last output:\n{lines}")
        self.name = name


@dataclass
class Service(Generic[T]):
    """A running child process and what its readiness line told us."""

    name: str
    process: trio.Process
    ready: T
    tail: deque[str]
    """The child's last output lines, for diagnostics."""

    @property
    def pid(self) -> int:
        return self.process.pid


def python_argv(module: str, *args: str) -> list[str]:
    """`python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def url_after(prefix: str) -> Callable[[str], str | None]:
    """Readiness of a service that prints `prefix` + its URL once accepting: the URL."""

    def ready(line: str) -> str | None:
        return line.removeprefix(prefix) if line.startswith(prefix) else None

    return ready


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment plus the repo on `PYTHONPATH` (so an uninstalled checkout works)."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


async def start_service(
    nursery: trio.Nursery,
    name: str,
    argv: Sequence[str],
    ready: Callable[[str], T | None],
    *,
    env: Mapping[str, str] | None = None,
    stop_grace_s: float = DEFAULT_STOP_GRACE_S,
) -> Service[T]:
    """Start `argv` as a child owned by `nursery`; return once `ready(line)` gave a value.

    `ready` sees every output line (stdout and stderr, merged) until it returns something
    other than None. The caller owns the deadline for startup. When the nursery is
    cancelled the child gets SIGTERM and `stop_grace_s` to exit before SIGKILL.
    """
    service: Service[T] = await nursery.start(
        partial(_own, name, list(argv), ready, env, stop_grace_s)
    )
    return service


async def spawn_service(
    nursery: trio.Nursery, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
) -> Service[None]:
    """Start a child that announces nothing; it counts as started once it runs, and the
    caller finds out when it is ready its own way."""
    service: Service[None] = await nursery.start(
        partial(_own, name, list(argv), None, env, DEFAULT_STOP_GRACE_S)
    )
    return service


async def _own(
    name: str,
    argv: list[str],
    ready: Callable[[str], object] | None,
    env: Mapping[str, str] | None,
    stop_grace_s: float,
    *,
    task_status: trio.TaskStatus[Service[Any]],
) -> None:
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                check=False,
                cwd=str(REPO_ROOT),
                env=child_env(env),
                deliver_cancel=partial(_terminate, grace_s=stop_grace_s),
            )
        )
        assert process.stdout is not None
        service: Service[Any] | None = None
        if ready is None:
            service = Service(name=name, process=process, ready=None, tail=tail)
            task_status.started(service)
        async with aclosing(output_lines(process.stdout)) as lines:
            async for line in lines:
                tail.append(line)
                if service is None and ready is not None:
                    value = ready(line)
                    if value is not None:
                        service = Service(name=name, process=process, ready=value, tail=tail)
                        task_status.started(service)
        # The child closed its output: it is exiting, and nobody asked it to.
        await process.wait()
    # Raised out here, not in the nursery, so the caller gets it bare (not in a group).
    reason = f"exited with status {process.returncode}"
    if service is None:
        raise ServiceFailed(name, f"{reason} before it was ready", tail)
    raise ServiceFailed(name, reason, tail)


async def _terminate(process: trio.Process, *, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if the child has not exited within `grace_s`."""
    process.send_signal(signal.SIGTERM)
    with trio.move_on_after(grace_s):
        await process.wait()
        return
    process.kill()


async def output_lines(stream: trio.abc.ReceiveStream) -> AsyncGenerator[str, None]:
    """Decoded output lines, without their line endings, until end of stream."""
    pending = b""
    while chunk := await stream.receive_some(_READ_BYTES):
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            yield raw.decode("utf-8", errors="replace").rstrip("\r")
    if pending:
        yield pending.decode("utf-8", errors="replace")


def admin_headers(state_dir: Path) -> dict[str, str]:
    """The `Authorization` an admin change presents: the credential the Edge keeps in its
    `state_dir` (`iop_edge.runtime.lifecycle.admin_credential`), made at its first start."""
    token = admin_credential.read(state_dir / admin_credential.ADMIN_TOKEN_FILE)
    return {"authorization": f"Bearer {token}"}
