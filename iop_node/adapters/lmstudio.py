"""The adapter for LM Studio: inference through its OpenAI-compatible API, models through its own.

LM Studio serves the OpenAI API under `/v1` (chat completions and Responses), so runs go
through `OpenAICompatAdapter` unchanged and `adapter.base_url` is that `/v1` URL (default
`http://127.0.0.1:1234/v1`). It loads models just in time, so its `/v1/models` lists every
model on disk whether loaded or not; its native REST API (LM Studio 0.4+) tells them apart:

- `GET {root}/api/v1/models` -> `{"models": [{"key": ..., "type": "llm",
  "loaded_instances": [{"id": ...}], ...}]}`: a model with an instance is loaded
  (`model_states.from_lmstudio`); `POST /api/v1/models/load` and `/unload` exist.

An LM Studio before 0.4 answers 404 there: its models are listed from `/v1/models` and
their states are not reported.
"""

from __future__ import annotations

from typing import ClassVar, Final

from iop_node.adapters.model_states import from_lmstudio
from iop_node.adapters.openai_compat import OpenAICompatAdapter
from schemas.config import LifecycleFlag
from schemas.wire import ProviderStatus

#: What LM Studio's native API offers of a model's lifecycle.
_LIFECYCLE: Final[list[LifecycleFlag]] = ["list_models", "load_model", "unload_model"]


class LmStudioAdapter(OpenAICompatAdapter):
    """`OpenAICompatAdapter` for runs; LM Studio's native `/api/v1/models` for load states."""

    default_base_url: ClassVar[str | None] = "http://127.0.0.1:1234/v1"

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
