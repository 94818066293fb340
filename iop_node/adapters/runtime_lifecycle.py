"""What an OpenAI-compatible runtime says of its models' load states, and how it is asked to
load and unload them (design §18).

A probe lists the runtime's models (`GET /v1/models`); what else it can say of their load
states depends on the runtime, and it is asked only where an answer is possible
(`model_states` reads the answers):

- a listing whose entries carry a `status` is llama.cpp's router: its `GET /props` says
  how many models it keeps loaded (`--models-max`); it loads on `POST /models/load` (and
  returns at once: the load is over when its listing says `loaded`, `failed`, or
  `unloaded` once it was seen `loading`) and unloads on `POST /models/unload`;
- a `vllm` provider is asked `GET /is_sleeping` until it answers 404 or 405 (a vLLM
  started without sleep mode): asleep, its models are `sleeping`; `POST /wake_up` wakes
  it (a "load") and `POST /sleep?level=1` puts it to sleep (an "unload"). A vLLM does
  not wake for a request: a run that finds it asleep wakes it first (`awake`; runs that
  arrive meanwhile wait for the same wake-up);
- anything else reports no states, and cannot be asked to load.

Ollama and LM Studio have native APIs of their own (`ollama.py`, `lmstudio.py`), which
use `get_optional` and `post` from here.

An optional question that fails (the runtime answers an error, or not at all) costs the
probe nothing: the provider's health is its model listing's, and the states are left
unsaid rather than guessed. A command that fails raises `ModelCommandFailed` with the
runtime's own message.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Final

import httpx2
import msgspec
import trio

from iop_node.adapters.base import AdapterError, ModelCommandFailed
from iop_node.adapters.model_states import (
    LLAMA_LISTING_DECODER,
    LlamaListing,
    from_llama_listing,
    from_vllm_sleep,
    llama_router_max_loaded,
)
from iop_node.adapters.upstream_errors import error_message
from schemas.config import LifecycleFlag
from schemas.wire import FailureCode, ModelState, ProviderStatus

log = logging.getLogger(__name__)

#: What llama.cpp's router offers: `/models`, `/models/load`, `/models/unload`.
ROUTER_LIFECYCLE: Final[list[LifecycleFlag]] = ["list_models", "load_model", "unload_model"]
#: What a vLLM in sleep mode offers: its listing, `/wake_up` and `/sleep`.
SLEEP_LIFECYCLE: Final[list[LifecycleFlag]] = ["list_models", "load_model", "unload_model"]
#: What the OpenAI API offers of a model's lifecycle: the listing.
LISTING_ONLY: Final[list[LifecycleFlag]] = ["list_models"]
#: Between looks at a router's listing while a model it was asked for loads. The runtime
#: has no event for it (its `/models/sse` says nothing); a load takes seconds to minutes.
LOAD_POLL_S: Final = 0.25
#: Looks at the listing in a row that may say nothing of a load (unanswered; or the model
#: `unloaded` before any look found the load under way) before the load is given up: a
#: runtime gone away, or one that never started the load, is not waited for until the
#: command's bound.
LOOKS_UNANSWERED: Final = 4
#: llama.cpp's answers to a load of a running model and an unload of a stopped one: done.
_ALREADY: Final = ("already running", "is not running")


class RuntimeLifecycle:
    """Asks one OpenAI-compatible runtime for its models' load states (remembering which
    questions it cannot answer) and to load or unload them."""

    def __init__(
        self, client: httpx2.AsyncClient, root_url: str, models_url: str, *, asks_sleep: bool
    ) -> None:
        """`root_url`: the server root (no `/v1`); `models_url`: its model listing;
        `asks_sleep`: the provider is a vLLM (it may have sleep mode)."""
        self._client = client
        self._root_url = root_url
        self._models_url = models_url
        self._asks_sleep = asks_sleep
        self._router = False
        """The last listing was a llama.cpp router's."""
        self.asleep = False
        """A vLLM in sleep mode, as its last probe or command left it."""
        self._waking = trio.Lock()

    async def status(self, provider_id: str, listing: LlamaListing) -> ProviderStatus:
        """An `available` status for a runtime whose listing answered, with what it says
        of its models' states."""
        models = [model.id for model in listing.data]
        states = from_llama_listing(listing)
        self._router = states is not None
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
        sleep_states = await self._sleep_states(models)
        return ProviderStatus(
            id=provider_id,
            health="available",
            models=models,
            lifecycle=LISTING_ONLY if sleep_states is None else SLEEP_LIFECYCLE,
            model_states=sleep_states,
        )

    async def _sleep_states(self, models: Sequence[str]) -> list[ModelState] | None:
        if not self._asks_sleep:
            return None
        body = await self.get_optional("/is_sleeping")
        states = None if body is None else from_vllm_sleep(models, body)
        if states is not None:
            self.asleep = any(state.state == "sleeping" for state in states)
        return states

    async def awake(self, timeout_s: float) -> None:
        """Wake a sleeping vLLM before a run (one wake-up for every run that finds it
        asleep). A wake-up that fails, or takes longer than `timeout_s`, fails the run as
        the provider's (`upstream_unreachable`, retryable: another provider may serve)."""
        if not self.asleep:
            return
        async with self._waking:
            if not self.asleep:
                return  # another run woke it
            error = f"the runtime did not wake within {timeout_s:g}s (adapter.load_timeout_s)"
            with trio.move_on_after(timeout_s):
                try:
                    await self.load("")
                except ModelCommandFailed as exc:
                    error = f"the runtime did not wake: {exc}"
                else:
                    return
            raise AdapterError(FailureCode.UPSTREAM_UNREACHABLE, error, retryable=True)

    # --- commands ----------------------------------------------------------------------

    async def load(self, model: str) -> None:
        """Load (or wake) `model`; returns once the runtime serves it."""
        if self._router:
            await self.post("/models/load", {"model": model}, done_if=_ALREADY)
            await self._wait_router_loaded(model)
        elif self._asks_sleep:
            await self.post("/wake_up", None)
            self.asleep = False
        else:
            raise ModelCommandFailed("this runtime does not load models on request")

    async def unload(self, model: str) -> None:
        """Unload `model` (put a vLLM to sleep); returns once the runtime has."""
        if self._router:
            await self.post("/models/unload", {"model": model}, done_if=_ALREADY)
        elif self._asks_sleep:
            await self.post("/sleep?level=1", None)
            self.asleep = True
        else:
            raise ModelCommandFailed("this runtime does not unload models on request")

    async def _wait_router_loaded(self, model: str) -> None:
        """Look at the router's listing until the load of `model` is over: `loaded`; or
        `unloaded` after a look found it `loading` (the runtime loaded it and has let it
        go since, between two looks: another load evicted it, or a client unloaded it;
        the load is done, and what the runtime holds now is the next probe's to say); or
        `failed` (raises). A look that says nothing of the load (the runtime does not
        answer: a dropped keep-alive connection, a 503 while it is busy; or it lists the
        model `unloaded` before any look found the load under way) is taken again, and
        `LOOKS_UNANSWERED` in a row fail the command."""
        silent = 0
        began = False
        while True:
            listing, problem = await self._router_listing()
            state = None
            if listing is not None:
                states = {state.name: state for state in from_llama_listing(listing) or ()}
                state = states.get(model)
                if state is None:
                    raise ModelCommandFailed(f"the runtime does not list {model!r}")
                if state.state == "loaded":
                    return
                if state.state == "failed":
                    raise ModelCommandFailed(f"{model} {state.reason or 'failed to load'}")
                if state.state == "unloaded" and began:
                    log.info("%s was loaded and unloaded again between two looks", model)
                    return
                if state.state == "unloaded":
                    problem = f"the runtime lists {model} unloaded, not loading"
            if state is None or state.state == "unloaded":
                silent += 1
                if silent >= LOOKS_UNANSWERED:
                    raise ModelCommandFailed(
                        f"{silent} looks at the runtime's listing found no load of {model} "
                        f"under way (the last: {problem})"
                    )
            else:
                silent, began = 0, True
            await trio.sleep(LOAD_POLL_S)

    async def _router_listing(self) -> tuple[LlamaListing | None, str]:
        """The router's listing now, or None and why not."""
        try:
            response = await self._client.get(
                self._models_url, headers={"Accept": "application/json"}
            )
        except httpx2.HTTPError as exc:
            return None, f"GET {self._models_url} failed: {exc}"
        if response.status_code != 200:
            detail = error_message(response.content) or ""
            return None, f"GET {self._models_url} returned {response.status_code} {detail}".strip()
        try:
            return LLAMA_LISTING_DECODER.decode(response.content), ""
        except msgspec.DecodeError as exc:
            return None, f"GET {self._models_url} returned an unreadable listing: {exc}"

    # --- requests ----------------------------------------------------------------------

    async def get_optional(self, path: str) -> bytes | None:
        """GET `path` at the server root: the body of a 200, else None (a 404 or 405 to
        `/is_sleeping` says the runtime has no sleep mode: it is not asked again)."""
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

    async def post(
        self, path: str, body: dict[str, Any] | None, *, done_if: Sequence[str] = ()
    ) -> bytes:
        """POST `body` to `path` at the server root; the answer's body, or
        `ModelCommandFailed` with the runtime's message. An error whose message has one
        of `done_if` in it says the runtime is already where it was asked to be."""
        content = b"" if body is None else json.dumps(body).encode()
        try:
            response = await self._client.post(
                self._root_url + path,
                content=content,
                headers={"Content-Type": "application/json", "Accept": "application/json"},
            )
        except httpx2.HTTPError as exc:
            raise ModelCommandFailed(f"POST {path} failed: {exc}") from exc
        if response.status_code < 300:
            return response.content
        detail = error_message(response.content) or ""
        if any(phrase in detail for phrase in done_if):
            return response.content
        suffix = f": {detail}" if detail else ""
        raise ModelCommandFailed(f"POST {path} returned {response.status_code}{suffix}")
