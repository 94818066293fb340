"""The numbers and fields every answer of the fake upstream shares, whatever protocol it
speaks (`fake_upstream` for chat, `fake_protocols` for Messages and Responses)."""

from __future__ import annotations

from typing import Any, Final

PROMPT_TOKENS: Final = 11
EMBEDDING: Final = [0.125, -0.5, 0.75]
#: Provider-specific top-level field on every body; its ASCII escape (\u00e9) would be
#: rewritten as raw UTF-8 by any JSON re-encoder.
EXTRA: Final[dict[str, Any]] = {"provider_extra": {"engine": "fake", "note": "caf\u00e9"}}
