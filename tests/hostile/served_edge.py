"""A real `iop-edge serve` process with an in-process Node, for the tests that stop, kill
and interrupt it: its config, written to a folder, and the two started together."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Final

import trio
import yaml

from iop_node.main import run_node
from tests.e2e.processes import EdgeProcess, start_edge
from tests.e2e.stack import NODE_TOKEN, edge_config, sim_provider

__all__ = ["LONG_STREAM", "MESSAGES", "SLOW_SIM", "start_edge_with_node", "write_config"]

MESSAGES: Final = [{"role": "user", "content": "hi"}]
#: A sim generating 20 tokens a second: `LONG_STREAM` takes 25 s on it, far past any test.
SLOW_SIM: Final = {"ttft_ms": 0, "tokens_per_second": 20}
#: A chat completions body streaming 500 tokens of the model `m`.
LONG_STREAM: Final = {"model": "m", "messages": MESSAGES, "max_tokens": 500, "stream": True}


def write_config(
    folder: Path,
    *,
    grace_s: float = 10.0,
    adapter: dict[str, Any] | None = None,
    capacity: int = 4,
    generation: dict[str, Any] | None = None,
) -> Path:
    """An Edge config of one `sim` provider serving `m`, with this shutdown grace,
    written to `folder`/edge.yaml (its state in `folder`/state)."""
    model: dict[str, Any] = {"id": "m", "providers": {"sim-1": "sim-small"}}
    if generation is not None:
        model["generation"] = generation
    text = edge_config(
        folder / "state",
        providers=[sim_provider("sim-1", capacity=capacity, adapter=adapter or {"ttft_ms": 0})],
        models=[model],
    )
    config = yaml.safe_load(text)
    config["edge"]["shutdown_grace_s"] = grace_s
    path = folder / "edge.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


async def start_edge_with_node(nursery: trio.Nursery, config: Path) -> EdgeProcess:
    """`iop-edge serve --config config` and its Node `node-1`, linked; `nursery` owns
    both."""
    edge = await start_edge(nursery, config)
    await nursery.start(partial(run_node, edge.urls["node"], "node-1", NODE_TOKEN))
    return edge
