"""The processes a soak phase stands up, and how a phase reports.

Each reliability phase of the soak (`bench.soak_phases`) runs its own Edge(s) and Node
(real `iop-edge serve` and `iop-node run` processes, every listener on 127.0.0.1 port 0)
for the seconds it needs, with a config of its own, so that one phase's limits or
hostile upstream never touch another's books. The Node dials every Edge of the phase
(`--edge` once per Edge), as a Node of a replicated Edge does.

A phase ends with a `Verdict`: it held, it failed, or it could not run here (skipped,
with the reason printed: never a silent pass).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import httpx2
import trio
import yaml

from bench.gateway import EdgeLog, EdgeUrls
from bench.services import Service, admin_headers, python_argv, spawn_service, start_service

__all__ = [
    "PhaseStack",
    "Verdict",
    "caller_token",
    "error_code",
    "principal_tokens",
    "sim_provider",
    "start_phase_stack",
]

NODE_TOKEN: Final = "soak-phase-node-token-not-a-secret"
NODE_ID: Final = "node-1"
#: A phase's own start-up: processes on a loaded machine take seconds to import.
START_S: Final = 60.0
_READINESS_INTERVAL_S: Final = 0.05


@dataclass(frozen=True)
class Verdict:
    """How a phase ended: `held`, `FAILED`, or `skipped` (with `why`)."""

    state: Literal["held", "FAILED", "skipped"]
    why: str = ""

    @property
    def failed(self) -> bool:
        return self.state == "FAILED"

    @classmethod
    def of(cls, held: bool) -> Verdict:
        return cls("held" if held else "FAILED")


def caller_token(principal: str) -> str:
    """The caller token a phase gives `principal` (a fixture value, not a secret)."""
    return f"sk-soak-{principal}-not-a-secret"


def principal_tokens(principals: Sequence[str]) -> dict[str, Any]:
    """An `openai` section giving each principal its `caller_token`."""
    return {
        "principal_tokens": [
            {
                "token_ref": f"{name}-key",
                "principal_ref": name,
                "token_hash_sha256": hashlib.sha256(caller_token(name).encode()).hexdigest(),
            }
            for name in principals
        ]
    }


def sim_provider(provider_id: str, capacity: int, **adapter: Any) -> dict[str, Any]:
    """A `sim` provider serving `sim-small`; `adapter` sets its pace."""
    return {
        "id": provider_id,
        "type": "sim",
        "models": ["sim-small"],
        "capacity": capacity,
        "adapter": adapter or {"ttft_ms": 5, "tokens_per_second": 2000},
    }


def error_code(body: bytes | str) -> str:
    """An error body's `error.code` (OpenAI) or `error.type` (Anthropic); `?` if none."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("code") or error.get("type") or "?")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "?"


@dataclass(frozen=True)
class PhaseStack:
    """A phase's running Edges (their URLs) and the one Node linked to all of them."""

    edges: list[Service[EdgeUrls]]
    node: Service[None]
    state_dirs: list[Path]

    @property
    def urls(self) -> EdgeUrls:
        return self.edges[0].ready

    def admin_headers(self) -> dict[str, str]:
        """The admin credential of the first Edge, for a change through its admin API."""
        return admin_headers(self.state_dirs[0])


async def start_phase_stack(
    nursery: trio.Nursery,
    folder: Path,
    configs: Sequence[Mapping[str, Any]],
    *,
    env: Mapping[str, str] | None = None,
    down: Collection[str] = (),
) -> PhaseStack:
    """Start one Edge per config (sections as in `edge.yaml`; `listen`, `state_dir` and
    the node entry are filled in here: `providers` goes in `nodes[0]`), then one Node
    linked to all of them; return once every Edge's catalog shows its providers
    connected and available, but those in `down` (their runtime is down on purpose):
    `unavailable`. Owned by `nursery`; bounded by `START_S`."""
    await trio.Path(folder).mkdir(parents=True, exist_ok=True)
    token_hash = hashlib.sha256(NODE_TOKEN.encode()).hexdigest()
    edges: list[Service[EdgeUrls]] = []
    state_dirs: list[Path] = []
    with trio.fail_after(START_S):
        for index, given in enumerate(configs):
            config = {key: value for key, value in given.items() if key != "providers"}
            edge_section = {
                "id": f"soak-edge-{index + 1}",
                "listen": "127.0.0.1:0",
                "state_dir": str(folder / f"state-{index + 1}"),
                **config.get("edge", {}),
            }
            state_dirs.append(Path(edge_section["state_dir"]))
            config |= {
                "edge": edge_section,
                "admin": {"listen": "127.0.0.1:0"},
                "openai": {"listen": "127.0.0.1:0", **config.get("openai", {})},
                "nodes": [
                    {
                        "id": NODE_ID,
                        "token_hash_sha256": token_hash,
                        "providers": given["providers"],
                    }
                ],
            }
            path = folder / f"edge-{index + 1}.yaml"
            await trio.Path(path).write_text(yaml.safe_dump(config, sort_keys=False), "utf-8")
            argv = python_argv("iop_edge", "serve", "--config", str(path))
            edges.append(
                await start_service(nursery, f"edge-{index + 1}", argv, EdgeLog(), env=env)
            )
        dial = [arg for edge in edges for arg in ("--edge", edge.ready.node)]
        node = await spawn_service(
            nursery,
            NODE_ID,
            python_argv("iop_node", "run", *dial, "--node-id", NODE_ID),
            env={**(env or {}), "IOP_NODE_TOKEN": NODE_TOKEN},
        )
        for edge in edges:
            await _wait_health(edge.ready.admin, frozenset(down))
    return PhaseStack(edges=edges, node=node, state_dirs=state_dirs)


async def _wait_health(admin_url: str, down: frozenset[str]) -> None:
    """`bench.gateway.wait_servable`, but the providers in `down` are to be `unavailable`:
    the catalog is the only place their health shows, so it is read again each
    `_READINESS_INTERVAL_S` (the caller bounds the wait)."""
    async with httpx2.AsyncClient(base_url=admin_url, timeout=5) as admin:
        while True:
            response = await admin.get("/catalog")
            response.raise_for_status()
            providers = response.json()["providers"]
            wanted = {p["id"]: "unavailable" if p["id"] in down else "available" for p in providers}
            if providers and all(
                p["connected"] and p["health"] == wanted[p["id"]] for p in providers
            ):
                return
            await trio.sleep(_READINESS_INTERVAL_S)
