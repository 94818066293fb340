"""A request translator called as the tests of both protocols call it: a request as a
dict in, the chat body as a dict out, or the `TranslationError` it raised; and the
requests agents sent, recorded in `fixtures/`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from iop_node.protocols import TranslationError

FIXTURES = Path(__file__).parent / "fixtures"

#: `messages_request_to_chat` or `responses_request_to_chat`.
Translator = Callable[[bytes], bytes]


def fixture(name: str) -> dict[str, Any]:
    """A recorded request of `fixtures/`."""
    loaded: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return loaded


def translated(translate: Translator, body: dict[str, Any]) -> dict[str, Any]:
    """The chat body `translate` makes of `body`."""
    chat: dict[str, Any] = json.loads(translate(json.dumps(body).encode()))
    return chat


def refusal(translate: Translator, body: dict[str, Any] | bytes) -> TranslationError:
    """The error `translate` refuses `body` with (raw bytes are sent as they are)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(TranslationError) as caught:
        translate(data)
    return caught.value
