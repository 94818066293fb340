"""The adapter for Ollama: inference through its OpenAI-compatible API, health through its own.

Ollama serves the OpenAI API under `/v1` (chat, completions, embeddings, SSE streams ending
with `[DONE]`, OpenAI-shaped error bodies), so runs go through `OpenAICompatAdapter`
unchanged and `adapter.base_url` is that `/v1` URL (default `http://127.0.0.1:11434/v1`).
Health and the model list come from the native API at the server root instead, because
that is where Ollama tells the truth about what is installed:

- `GET {root}/api/tags` -> `{"models": [{"name": "llama3.2:latest", "model": ..., ...}]}`;
  the `name`s are exactly the ids its `/v1` endpoints accept;
- `GET {root}/api/version` -> `{"version": "0.6.2"}`, reported in the status detail and
  used to tell which lifecycle operations the native API offers (`lifecycle_of`): listing
  (`GET /api/tags`), pulling (`POST /api/pull`) and deleting (`DELETE /api/delete`) models
  exist in every release; loading and unloading (`POST /api/generate` with `keep_alive`:
  `-1` keeps a model loaded, `0` unloads it) since 0.1.23. The Node reports them in
  `status`, and the catalog shows them beside the flags the config declares;
- `GET {root}/api/ps` -> the models in memory now: with the tags, each model's load state
  (`model_states`, design §18).

The Edge, not each caller, owns keep-alive (`models[].lifecycle`, design §18.4): a
caller's `keep_alive` in a request body (`0` unloads the model when the request ends, for
everyone) is taken out before the request reaches Ollama (`without_keep_alive`).
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from iop_node.adapters.base import Emit, EmitEvents, RunResult
from iop_node.adapters.model_states import from_ollama
from iop_node.adapters.openai_compat import OpenAICompatAdapter
from iop_node.protocols.native import NativeForm
from schemas.config import LifecycleFlag, ProviderConfig
from schemas.wire import ProviderStatus, Run

_KEEP_ALIVE: Final = b'"keep_alive"'


def without_keep_alive(run: Run) -> Run:
    """`run` with the caller's `keep_alive` taken out of its body (the module doc). A body
    that does not name it is not decoded at all."""
    if _KEEP_ALIVE not in run.body:
        return run
    try:
        body = msgspec.json.decode(run.body)
    except msgspec.DecodeError:
        return run  # the upstream says what is wrong with it
    if not isinstance(body, dict) or "keep_alive" not in body:
        return run
    del body["keep_alive"]
    return msgspec.structs.replace(run, body=msgspec.json.encode(body))


class _TagView(msgspec.Struct):
    name: str


class _Tags(msgspec.Struct):
    models: list[_TagView] | None = None


class _Version(msgspec.Struct):
    version: str = ""


#: The first Ollama release whose native API offers each lifecycle operation.
_LIFECYCLE_SINCE: Final[dict[LifecycleFlag, tuple[int, ...]]] = {
    "list_models": (0,),
    "load_model": (0, 1, 23),
    "unload_model": (0, 1, 23),
    "pull_model": (0,),
    "delete_model": (0,),
}
_VERSION_PART: Final = re.compile(r"\d+")

_tags_decoder: Final = msgspec.json.Decoder(_Tags)
_version_decoder: Final = msgspec.json.Decoder(_Version)


def lifecycle_of(version: str) -> list[LifecycleFlag]:
    """The lifecycle operations the native API of Ollama `version` offers.

    Release versions look like `0.6.2` (pre-releases `0.6.2-rc1`); a version we cannot
    read (a source build reports `0.0.0`) is taken to be a current one."""
    parts = tuple(int(part) for part in _VERSION_PART.findall(version.partition("-")[0])[:3])
    if not parts or parts == (0, 0, 0):
        return list(_LIFECYCLE_SINCE)
    return [flag for flag, since in _LIFECYCLE_SINCE.items() if parts >= since]


def native_root(base_url: str) -> str:
    """The server root behind an OpenAI-compatible `/v1` base URL."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


class OllamaAdapter(OpenAICompatAdapter):
    """`OpenAICompatAdapter` for runs; Ollama's native `/api/tags` for health and models."""

    def __init__(self, provider: ProviderConfig) -> None:
        super().__init__(provider)
        self.root_url = native_root(self.base_url)

    async def _check_health(self) -> ProviderStatus:
        tags = await self._get_json(self.root_url + "/api/tags", _tags_decoder, "/api/tags")
        version = await self._get_json(
            self.root_url + "/api/version", _version_decoder, "/api/version"
        )
        models = [tag.name for tag in tags.models or ()]
        running = await self._lifecycle.get_optional("/api/ps")
        return ProviderStatus(
            id=self.provider.id,
            health="available",
            models=models,
            detail=f"ollama {version.version}" if version.version else None,
            lifecycle=lifecycle_of(version.version),
            model_states=None if running is None else from_ollama(models, running),
        )

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        return await super().execute(without_keep_alive(run), emit)

    async def execute_native(self, run: Run, native: NativeForm, events: EmitEvents) -> RunResult:
        return await super().execute_native(without_keep_alive(run), native, events)

    async def load_model(self, model: str) -> None:
        """`base.ModelLifecycle`: a generate request with no prompt loads the model, kept
        loaded until the Edge unloads it (`keep_alive: -1`: the Edge owns keep-alive)."""
        await self._lifecycle.post(
            "/api/generate", {"model": model, "keep_alive": -1, "stream": False}
        )

    async def unload_model(self, model: str) -> None:
        await self._lifecycle.post(
            "/api/generate", {"model": model, "keep_alive": 0, "stream": False}
        )
