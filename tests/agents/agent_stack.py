"""A real Edge and Node in front of the scripted upstream, natively or translated.

The `agent_stack` fixture (conftest.py) is parametrized over the two paths a run can take
(design §14):

- `native`: the provider is a `vllm`-type runtime, which by default speaks chat, Messages
  and Responses; the upstream speaks all three and the Node relays each run as it is;
- `translated`: the provider declares `adapter.protocols: [chat]` and the upstream speaks
  only chat completions (anything else is its 404), so the Node must translate every
  Messages or Responses run to chat completions and back.

The Edge requires a principal token, so each agent's key is checked on the way in (Claude
Code sends `x-api-key`, Codex `Authorization: Bearer`).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import trio

from tests.agents.scripted_upstream import ScriptedUpstream
from tests.agents.settings import Target
from tests.e2e.stack import Stack, edge_config, start_stack
from tests.timing import GUARD_S

RunPath = Literal["native", "translated"]
PATHS: Final[tuple[RunPath, ...]] = ("native", "translated")
#: The catalog id the agents ask for, and the name the runtime serves it under.
MODEL: Final = "agent-model"
SERVED: Final = "scripted-model"
TOKEN: Final = "sk-agents-test-token"
TOKEN_REF: Final = "agents-ci"


def _provider(path: RunPath, base_url: str) -> dict[str, Any]:
    adapter: dict[str, Any] = {
        "base_url": base_url,
        "request_timeout_s": 30.0,
        "first_byte_timeout_s": 10.0,
        "connect_timeout_s": 2.0,
    }
    if path == "translated":
        adapter["protocols"] = ["chat"]
    return {
        "id": f"scripted-{path}",
        "type": "vllm",
        "models": [SERVED],
        "capacity": 4,
        "adapter": adapter,
    }


@dataclass
class AgentStack:
    path: RunPath
    stack: Stack
    upstream: ScriptedUpstream
    target: Target
    home: Path
    """The CLI's HOME: a throwaway directory, so no user settings apply."""
    workdir: Path
    """Where the CLI runs (its project directory)."""
    logs: Path

    async def usage(self, *columns: str) -> list[dict[str, Any]]:
        """The ledger's rows grouped by `columns`, once every finished run is written."""
        with trio.fail_after(GUARD_S):
            await self.stack.edge.ledger.wait_flushed()
        async with self.stack.admin() as admin:
            response = await admin.get("/usage", params={"group_by": ",".join(columns)})
        response.raise_for_status()
        rows: list[dict[str, Any]] = response.json()["rows"]
        return rows


@asynccontextmanager
async def open_agent_stack(
    path: RunPath, nursery: trio.Nursery, tmp_path: Path
) -> AsyncIterator[AgentStack]:
    """An Edge, a Node and the scripted upstream for `path`, all run by `nursery`."""
    upstream = ScriptedUpstream(
        protocols=("chat", "messages", "responses") if path == "native" else ("chat",),
        models=(SERVED,),
    )
    base_url = await nursery.start(upstream.serve)
    principal = {
        "token_ref": TOKEN_REF,
        "principal_ref": "agents",
        "token_hash_sha256": hashlib.sha256(TOKEN.encode()).hexdigest(),
    }
    text = edge_config(
        tmp_path / "state",
        providers=[_provider(path, base_url)],
        models=[{"id": MODEL, "providers": {f"scripted-{path}": SERVED}}],
        openai_section={"principal_tokens": [principal]},
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=(MODEL,))
    dirs = [tmp_path / name for name in ("home", "work", "logs")]
    for directory in dirs:
        await trio.Path(directory).mkdir()
    home, workdir, logs = dirs
    yield AgentStack(
        path=path,
        stack=stack,
        upstream=upstream,
        target=Target(url=stack.addresses.openai_url, token=TOKEN, model=MODEL),
        home=home,
        workdir=workdir,
        logs=logs,
    )
    # Nodes first, so the Edge does not wait out its close grace for them.
    for node_id in list(stack.node_scopes):
        stack.kill_node(node_id)
    await stack.wait_catalog(lambda c: not any(p["connected"] for p in c["providers"]))
