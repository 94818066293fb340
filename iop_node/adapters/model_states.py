"""Which served models a runtime holds in memory, read from its own lifecycle API (design §18).

Runtimes that serve more models than their memory holds load and unload them on their
own; the Edge places runs (and loads) well only if it knows, per provider, which models
start at once and which would first be loaded. Each runtime says so its own way, and
this module reads each answer into one vocabulary, `schemas.wire.ModelState`:

- **llama.cpp's router** (`llama-server --models-dir/--models-preset`): every entry of
  its model list (`GET /v1/models`, the same as `/models`) carries a `status` object,
  `{"value": "unloaded" | "loading" | "loaded" | "sleeping"}`, plus `"failed": true` and
  an `exit_code` when the model's instance could not start. A server that serves one
  model (no router) lists no `status`: its model is simply loaded. `GET /props` answers
  `{"role": "router", "max_instances": N}`: how many models it keeps loaded at once
  (`--models-max`, 0 = no bound).
- **Ollama**: `GET /api/tags` lists the models on disk, `GET /api/ps` those in memory.
- **LM Studio** (0.4+): `GET /api/v1/models` lists `models[]`, each with its `key` and
  its `loaded_instances` (none: not loaded).
- **vLLM** with sleep mode: `GET /is_sleeping` answers `{"is_sleeping": bool}`; asleep,
  every model it serves is `sleeping` (woken in seconds, not reloaded). A vLLM without
  sleep mode answers 404 there, and its models are always loaded.

Rules:

1. A reader returns None when the answer says nothing of load states (a server that is
   not a router, an unknown shape): the Edge then takes the listed models as loaded,
   as it always did, rather than guessing.
2. A failed model is `failed` with the runtime's reason, whatever else its entry says:
   a run sent to it would fail, and the operator must see why.
3. States are listed in the runtime's order, one per model name; a name listed twice
   keeps its first entry.

Pure: the adapters fetch, this module reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import msgspec

from schemas.wire import ModelLoadState, ModelState

__all__ = [
    "LLAMA_LISTING_DECODER",
    "LLAMA_PROPS_DECODER",
    "LMSTUDIO_DECODER",
    "OLLAMA_PS_DECODER",
    "VLLM_SLEEP_DECODER",
    "LlamaListing",
    "from_llama_listing",
    "from_lmstudio",
    "from_ollama",
    "from_vllm_sleep",
    "llama_router_max_loaded",
    "loaded_instances",
]


# --- llama.cpp router ----------------------------------------------------------------------


class _LlamaStatus(msgspec.Struct):
    value: str = ""
    failed: bool = False
    exit_code: int | None = None


class _LlamaModel(msgspec.Struct):
    id: str
    status: _LlamaStatus | None = None


class LlamaListing(msgspec.Struct):
    """`GET /v1/models` as any OpenAI-compatible server answers it, with llama.cpp's
    router `status` where there is one."""

    data: list[_LlamaModel]


class _LlamaProps(msgspec.Struct):
    role: str = ""
    max_instances: int | None = None


LLAMA_LISTING_DECODER: Final = msgspec.json.Decoder(LlamaListing)
LLAMA_PROPS_DECODER: Final = msgspec.json.Decoder(_LlamaProps)

#: llama.cpp's status values, as IOP names them (the same words).
_LLAMA_STATES: Final[dict[str, ModelLoadState]] = {
    "loaded": "loaded",
    "loading": "loading",
    "unloaded": "unloaded",
    "sleeping": "sleeping",
}


def from_llama_listing(listing: LlamaListing) -> list[ModelState] | None:
    """Each listed model's state, or None when no entry has a router `status` (rule 1)."""
    if not any(model.status is not None for model in listing.data):
        return None
    states: list[ModelState] = []
    for model in listing.data:
        status = model.status
        if status is None:
            continue
        if status.failed:
            code = "" if status.exit_code is None else f" (exit code {status.exit_code})"
            states.append(ModelState(name=model.id, state="failed", reason=f"failed to load{code}"))
        elif status.value in _LLAMA_STATES:
            states.append(ModelState(name=model.id, state=_LLAMA_STATES[status.value]))
        else:
            reason = f"the runtime reports {status.value!r}" if status.value else None
            states.append(ModelState(name=model.id, state="unloaded", reason=reason))
    return _first_of_each(states)


