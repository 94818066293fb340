"""A `cli` provider through a real Edge and Node: the Node runs its command only when its
own operator allowed it (`iop-node run --allow-command`), whatever the Edge's config
says; allowed, it answers as any provider does."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import trio

from iop_node.registry import create_adapter
from tests.e2e.stack import edge_config, sim_provider, start_stack
from tests.e2e.upstreams import provider_of

#: Answers with the prompt it was given on stdin.
ECHO = "import sys; sys.stdout.write('echo: ' + sys.stdin.read())"


def _config(state: Path) -> str:
    cli: dict[str, Any] = {
        "id": "cli-1",
        "type": "cli",
        "models": ["echo"],
        "capacity": 2,
        "adapter": {"command": [sys.executable, "-c", ECHO]},
    }
    return edge_config(
        state,
        providers=[cli, sim_provider("sim-1")],
        models=[
            {"id": "echo", "providers": {"cli-1": "echo"}},
            {"id": "m", "providers": {"sim-1": "sim-small"}},
        ],
    )


async def test_a_node_runs_no_command_its_operator_did_not_allow(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await start_stack(
        nursery, _config(tmp_path / "state"), tmp_path / "edge.yaml", wait_models=("m",)
    )
    catalog = await stack.wait_catalog(
        lambda catalog: provider_of(catalog, "cli-1")["health"] == "unavailable"
    )
    detail = provider_of(catalog, "cli-1")["health_reason"]
    assert "iop-node run --allow-command" in detail and sys.executable in detail
    async with stack.http() as http:
        refused = await http.post(
            "/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
        )
        served = await http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert refused.status_code == 503  # no provider of the model can serve it
    assert served.status_code == 200  # the Node's other providers serve on


async def test_an_allowed_command_answers(nursery: trio.Nursery, tmp_path: Path) -> None:
    allowed = partial(create_adapter, allowed_commands=frozenset({(sys.executable, "-c", ECHO)}))
    stack = await start_stack(
        nursery,
        _config(tmp_path / "state"),
        tmp_path / "edge.yaml",
        wait_models=("echo",),
        node_kwargs={"adapter_factory": allowed},
    )
    async with stack.client() as client:
        reply = await client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi"}]
        )
    assert reply.choices[0].message.content == "echo: hi"
