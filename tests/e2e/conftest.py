from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.e2e.stack import Stack, edge_config, sim_provider, start_stack


@pytest.fixture
async def stack_one(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    """One Node with one sim provider serving model `m`."""
    text = edge_config(
        tmp_path,
        providers=[sim_provider("sim-1")],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
