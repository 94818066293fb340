"""`iop-edge serve` under a `Type=notify` systemd unit: what it tells the service manager.

The test plays systemd: it binds the datagram socket a unit's `$NOTIFY_SOCKET` names and
reads what a real `iop-edge serve` process sends through a start, a zero-downtime restart
and a stop.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
import yaml

from iop_edge.runtime.lifecycle.service_manager import notify, notify_serving
from tests.e2e.processes import run_cli, sim_config, start_edge, stop_pid
from tests.e2e.stack import NODE_TOKEN_HASH


class FakeServiceManager:
    """The receiving end of `$NOTIFY_SOCKET`: one message per datagram."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._socket = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    async def bind(self) -> None:
        await self._socket.bind(str(self.path))

    async def receive(self) -> dict[str, str]:
        """The next message, as its `KEY=value` lines."""
        with trio.fail_after(30):
            data = await self._socket.recv(4096)
        return dict(line.split("=", 1) for line in data.decode().splitlines())

    def close(self) -> None:
        self._socket.close()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A unix socket path must stay under ~100 bytes; pytest's tmp_path may not."""
    with tempfile.TemporaryDirectory(prefix="iop-notify-") as folder:
        yield Path(folder)


@pytest.fixture
async def manager(short_dir: Path) -> AsyncIterator[FakeServiceManager]:
    receiver = FakeServiceManager(short_dir / "notify")
    await receiver.bind()
    yield receiver
    receiver.close()


async def test_the_edge_says_ready_and_each_restart_names_the_new_main_process(
    nursery: trio.Nursery, tmp_path: Path, manager: FakeServiceManager
) -> None:
    config = tmp_path / "edge.yaml"
    config.write_text(
        yaml.safe_dump(
            sim_config(tmp_path / "state", NODE_TOKEN_HASH, capacity=2, tokens_per_second=100)
        ),
        encoding="utf-8",
    )
    edge = await start_edge(nursery, config, env={"NOTIFY_SOCKET": str(manager.path)})
    assert await manager.receive() == {"READY": "1", "MAINPID": str(edge.pid)}

    # A zero-downtime restart: the successor says it is the main process now, so systemd
    # does not take the old process's exit for the end of the service.
    result = await run_cli("restart", *edge.admin_flags, "--json")
    assert result.returncode == 0, result.stderr.decode() + edge.log
    successor = json.loads(result.stdout)["successor_pid"]
    try:
        assert await manager.receive() == {"READY": "1", "MAINPID": str(successor)}
        with trio.fail_after(30):
            assert await edge.process.wait() == 0  # the old Edge drained and exited
        # The old process never said it was stopping: the service is not.
        os.kill(successor, signal.SIGTERM)
        assert await manager.receive() == {"STOPPING": "1"}
    finally:
        stop_pid(successor)


async def test_without_a_notify_socket_nothing_is_sent(short_dir: Path) -> None:
    assert notify("READY=1", environ={}) is False
    assert notify_serving(environ={"NOTIFY_SOCKET": ""}) is False
    # An abstract-namespace address (systemd's usual form) is reached as such.
    name = f"@iop-notify-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind("\0" + name[1:])
        assert notify("STATUS=serving", environ={"NOTIFY_SOCKET": name}) is True
        assert receiver.recv(64) == b"STATUS=serving"


def test_a_manager_that_went_away_costs_a_warning_not_the_edge(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gone = short_dir / "gone"
    assert notify("READY=1", environ={"NOTIFY_SOCKET": str(gone)}) is False
    assert f"cannot notify the service manager at {gone}" in caplog.text
    assert notify("READY=1", environ={"NOTIFY_SOCKET": "vsock:2:1234"}) is False
    assert "not a unix socket path" in caplog.text
