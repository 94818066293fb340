"""The adapter for LM Studio: inference through its OpenAI-compatible API, models through its own.

LM Studio serves the OpenAI API under `/v1` (chat completions and Responses), so runs go
through `OpenAICompatAdapter` unchanged and `adapter.base_url` is that `/v1` URL (default
`http://127.0.0.1:1234/v1`). It loads models just in time, so its `/v1/models` lists every
model on disk whether loaded or not; its native REST API (LM Studio 0.4+) tells them apart:

- `GET {root}/api/v1/models` -> `{"models": [{"key": ..., "type": "llm",
  "loaded_instances": [{"id": ...}], ...}]}`: a model with an instance is loaded
  (`model_states.from_lmstudio`);
- `POST {root}/api/v1/models/load` (`{"model": key}`) loads one more instance of a model
  and `POST {root}/api/v1/models/unload` (`{"instance_id": id}`) unloads one.

An LM Studio before 0.4 answers 404 there: its models are listed from `/v1/models` and
their states are not reported.
"""

from __future__ import annotations

from typing import Final

from iop_node.adapters.base import ModelCommandFailed
from iop_node.adapters.model_states import from_lmstudio, loaded_instances
from iop_node.adapters.openai_compat import OpenAICompatAdapter
from schemas.config import LifecycleFlag
from schemas.wire import ProviderStatus

#: What LM Studio's native API offers of a model's lifecycle.
_LIFECYCLE: Final[list[LifecycleFlag]] = ["list_models", "load_model", "unload_model"]


class LmStudioAdapter(OpenAICompatAdapter):
    """`OpenAICompatAdapter` for runs; LM Studio's native `/api/v1/models` for load states."""

    async def _check_health(self) -> ProviderStatus:
        native = await self._lifecycle.get_optional("/api/v1/models")
        states = None if native is None else from_lmstudio(native)
        if states is None:  # before 0.4: the OpenAI listing alone
            return await super()._check_health()
        return ProviderStatus(
            id=self.provider.id,
            health="available",
            models=[state.name for state in states],
            lifecycle=_LIFECYCLE,
            model_states=states,
        )

    async def load_model(self, model: str) -> None:
        """`base.ModelLifecycle`: LM Studio loads a second instance of a loaded model, so
        a model already loaded is left as it is."""
        if model in await self._loaded_instances():
            return
        await self._lifecycle.post("/api/v1/models/load", {"model": model})

    async def unload_model(self, model: str) -> None:
        """Unload every instance of `model`."""
        for instance in (await self._loaded_instances()).get(model, []):
            await self._lifecycle.post("/api/v1/models/unload", {"instance_id": instance})

    async def _loaded_instances(self) -> dict[str, list[str]]:
        native = await self._lifecycle.get_optional("/api/v1/models")
        if native is None:
            raise ModelCommandFailed("LM Studio's /api/v1/models did not answer (LM Studio 0.4+)")
        return loaded_instances(native)
