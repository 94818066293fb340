"""The adapter for Ollama: inference through its OpenAI-compatible API, health through its own.

Ollama serves the OpenAI API under `/v1` (chat, completions, embeddings, SSE streams ending
with `[DONE]`, OpenAI-shaped error bodies), so runs go through `OpenAICompatAdapter`
unchanged and `adapter.base_url` is that `/v1` URL (default `http://127.0.0.1:11434/v1`).
Health and the model list come from the native API at the server root instead, because
that is where Ollama tells the truth about what is installed:

- `GET {root}/api/tags` -> `{"models": [{"name": "llama3.2:latest", "model": ..., ...}]}`;
  the `name`s are exactly the ids its `/v1` endpoints accept;
- `GET {root}/api/version` -> `{"version": "0.6.2"}`, reported in the status detail.
"""

from __future__ import annotations

from typing import ClassVar, Final

import msgspec

from iop_node.adapters.openai_compat import OpenAICompatAdapter
from schemas.config import ProviderConfig
from schemas.wire import ProviderStatus


class _TagView(msgspec.Struct):
    name: str


class _Tags(msgspec.Struct):
    models: list[_TagView] | None = None


class _Version(msgspec.Struct):
    version: str = ""


_tags_decoder: Final = msgspec.json.Decoder(_Tags)
_version_decoder: Final = msgspec.json.Decoder(_Version)


def native_root(base_url: str) -> str:
    """The server root behind an OpenAI-compatible `/v1` base URL."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


class OllamaAdapter(OpenAICompatAdapter):
    """`OpenAICompatAdapter` for runs; Ollama's native `/api/tags` for health and models."""

    default_base_url: ClassVar[str | None] = "http://127.0.0.1:11434/v1"

    def __init__(self, provider: ProviderConfig) -> None:
        super().__init__(provider)
        self.root_url = native_root(self.base_url)

    async def _check_health(self) -> ProviderStatus:
        tags = await self._get_json(self.root_url + "/api/tags", _tags_decoder, "/api/tags")
        version = await self._get_json(
            self.root_url + "/api/version", _version_decoder, "/api/version"
        )
        return ProviderStatus(
            id=self.provider.id,
            health="available",
            models=[tag.name for tag in tags.models or ()],
            detail=f"ollama {version.version}" if version.version else None,
        )
