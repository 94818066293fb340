"""The plan of an OpenAI chat completions, completions or embeddings request (design §8).

The body was decoded once into a dict (provider-specific fields pass through untouched);
here it is checked against the small view of the fields the Edge acts on
(`schemas.openai`), the model's generation defaults and limits are applied, and the
result is the `RunPlan` the dispatcher runs. Anything wrong is an `ApiError` naming the
field.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from iop_edge.core.snapshot import Snapshot
from iop_edge.http.errors import bad_request, invalid_request
from iop_edge.http.protocols.caller_protocol import Caller, catalog_model, check_max_tokens
from iop_edge.runtime.runs.dispatch import RunPlan
from schemas import openai as oai
from schemas import wire
from schemas.tokens import estimate_input_tokens

__all__ = ["MAX_CHOICES", "plan_chat"]

#: OpenAI's own bound on `n` (choices per request).
MAX_CHOICES: Final = 128

_VIEWS: Final[dict[wire.Operation, type[oai.RequestView]]] = {
    "chat": oai.ChatRequest,
    "completion": oai.CompletionRequest,
    "embedding": oai.EmbeddingRequest,
}


def plan_chat(
    operation: wire.Operation, body: dict[str, Any], snapshot: Snapshot, caller: Caller
) -> RunPlan:
    """The plan of a chat, completion or embedding request; raises `ApiError`."""
    try:
        view = msgspec.convert(body, _VIEWS[operation])
    except msgspec.ValidationError as exc:
        raise invalid_request(exc) from None
    model = catalog_model(snapshot, caller, view.model)
    stream = view.stream and operation != "embedding"
    caller_wants_usage = False
    if operation != "embedding":
        for key, value in model.generation.defaults.items():
            body.setdefault(key, value)
        for key in ("max_tokens", "max_completion_tokens"):
            check_max_tokens(model, key, body.get(key))
        choices = body.get("n")
        if isinstance(choices, int) and choices > MAX_CHOICES:
            raise bad_request(f"n={choices} exceeds the limit of {MAX_CHOICES}", param="n")
        if stream:
            # The Edge meters every stream, so it always asks for the usage chunk and
            # hides it from callers that did not ask for it themselves.
            options = body.get("stream_options")
            caller_wants_usage = isinstance(options, dict) and options.get("include_usage") is True
            body["stream_options"] = {**(options or {}), "include_usage": True}
    return caller.plan(
        snapshot,
        model_id=view.model,
        operation=operation,
        body=body,
        stream=stream,
        prompt_tokens=estimate_input_tokens(body),
        caller_wants_usage=caller_wants_usage,
    )
