"""A real L4 balancer in front of Edge replicas: HAProxy in TCP mode, started by the test.

It needs the `haproxy` binary (Debian: `apt-get install haproxy`; on `PATH` or in
`/usr/sbin`). Its config is written to the test's temporary directory; its listening
socket is bound here (127.0.0.1, port 0) and handed to it (`bind fd@N`), so there is no
port to guess and no moment when callers could find nothing listening: connections wait
in the socket's queue until HAProxy accepts them. It runs in the foreground (`-db`) as
the test's child and is killed with it. Without the binary the tests that need it are
skipped, saying why; under CI (`CI=true`) they fail instead.

The balancer is what an operator would put in front of replicas: round robin over the
replicas' OpenAI listeners, a health check every 100 ms that takes a dead replica out
after one failure, and `option redispatch` with `retries`, so a connection that cannot
reach one replica is sent to another.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio


def _haproxy() -> str | None:
    return shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
    )


def require_haproxy() -> str:
    path = _haproxy()
    if path is None:
        reason = "no haproxy binary (Debian: apt-get install haproxy)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the balancer tests, but {reason}")
        pytest.skip(f"balancer tests skipped: {reason}")
    return path


CONFIG = """\
global
    maxconn 4096
defaults
    mode tcp
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    retries 3
    option redispatch
frontend callers
    bind fd@{fd}
    default_backend edges
backend edges
    balance roundrobin
{servers}
"""


async def start_balancer(
    nursery: trio.Nursery, workdir: Path, backends: Sequence[str]
) -> tuple[str, trio.Process]:
    """HAProxy over `backends` (`HOST:PORT` each); returns its URL and process."""
    binary = require_haproxy()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    port = listener.getsockname()[1]
    servers = "\n".join(
        f"    server edge{index} {backend} check inter 100ms fall 1 rise 1"
        for index, backend in enumerate(backends)
    )
    config = workdir / "haproxy.cfg"
    config.write_text(CONFIG.format(fd=listener.fileno(), servers=servers), encoding="utf-8")
    try:
        process = await trio.lowlevel.open_process(
            [binary, "-db", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(listener.fileno(),),
        )
    finally:
        listener.close()

    async def own() -> None:
        try:
            await trio.sleep_forever()
        finally:
            process.kill()
            with trio.move_on_after(5, shield=True):
                await process.wait()

    nursery.start_soon(own)
    return f"http://127.0.0.1:{port}", process
