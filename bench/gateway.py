"""IOP under test: an Edge and a Node, each in its own process, in front of the upstream.

The Edge runs exactly as an operator runs it (`python -m iop_edge serve --config F`), with
every listener on 127.0.0.1 port 0; the URLs it bound are read from its log. The Node is
`python -m iop_node run`, with its token in `IOP_NODE_TOKEN`. The config has one model,
`bench-model`, on one `vllm` provider pointing at the bench upstream, with capacity and
queue large enough that the pool is never what limits throughput. That provider speaks
Anthropic Messages and OpenAI Responses natively (a `vllm` type's default), as the
upstream does; a second model, `bench-model-translated`, is on a provider declared to
speak chat only (`adapter.protocols: [chat]`) on the same upstream, so the Node
translates its Messages and Responses runs: the same Edge and Node, either path.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx2
import trio
import yaml

from bench.services import Service, python_argv, spawn_service, start_service
from bench.upstream import MODEL, MODEL_TRANSLATED, SERVED_MODEL

PROVIDER_ID: Final = "bench-vllm"
#: The provider the Node translates caller protocols for (chat only).
CHAT_PROVIDER_ID: Final = "bench-vllm-chat"
NODE_ID: Final = "bench-node"
#: Run slots of the one provider: far above any concurrency the bench uses.
CAPACITY: Final = 256
#: Between two readiness checks of the Edge's catalog (see `wait_servable`).
_READINESS_INTERVAL_S: Final = 0.02

_EDGE_URLS = {
    "node": re.compile(r"node websocket listening on (\S+)"),
    "openai": re.compile(r"OpenAI API listening on (\S+)"),
    "admin": re.compile(r"admin API listening on (\S+)"),
}


@dataclass(frozen=True, slots=True)
class EdgeUrls:
    node: str
    openai: str
    admin: str


@dataclass(frozen=True, slots=True)
class Gateway:
    """The running Edge and Node; `openai_url` is where callers send requests."""

    edge: Service[EdgeUrls]
    node: Service[None]

    @property
    def openai_url(self) -> str:
        return self.edge.ready.openai

    @property
    def processes(self) -> dict[str, int]:
        return {"edge": self.edge.pid, "node": self.node.pid}


def edge_config(
    upstream_root: str,
    state_dir: Path,
    node_token: str,
    *,
    capacity: int = CAPACITY,
    extra_models: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The Edge config (YAML): `bench-model` on a provider at `upstream_root` that speaks
    every caller protocol, `bench-model-translated` on one that speaks chat only, and
    `extra_models` (model entries naming either provider)."""
    config: dict[str, Any] = {
        "edge": {"id": "bench-edge", "listen": "127.0.0.1:0", "state_dir": str(state_dir)},
        "admin": {"listen": "127.0.0.1:0"},
        "openai": {"listen": "127.0.0.1:0"},
        "dispatch": {"max_queue": 4096, "queue_timeout_ms": 120_000},
        "models": [
            {"id": MODEL, "providers": {PROVIDER_ID: SERVED_MODEL}},
            {"id": MODEL_TRANSLATED, "providers": {CHAT_PROVIDER_ID: SERVED_MODEL}},
            *(dict(model) for model in extra_models),
        ],
        "nodes": [
            {
                "id": NODE_ID,
                "token_hash_sha256": hashlib.sha256(node_token.encode()).hexdigest(),
                "providers": [
                    _provider(PROVIDER_ID, upstream_root, capacity),
                    _provider(CHAT_PROVIDER_ID, upstream_root, capacity, protocols=["chat"]),
                ],
            }
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


def _provider(
    provider_id: str, upstream_root: str, capacity: int, *, protocols: list[str] | None = None
) -> dict[str, Any]:
    """A `vllm` provider on the upstream; `protocols` overrides what it speaks natively."""
    adapter: dict[str, Any] = {"base_url": f"{upstream_root}/v1"}
    if protocols is not None:
        adapter["protocols"] = protocols
    return {
        "id": provider_id,
        "type": "vllm",
        "models": [SERVED_MODEL],
        "capacity": capacity,
        "adapter": adapter,
    }


class EdgeLog:
    """Collects the three URLs the Edge logs as it binds; ready once it has all of them."""

    def __init__(self) -> None:
        self._found: dict[str, str] = {}

    def __call__(self, line: str) -> EdgeUrls | None:
        for name, pattern in _EDGE_URLS.items():
            if match := pattern.search(line):
                self._found[name] = match.group(1)
        if len(self._found) < len(_EDGE_URLS):
            return None
        return EdgeUrls(**self._found)


async def start_gateway(
    nursery: trio.Nursery,
    upstream_root: str,
    workdir: Path,
    *,
    capacity: int = CAPACITY,
    extra_models: Sequence[Mapping[str, Any]] = (),
    env: Mapping[str, str] | None = None,
) -> Gateway:
    """Start the Edge, then the Node; return once the models are servable.

    `workdir` gets the config and the Edge's state; `env` is added to both processes'
    environment (the tracing bench's `OTEL_*` variables). The caller owns the deadline
    (startup takes about a second)."""
    token = secrets.token_urlsafe(24)
    await trio.Path(workdir).mkdir(parents=True, exist_ok=True)
    config_path = workdir / "edge.yaml"
    text = edge_config(
        upstream_root,
        workdir / "edge-state",
        token,
        capacity=capacity,
        extra_models=extra_models,
    )
    await trio.Path(config_path).write_text(text, encoding="utf-8")
    edge = await start_service(
        nursery,
        "iop-edge",
        python_argv("iop_edge", "serve", "--config", str(config_path), "--log-level", "INFO"),
        EdgeLog(),
        env=env,
    )
    # The Node runs with its default logging (`info`), as an operator runs it: it logs
    # nothing per run (httpx2's per-request line is silenced by `iop-node` itself).
    node_argv = python_argv("iop_node", "run", "--edge", edge.ready.node, "--node-id", NODE_ID)
    node = await spawn_service(
        nursery, "iop-node", node_argv, env={**(env or {}), "IOP_NODE_TOKEN": token}
    )
    await wait_servable(edge.ready.admin)
    return Gateway(edge=edge, node=node)


async def wait_servable(admin_url: str) -> None:
    """Return once the Edge's catalog shows every provider connected and available.

    A Node reports its providers' health to the Edge a moment after the handshake (after
    its first probe of the upstream). Across the process boundary the admin catalog is
    the only place that state is visible, and there is nothing to wait on but the next
    look, so this re-reads it at a short interval; the caller's deadline bounds the whole
    wait.
    """
    async with httpx2.AsyncClient(base_url=admin_url, timeout=5) as admin:
        while True:
            response = await admin.get("/catalog")
            response.raise_for_status()
            providers = response.json().get("providers", [])
            if providers and all(p["connected"] and p["health"] == "available" for p in providers):
                return
            await trio.sleep(_READINESS_INTERVAL_S)
