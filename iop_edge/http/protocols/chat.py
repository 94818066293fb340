"""OpenAI chat completions (and completions, embeddings) at the Edge (design §8, §14): the
`CHAT` protocol object, and the plan of its requests.

The body was decoded once into a dict (provider-specific fields pass through untouched);
here it is checked against the small view of the fields the Edge acts on
(`schemas.openai`), the model's generation defaults and limits are applied, and the
result is the `RunPlan` the dispatcher runs. Anything wrong is an `ApiError` naming the
field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

import msgspec

from iop_edge.core.generation_defaults import MAX_CHOICES
from iop_edge.core.responses.protocol_requests import openai_tool_choice_problem
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.errors import bad_request, invalid_request
from iop_edge.http.protocols.caller_protocol import (
    Caller,
    CallerProtocol,
    Planning,
    ToStore,
    catalog_model,
    check_max_tokens,
)
from iop_edge.runtime.runs.dispatch import RunPlan
from schemas import openai as oai
from schemas import wire
from schemas.tokens import estimate_input_tokens

__all__ = ["CHAT", "ChatProtocol", "plan_chat"]

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
        choice = body.get("tool_choice")
        if choice is not None and operation == "chat":
            problem = openai_tool_choice_problem(choice, body.get("tools"), nested=True)
            if problem is not None:
                raise bad_request(problem, param="tool_choice")
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
        protocol=CHAT,
    )


class ChatProtocol(CallerProtocol):
    """OpenAI's chat completions, and the legacy completions and embeddings, which only
    ever go natively: OpenAI's shapes (the defaults), streams ended by `[DONE]`."""

    name = "chat"
    paths: ClassVar[Mapping[str, wire.Operation]] = {
        "/v1/chat/completions": "chat",
        "/v1/completions": "completion",
        "/v1/embeddings": "embedding",
    }
    output_fields: ClassVar[Mapping[wire.Operation, tuple[str, ...]]] = {
        "chat": ("max_completion_tokens", "max_tokens"),
        "completion": ("max_tokens",),
    }
    stream_end = b"data: [DONE]\n\n"

    async def plan(
        self, operation: wire.Operation, request: Planning
    ) -> tuple[RunPlan, ToStore | None]:
        return plan_chat(operation, request.body, request.snapshot, request.caller), None


CHAT: Final = ChatProtocol()
