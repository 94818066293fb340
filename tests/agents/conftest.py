"""Fixtures of the agent CLI tests: `agent_stack`, over both paths (see `agent_stack.py`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.agents.agent_stack import PATHS, AgentStack, open_agent_stack


@pytest.fixture(params=PATHS)
async def agent_stack(
    request: pytest.FixtureRequest, nursery: trio.Nursery, tmp_path: Path
) -> AsyncIterator[AgentStack]:
    async with open_agent_stack(request.param, nursery, tmp_path) as agent:
        yield agent
