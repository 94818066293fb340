"""Only a replica of the same config shares the caller port (`port_claim`): real
`iop-edge serve` processes on one fixed port.

`SO_REUSEPORT` lets any process bind the caller port again; without the claim, an Edge
with another config started on it silently, and the kernel split callers between two
pools (one answering 404 for a model the other serves).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import trio
import yaml

from tests.e2e.processes import REPO, admin_get, run_cli, sim_config, start_edge, stop_pid
from tests.e2e.stack import NODE_TOKEN_HASH


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(tmp_path: Path, name: str, port: int, *, capacity: int = 4) -> Path:
    config: dict[str, Any] = sim_config(
        tmp_path / "state", NODE_TOKEN_HASH, capacity=capacity, tokens_per_second=400,
        listen={"openai": f"127.0.0.1:{port}"},
    )  # fmt: skip
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


async def test_a_second_edge_with_another_config_refuses_the_caller_port(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    port = _free_port()
    first_config = _config(tmp_path, "edge.yaml", port)
    first = await start_edge(nursery, first_config)
    started = [first.pid]
    try:
        # The same config: a replica, welcome.
        replica = await start_edge(nursery, first_config)
        started.append(replica.pid)
        assert replica.urls["openai"] == first.urls["openai"]

        # Another config on the same port: refused at start, naming the other Edge.
        other = _config(tmp_path, "other.yaml", port, capacity=8)
        with trio.fail_after(30):
            refused = await trio.run_process(
                [sys.executable, "-m", "iop_edge", "serve", "--config", str(other)],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                cwd=str(REPO),
            )
        stderr = refused.stderr.decode()
        assert refused.returncode == 1, stderr
        assert f"iop-edge: error: {other}: cannot start: the caller port 127.0.0.1:{port} is " in (
            stderr
        )
        assert "already served by another Edge with a different config" in stderr
        assert f"pid {first.pid}" in stderr and str(first_config.resolve()) in stderr
        assert "openai.listen" in stderr and "iop-edge restart" in stderr  # the fixes
        assert "Traceback" not in stderr

        # A restart successor runs the new config on the inherited socket: it may.
        _config(tmp_path, "edge.yaml", port, capacity=8)
        result = await run_cli("restart", *first.admin_flags, "--json")
        assert result.returncode == 0, result.stderr.decode() + first.log
        started.append(json.loads(result.stdout)["successor_pid"])
        with trio.fail_after(30):
            assert await first.process.wait() == 0
        status = await admin_get(first.urls["admin"], "/status")
        assert status["revision"] == 2
    finally:
        for pid in started:
            stop_pid(pid)
