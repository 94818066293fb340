"""The Anthropic Messages surface's Edge side (design §14): the `MESSAGES` protocol object,
the plan of a `POST /v1/messages` or `/v1/messages/count_tokens`, and Anthropic's shapes
(errors, rate-limit headers, the model list) for its clients.

The Edge reads the few fields admission needs (`core.responses.protocol_requests`) and relays the
body: the Node sends it natively to a provider that speaks Messages or translates it to
chat completions. Same catalog, aliases, limits and long-context admission as chat:

- `max_tokens` above the model's `generation.max_tokens_limit` is a 400, as for chat.
- `generation.defaults` apply where the protocol has the same setting (`DEFAULT_KEYS`):
  a chat default with no Messages counterpart is not applied.
- The caller's `anthropic-version` and `anthropic-beta` headers travel with the run, for a
  native upstream. Its query string does not: Anthropic's SDKs mark their beta namespace
  with `?beta=true`, but the betas themselves are named by `anthropic-beta`, and no
  runtime reads the flag (llama.cpp's server, vLLM and Ollama ignore query parameters on
  `/v1/messages`). Passing a caller's query on would let it add parameters the operator
  did not configure to the upstream request (a proxy's `api-version` or key parameter).
- `count_tokens` runs on a provider too (its tokenizer knows the count), but consumes
  nothing: its plan's prompt estimate is 0 and it is never a long run.
- Claude Code's attribution block (`generation.strip_agent_attribution`, on by default)
  is removed from the body before the run, of a Messages or count_tokens request alike
  (the count is of what the model reads): it changes with every request and sits
  first in the prompt, where it keeps a runtime's prompt cache from ever hitting. Only
  a first `system` block of exactly its shape goes (`strip_attribution`); nothing else
  in the body is touched.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar, Final

import msgspec

from iop_edge.core.responses.protocol_requests import (
    CountTokensRequest,
    MessagesRequest,
    estimate_messages_tokens,
)
from iop_edge.core.routing.affinity import messages_conversation
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.errors import ApiError, bad_request, echoed, invalid_request
from iop_edge.http.protocols.caller_protocol import (
    Caller,
    CallerProtocol,
    Planning,
    ToStore,
    apply_defaults,
    catalog_model,
    check_max_tokens,
)
from iop_edge.http.rate_limit_headers import Headers, anthropic_rate_limit_headers
from iop_edge.runtime.runs.dispatch import RunPlan
from iop_edge.runtime.runs.limits import RateLimits
from schemas import wire
from schemas.config import ModelEntry
from schemas.hosted_tools import hosted_tool_types

__all__ = [
    "DEFAULT_KEYS",
    "MESSAGES",
    "AnthropicModel",
    "AnthropicModelList",
    "MessagesProtocol",
    "anthropic_model",
    "model_page",
    "plan_messages",
    "strip_attribution",
]

#: A model's `generation.defaults` key (chat's name) -> the Messages field it sets.
DEFAULT_KEYS: Final = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
}
#: Anthropic's default and largest page of `GET /v1/models`.
DEFAULT_PAGE: Final = 20
MAX_PAGE: Final = 1000


def plan_messages(
    operation: wire.Operation, body: dict[str, Any], snapshot: Snapshot, caller: Caller
) -> RunPlan:
    """The plan of a Messages (`messages`) or count_tokens (`count_tokens`) request;
    raises `ApiError`."""
    counting = operation == "count_tokens"
    try:
        view = msgspec.convert(body, CountTokensRequest if counting else MessagesRequest)
    except msgspec.ValidationError as exc:
        raise invalid_request(exc) from None
    model = catalog_model(snapshot, caller, view.model)
    if (
        model.generation.strip_agent_attribution
        and isinstance(view.system, list)
        and strip_attribution(body)
    ):
        view = msgspec.structs.replace(view, system=view.system[1:] or None)
    stream = False
    prompt_tokens = 0
    if (problem := view.tool_choice_problem()) is not None:
        raise bad_request(problem, param="tool_choice")
    if isinstance(view, MessagesRequest):
        check_max_tokens(model, "max_tokens", view.max_tokens)
        apply_defaults(model, body, DEFAULT_KEYS)
        stream = view.stream
        prompt_tokens = estimate_messages_tokens(view)
    return caller.plan(
        snapshot,
        model_id=view.model,
        operation=operation,
        body=body,
        stream=stream,
        prompt_tokens=prompt_tokens,
        caller_wants_usage=True,  # usage is part of every Messages reply and stream
        protocol=MESSAGES,
        caller_headers=caller.anthropic_headers,
        hosted_tools=model.generation.hosted_tools,
    )


class MessagesProtocol(CallerProtocol):
    """Anthropic Messages: Anthropic's error body (an `event: error` in a stream),
    rate-limit headers and model list; its clients are also known by `anthropic-version`
    outside the run endpoints."""

    name = "messages"
    paths: ClassVar[Mapping[str, wire.Operation]] = {
        "/v1/messages": "messages",
        "/v1/messages/count_tokens": "count_tokens",
    }
    output_fields: ClassVar[Mapping[wire.Operation, tuple[str, ...]]] = {
        "messages": ("max_tokens",)
    }

    def conversation(self, body: Mapping[str, Any]) -> tuple[list[Any], Sequence[Any]]:
        return messages_conversation(body)

    async def plan(
        self, operation: wire.Operation, request: Planning
    ) -> tuple[RunPlan, ToStore | None]:
        return plan_messages(operation, request.body, request.snapshot, request.caller), None

    def error_body(self, error: ApiError, request_id: str | None = None) -> bytes:
        return error.anthropic_body(request_id)

    def stream_error(
        self, error: ApiError, *, plan: RunPlan, sequence: int, request_id: str | None = None
    ) -> bytes:
        return b"event: error\ndata: " + error.anthropic_body(request_id) + b"\n\n"

    def rate_limit_headers(self, limits: RateLimits) -> Headers:
        return anthropic_rate_limit_headers(limits)

    def claims(self, path: str, header_names: Collection[str]) -> bool:
        """Anthropic's clients: a request on its paths, or one that says
        `anthropic-version` (an Anthropic client listing models, say)."""
        return path.startswith("/v1/messages") or "anthropic-version" in header_names

    def model_list(
        self, models: Mapping[str, ModelEntry], created_unix: int, query: Mapping[str, str]
    ) -> bytes:
        return _encode(model_page(models, created_unix, query))

    def model(self, entry: ModelEntry, created_unix: int) -> bytes:
        return _encode(anthropic_model(entry, created_unix))

    def hosted_tools(self, body: dict[str, Any]) -> Sequence[str]:
        return hosted_tool_types(self.name, body)


MESSAGES: Final = MessagesProtocol()
_encode: Final = msgspec.json.Encoder().encode


# --- Claude Code's attribution block ---------------------------------------------------

#: The text of the block, whole: the header's name, then `key=value;` pairs
#: (`cc_version=2.1.197.0df; cc_entrypoint=cli; cch=fa690;`), values without spaces.
_ATTRIBUTION: Final = re.compile(r"x-anthropic-billing-header:(?: [a-z][a-z0-9_]*=[^;\s]*;)+")
_ATTRIBUTION_PREFIX: Final = "x-anthropic-billing-header:"


def strip_attribution(body: dict[str, Any]) -> bool:
    """Remove Claude Code's attribution block from a Messages body; True when it was there.

    The block is the first of a `system` list, exactly `{"type": "text", "text":
    "x-anthropic-billing-header: k=v; ...;"}` (no other key, no other text): a block
    with anything more is the caller's content and stays. A `system` left empty is
    removed, as if the caller had sent none."""
    system = body.get("system")
    if not isinstance(system, list) or not system:
        return False
    first = system[0]
    if not isinstance(first, dict) or len(first) != 2 or first.get("type") != "text":
        return False
    text = first.get("text")
    if (
        not isinstance(text, str)
        or not text.startswith(_ATTRIBUTION_PREFIX)
        or _ATTRIBUTION.fullmatch(text) is None
    ):
        return False
    del system[0]
    if not system:
        del body["system"]
    return True


# --- GET /v1/models in Anthropic's shape ----------------------------------------------


class AnthropicModel(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "model"
    id: str
    display_name: str
    created_at: str
    """RFC 3339."""


class AnthropicModelList(msgspec.Struct, frozen=True, kw_only=True):
    data: list[AnthropicModel]
    has_more: bool
    first_id: str | None
    last_id: str | None


def anthropic_model(entry: ModelEntry, created_unix: int) -> AnthropicModel:
    created = datetime.datetime.fromtimestamp(created_unix, datetime.UTC)
    return AnthropicModel(
        id=entry.id,
        display_name=entry.display_name or entry.id,
        created_at=created.isoformat().replace("+00:00", "Z"),
    )


def model_page(
    models: Mapping[str, ModelEntry], created_unix: int, query: Mapping[str, str]
) -> AnthropicModelList:
    """One page of the catalog as Anthropic lists models: `limit` (1-1000, default 20),
    `after_id` or `before_id` (cursors, as its SDK pages with them); an unknown cursor
    or a bad limit is a 400 naming the parameter."""
    raw_limit = query.get("limit", str(DEFAULT_PAGE))
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_PAGE:
        raise bad_request(f"limit must be an integer from 1 to {MAX_PAGE}", param="limit")
    limit = int(raw_limit)
    ids = list(models)
    after, before = query.get("after_id"), query.get("before_id")
    for name, cursor in (("after_id", after), ("before_id", before)):
        if cursor is not None and cursor not in models:
            raise bad_request(f"{name}: no model '{echoed(cursor)}'", param=name)
    if before is not None:
        end = ids.index(before)
        page = ids[max(0, end - limit) : end]
        has_more = end - limit > 0
    else:
        start = ids.index(after) + 1 if after is not None else 0
        page = ids[start : start + limit]
        has_more = start + limit < len(ids)
    return AnthropicModelList(
        data=[anthropic_model(models[model_id], created_unix) for model_id in page],
        has_more=has_more,
        first_id=page[0] if page else None,
        last_id=page[-1] if page else None,
    )