def llama_router_max_loaded(body: bytes) -> int | None:
    """How many models a llama.cpp router keeps loaded at once (`--models-max`), from its
    `GET /props`; None for a server that is not a router, or sets no bound."""
    try:
        props = LLAMA_PROPS_DECODER.decode(body)
    except msgspec.DecodeError:
        return None
    if props.role != "router" or not props.max_instances or props.max_instances < 0:
        return None
    return props.max_instances


# --- Ollama ----------------------------------------------------------------------------------


class _OllamaRunning(msgspec.Struct):
    name: str


class _OllamaPs(msgspec.Struct):
    models: list[_OllamaRunning] | None = None


OLLAMA_PS_DECODER: Final = msgspec.json.Decoder(_OllamaPs)


def from_ollama(on_disk: Iterable[str], ps_body: bytes) -> list[ModelState] | None:
    """Ollama's models on disk (`/api/tags`), each `loaded` when `/api/ps` lists it.
    A model in memory that is not on disk any more is listed too (it still answers)."""
    try:
        running = OLLAMA_PS_DECODER.decode(ps_body)
    except msgspec.DecodeError:
        return None
    loaded = {model.name for model in running.models or ()}
    names = [*on_disk, *sorted(loaded)]
    states = [
        ModelState(name=name, state="loaded" if name in loaded else "unloaded") for name in names
    ]
    return _first_of_each(states)


# --- LM Studio -------------------------------------------------------------------------------


class _LmStudioInstance(msgspec.Struct):
    id: str = ""


class _LmStudioModel(msgspec.Struct):
    key: str
    type: str = "llm"
    loaded_instances: list[_LmStudioInstance] = []


class _LmStudioModels(msgspec.Struct):
    models: list[_LmStudioModel]


LMSTUDIO_DECODER: Final = msgspec.json.Decoder(_LmStudioModels)


def loaded_instances(body: bytes) -> dict[str, list[str]]:
    """LM Studio's `GET /api/v1/models`: each loaded model's instance ids."""
    try:
        listing = LMSTUDIO_DECODER.decode(body)
    except msgspec.DecodeError:
        return {}
    return {
        model.key: [instance.id for instance in model.loaded_instances]
        for model in listing.models
        if model.loaded_instances
    }


def from_lmstudio(body: bytes) -> list[ModelState] | None:
    """LM Studio's `GET /api/v1/models`: a model is loaded while it has an instance.
    Embedding models are left out: no caller protocol of IOP runs them."""
    try:
        listing = LMSTUDIO_DECODER.decode(body)
    except msgspec.DecodeError:
        return None
    states = [
        ModelState(name=model.key, state="loaded" if model.loaded_instances else "unloaded")
        for model in listing.models
        if model.type != "embedding"
    ]
    return _first_of_each(states)


# --- vLLM sleep mode -------------------------------------------------------------------------


class _VllmSleep(msgspec.Struct):
    is_sleeping: bool


VLLM_SLEEP_DECODER: Final = msgspec.json.Decoder(_VllmSleep)


def from_vllm_sleep(served: Iterable[str], body: bytes) -> list[ModelState] | None:
    """vLLM's `GET /is_sleeping`: asleep, every model it serves is `sleeping`."""
    try:
        sleeping = VLLM_SLEEP_DECODER.decode(body).is_sleeping
    except msgspec.DecodeError:
        return None
    state: ModelLoadState = "sleeping" if sleeping else "loaded"
    return _first_of_each(ModelState(name=name, state=state) for name in served)


def _first_of_each(states: Iterable[ModelState]) -> list[ModelState]:
    """Rule 3: one state per name, the first listed."""
    seen: dict[str, ModelState] = {}
    for state in states:
        seen.setdefault(state.name, state)
    return list(seen.values())
