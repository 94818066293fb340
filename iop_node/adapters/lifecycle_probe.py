"""The part of a health probe that asks a runtime which models it holds (design §18).

An OpenAI-compatible runtime's probe lists its models (`GET /v1/models`); what else it
can say of their load states depends on the runtime, and this probe asks only where an
answer is possible (`model_states` reads the answers):

- a listing whose entries carry a `status` is llama.cpp's router: its `GET /props` says
  how many models it keeps loaded (`--models-max`), and it loads and unloads on request;
- a `vllm` provider is asked `GET /is_sleeping` until it answers 404 or 405 (a vLLM
  started without sleep mode): asleep, its models are `sleeping`;
- anything else reports no states (the Edge takes its models as loaded).

An optional question that fails (the runtime answers an error, or not at all) costs the
probe nothing: the provider's health is its model listing's, and the states are left
unsaid rather than guessed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

import httpx2

from iop_node.adapters.model_states import (
    LlamaListing,
    from_llama_listing,
    from_vllm_sleep,
    llama_router_max_loaded,
)
from schemas.config import LifecycleFlag
from schemas.wire import ModelState, ProviderStatus

log = logging.getLogger(__name__)

#: What llama.cpp's router offers: `/models`, `/models/load`, `/models/unload`.
ROUTER_LIFECYCLE: Final[list[LifecycleFlag]] = ["list_models", "load_model", "unload_model"]
#: What the OpenAI API offers of a model's lifecycle: the listing.
LISTING_ONLY: Final[list[LifecycleFlag]] = ["list_models"]


class LifecycleProbe:
    """Asks one OpenAI-compatible runtime for its models' load states, remembering which
    questions it cannot answer."""

    def __init__(self, client: httpx2.AsyncClient, root_url: str, *, asks_sleep: bool) -> None:
        """`root_url`: the server root (no `/v1`); `asks_sleep`: the provider is a vLLM."""
        self._client = client
        self._root_url = root_url
        self._asks_sleep = asks_sleep

    async def status(self, provider_id: str, listing: LlamaListing) -> ProviderStatus:
        """An `available` status for a runtime whose listing answered, with what it says
        of its models' states."""
        models = [model.id for model in listing.data]
        states = from_llama_listing(listing)
        if states is not None:
            props = await self.get_optional("/props")
            return ProviderStatus(
                id=provider_id,
                health="available",
                models=models,
                lifecycle=ROUTER_LIFECYCLE,
                model_states=states,
                max_loaded=None if props is None else llama_router_max_loaded(props),
            )
        return ProviderStatus(
            id=provider_id,
            health="available",
            models=models,
            lifecycle=LISTING_ONLY,
            model_states=await self._sleep_states(models),
        )

    async def _sleep_states(self, models: Sequence[str]) -> list[ModelState] | None:
        if not self._asks_sleep:
            return None
        body = await self.get_optional("/is_sleeping")
        return None if body is None else from_vllm_sleep(models, body)

    async def get_optional(self, path: str) -> bytes | None:
        """GET `path` at the server root: the body of a 200, else None (a 404 or 405 says
        the runtime has no such route: `/is_sleeping` is not asked again)."""
        try:
            response = await self._client.get(
                self._root_url + path, headers={"Accept": "application/json"}
            )
        except httpx2.HTTPError as exc:
            log.debug("GET %s%s failed: %s", self._root_url, path, exc)
            return None
        if response.status_code in (404, 405) and path == "/is_sleeping":
            self._asks_sleep = False
        return response.content if response.status_code == 200 else None
