"""The sim's memory for models: a runtime that holds only some of its models at once.

A `sim` provider with `adapter.max_loaded` set behaves as llama.cpp's router does with
`--models-max` (design §18), so placement can be shown without a GPU:

1. It serves every model of `provider.models` but holds at most `max_loaded` of them.
   At start it holds none.
2. A run for a model it does not hold loads it first (autoload): the run waits
   `adapter.load_ms` more for its first token. Loads are one at a time; runs for a model
   being loaded wait for that load, not a second one.
3. A load past `max_loaded` unloads the least recently used model that has no run in
   flight. When every held model has runs in flight, the run is refused as `busy`
   (`upstream_busy`, a capacity answer: the Edge tries elsewhere), never by breaking a run.
4. `load_model` and `unload_model` (the Edge's commands) do the same on request; an
   unload of a model with runs in flight waits for none and refuses instead.
5. Its probe reports each model's state (`loaded`, `loading`, `unloaded`) and
   `max_loaded`, like a router's; `loads` counts the loads it made (for the bench).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import trio

from iop_node.adapters.base import AdapterError, ModelCommandFailed
from schemas.config import LifecycleFlag, ProviderConfig
from schemas.wire import FailureCode, ModelState

__all__ = ["SIM_LIFECYCLE", "SimMemory"]

#: What a sim with a memory offers of a model's lifecycle, as a router does.
SIM_LIFECYCLE: Final[list[LifecycleFlag]] = ["list_models", "load_model", "unload_model"]


class SimMemory:
    """Which of a sim provider's models it holds (see the module rules)."""

    def __init__(self, models: list[str], *, max_loaded: int, load_s: float) -> None:
        self._models = list(models)
        self.max_loaded = max_loaded
        self._load_s = load_s
        self._held: OrderedDict[str, None] = OrderedDict()
        """Held models, least recently used first."""
        self._running: dict[str, int] = {}
        self._loading: str | None = None
        self._turn = trio.Lock()
        self.loads = 0

    @classmethod
    def of(cls, provider: ProviderConfig) -> SimMemory | None:
        """The provider's memory, or None when it holds every model always."""
        settings = provider.adapter
        if settings.max_loaded is None:
            return None
        return cls(provider.models, max_loaded=settings.max_loaded, load_s=settings.load_ms / 1000)

    def states(self) -> list[ModelState]:
        """Rule 5: each model's state, in config order."""
        return [
            ModelState(
                name=model,
                state="loaded"
                if model in self._held
                else "loading"
                if model == self._loading
                else "unloaded",
            )
            for model in self._models
        ]

    @asynccontextmanager
    async def serving(self, model: str) -> AsyncIterator[None]:
        """Hold `model` for one run (Rules 2, 3): loaded first if it is not."""
        try:
            await self.load(model)
        except ModelCommandFailed as exc:
            raise AdapterError(
                FailureCode.UPSTREAM_BUSY, str(exc), retryable=True, capacity=True
            ) from None
        self._running[model] = self._running.get(model, 0) + 1
        self._held.move_to_end(model)
        try:
            yield
        finally:
            self._running[model] -= 1

    async def load(self, model: str) -> None:
        """Hold `model` (Rules 2-4); `ModelCommandFailed` when no held model can go."""
        if model not in self._models:
            raise ModelCommandFailed(f"this sim does not serve {model!r}")
        async with self._turn:
            if model in self._held:
                return
            while len(self._held) >= self.max_loaded:
                idle = next((m for m in self._held if not self._running.get(m)), None)
                if idle is None:
                    raise ModelCommandFailed(
                        f"cannot load {model}: every model held ({', '.join(self._held)}) "
                        "has runs in flight"
                    )
                del self._held[idle]
            self._loading = model
            try:
                await trio.sleep(self._load_s)
            finally:
                self._loading = None
            self._held[model] = None
            self.loads += 1

    async def unload(self, model: str) -> None:
        """Let `model` go (Rule 4)."""
        async with self._turn:
            if self._running.get(model):
                raise ModelCommandFailed(f"{model} has runs in flight")
            self._held.pop(model, None)
