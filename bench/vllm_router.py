"""vLLM's router, a Rust HTTP router in front of vLLM workers, as a peer target (optional).

`vllm-router` on PyPI ships the router as a compiled Rust extension: the `vllm-router`
command is a thin Python launcher that hands its arguments to the Rust router, which then
serves on its own runtime threads inside that one process (the process the bench
measures). It is not a dependency of IOP. The bench uses it when it finds the command:
the path in `IOP_BENCH_VLLM_ROUTER`, else `vllm-router` on `PATH`. To enable it:

    python3 -m venv /tmp/vr
    /tmp/vr/bin/pip install vllm-router
    IOP_BENCH_VLLM_ROUTER=/tmp/vr/bin/vllm-router just bench

Configured in front of the same upstream as the other targets (its flags, from
`vllm-router --help`, version 0.1.17): one worker (`--worker-urls`), `round_robin`
policy (with one worker the cheapest; the default `cache_aware` also maintains a prefix
tree per request), the concurrency limiter and its token bucket far above anything the
bench offers (their defaults, 256 in flight and a 256/s refill, would be what limits a
closed loop), its Prometheus exporter on a free port (it is on by default, as IOP's
metrics are), logging at `warning` (it logs nothing per request at `info` either).

What it does per request, compared with IOP's Edge: it forwards the body to the worker
unchanged and relays the answer bytes as they come; it does not map a logical model id
to a served name (the caller's `model` goes upstream as it is), meter usage or queue by
model. It is the floor of a compiled relay, not a feature-for-feature equal.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path
from typing import Final

import httpx2
import trio

from bench.services import Service, start_service

ENV_VAR: Final = "IOP_BENCH_VLLM_ROUTER"
#: The launcher logs this right before the Rust server binds (`src/server.rs`).
_STARTING = re.compile(r"Starting server on (\S+:\d+)")
#: Far above any load the bench offers: the router's limiter must never be what it measures.
_UNLIMITED: Final = "1000000"
#: Between two connection attempts while the router binds (see `_wait_accepting`).
_BIND_PROBE_INTERVAL_S: Final = 0.02
_CHILD_ENV: Final = {"NO_COLOR": "1", "RUST_LOG_STYLE": "never"}


def find_vllm_router() -> str | None:
    """The `vllm-router` executable to use, or None when it is not installed."""
    configured = os.environ.get(ENV_VAR)
    if configured:
        return configured if Path(configured).is_file() else None
    return shutil.which("vllm-router")


def _free_port() -> int:
    """A port free right now (the router has no port-0 report); a race fails the start loudly."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def router_argv(executable: str, upstream_root: str, port: int, metrics_port: int) -> list[str]:
    """The command line that puts the router in front of `upstream_root` on `port`."""
    return [
        executable,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", upstream_root,
        "--policy", "round_robin",
        "--max-concurrent-requests", _UNLIMITED,
        "--rate-limit-tokens-per-second", _UNLIMITED,
        "--queue-size", "0",
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--log-level", "warning",
    ]  # fmt: skip


def _ready(line: str) -> str | None:
    match = _STARTING.search(line)
    return f"http://{match.group(1)}" if match else None


async def _wait_accepting(root_url: str) -> None:
    """Return once the router accepts connections.

    Its last log line comes right before the Rust server binds, and nothing else tells
    another process that it has: so this tries to connect at a short interval until it
    can. The caller's deadline bounds the wait."""
    async with httpx2.AsyncClient(base_url=root_url, timeout=5) as client:
        while True:
            try:
                await client.get("/health")
                return
            except httpx2.ConnectError:
                await trio.sleep(_BIND_PROBE_INTERVAL_S)


async def start_vllm_router(
    nursery: trio.Nursery, executable: str, upstream_root: str
) -> Service[str]:
    """Start the router in front of `upstream_root`; its `ready` value is its root URL.

    The caller owns the deadline (it starts in about a second)."""
    argv = router_argv(executable, upstream_root, _free_port(), _free_port())
    # `warning` hides the startup line the bench waits for: ask for `info` from the
    # launcher's server module only, everything else at `warning`.
    env = {**_CHILD_ENV, "RUST_LOG": "warn,vllm_router_rs::server=info"}
    service = await start_service(nursery, "vllm-router", argv, _ready, env=env)
    await _wait_accepting(service.ready)
    return service
