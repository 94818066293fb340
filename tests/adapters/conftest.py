"""Fixtures of the OpenAI-compatible adapter tests: a fake upstream and an adapter factory."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio

from iop_node.adapters.base import Adapter
from iop_node.adapters.openai_compat import OpenAICompatAdapter
from schemas.config import AdapterSettings, ProviderConfig

from .fake_upstream import FakeUpstream

MODEL = "fake-model"
ADAPTER_CAPACITY = 4

MakeAdapter = Callable[..., OpenAICompatAdapter]


@pytest.fixture
async def upstream(nursery: trio.Nursery) -> FakeUpstream:
    fake = FakeUpstream()
    await nursery.start(fake.serve)
    return fake


@pytest.fixture
async def make_adapter() -> AsyncIterator[MakeAdapter]:
    """Build adapters for a `base_url` (plus adapter settings); all closed at teardown."""
    made: list[Adapter] = []  # also checks, statically, that it is an Adapter

    def make(base_url: str, **settings: Any) -> OpenAICompatAdapter:
        provider = ProviderConfig(
            id="p1",
            type="vllm",
            models=[MODEL],
            capacity=ADAPTER_CAPACITY,
            adapter=AdapterSettings(base_url=base_url, **settings),
        )
        adapter = OpenAICompatAdapter(provider)
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        await adapter.aclose()
