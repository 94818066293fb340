"""What the runtime's context holds, asked only when a stream ended without a word.

llama.cpp's server (and llama-cpp-python) answers a streamed prompt longer than its
context with a 200 and an empty stream. So when a stream ends without an event, the
adapter asks, within `OVERFLOW_CHECK_S`: the context size (learnt from an earlier
overflow answer's `n_ctx`, else llama.cpp's `GET /props`) against the prompt's tokens
(the runtime's tokenizer, else IOP's estimate) and the output the request asks room for
(llama-cpp-python counts both). Over it: a 400 `context_length_exceeded` naming the
input field; else the failure it was (a broken stream).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

import httpx2
import msgspec
import trio

from iop_node.adapters.base import AdapterError
from iop_node.adapters.upstream_errors import CONTEXT_LENGTH_EXCEEDED, INPUT_FIELDS
from schemas.tokens import estimate_input_tokens
from schemas.wire import FailureCode, Run

__all__ = ["OVERFLOW_CHECK_S", "ContextWindow"]

#: Bound on what a failed stream may spend finding out whether it was a context overflow.
OVERFLOW_CHECK_S: Final = 2.0

#: The runtime's count of a request's prompt tokens (None: it cannot count).
CountPrompt = Callable[[str, dict[str, Any]], Awaitable[int | None]]


class _PropsView(msgspec.Struct):
    """llama.cpp's `GET /props`, as far as the context size goes (per slot)."""

    n_ctx: int | None = None
    default_generation_settings: dict[str, Any] | None = None

    def context_tokens(self) -> int | None:
        settings = self.default_generation_settings or {}
        value = settings.get("n_ctx", self.n_ctx)
        return value if isinstance(value, int) and value > 0 else None


_props_decoder: Final = msgspec.json.Decoder(_PropsView)
_request_decoder: Final = msgspec.json.Decoder(dict[str, Any])


class ContextWindow:
    """One runtime's context size, once learnt (see the module docstring)."""

    __slots__ = ("_absent", "_client", "_props_url", "tokens")

    def __init__(self, client: httpx2.AsyncClient, root_url: str) -> None:
        self._client = client
        self._props_url = root_url + "/props"
        self._absent = False
        self.tokens: int | None = None
        """The runtime's context size (per slot), once learnt."""

    def learn(self, tokens: int | None) -> None:
        """An answer said the context size (an overflow's `n_ctx`)."""
        if tokens is not None:
            self.tokens = tokens

    async def overflow_or(
        self, run: Run, failure: AdapterError, count_prompt: CountPrompt
    ) -> AdapterError:
        """What an empty stream of `run` was: a context overflow, else `failure`."""
        with trio.move_on_after(OVERFLOW_CHECK_S):
            context = self.tokens or await self._fetch()
            if context is None:
                return failure
            body = _decode_body(run.body)
            if body is None:
                return failure
            counted = await count_prompt(run.target, body)
            tokens = estimate_input_tokens(body) if counted is None else counted
            output = _max_output_tokens(body)
            if tokens + output > context:
                asked = f" and {output} of output" if output else ""
                return AdapterError(
                    FailureCode.UPSTREAM_REJECTED,
                    f"the request needs about {tokens} tokens of prompt{asked}, more than "
                    f"the provider's context of {context} tokens (the upstream ended the "
                    "stream without a word)",
                    status=400,
                    upstream_code=CONTEXT_LENGTH_EXCEEDED,
                    param=INPUT_FIELDS.get(run.operation),
                )
        return failure

    async def _fetch(self) -> int | None:
        """The context size from llama.cpp's `GET /props` (asked until it says there is
        no such route)."""
        if self._absent:
            return None
        try:
            response = await self._client.get(
                self._props_url, headers={"Accept": "application/json"}
            )
        except httpx2.HTTPError:
            return None
        if response.status_code in (404, 405):
            self._absent = True
            return None
        try:
            tokens = _props_decoder.decode(response.content).context_tokens()
        except msgspec.DecodeError:
            return None
        self.learn(tokens)
        return tokens


def _max_output_tokens(body: dict[str, Any]) -> int:
    """The output a request asks room for (its `max_completion_tokens` or `max_tokens`)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _decode_body(body: bytes) -> dict[str, Any] | None:
    """A run's request body as a dict (None if it is not one)."""
    try:
        return _request_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
