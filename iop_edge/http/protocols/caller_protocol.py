"""What differs between the caller protocols at the HTTP surface (design §8, §14).

The run endpoints (`runs`) serve chat completions, Anthropic Messages and OpenAI Responses
with one flow; the differences are few and all here: which protocol a path speaks, who a
request is for (`Caller`), how a stream ends, and how the Edge writes a failure of its own
into a stream that already began.

In-stream failures (a stream that began, then failed): the Edge writes every one into
the caller's stream after it has recorded the run's end, in the caller's protocol (an
OpenAI error event then `[DONE]` for chat, Anthropic's `event: error`, a Responses
`response.failed`), whoever diagnosed it: the Node (the upstream's error, a broken
translation) reports a failure in `run_failed` and never writes the event itself, so a
failure event can never reach a caller before the run's end is recorded (a caller that
hangs up on it would otherwise be metered as gone, as with a stream's last events).
Neither Messages nor Responses ends its stream with a `[DONE]` line: the last event is
the end.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from iop_edge.core.routing.affinity import affinity_of
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.errors import ApiError, bad_request, model_not_found
from iop_edge.runtime.runs.dispatch import RunPlan
from schemas import wire
from schemas.config import ModelEntry, PrincipalToken
from schemas.hosted_tools import HostedTools
from schemas.protocols import CallerProtocol, response_error
from schemas.responses_echo import echo_members

__all__ = [
    "PROTOCOL_OF",
    "STREAM_END",
    "Caller",
    "apply_defaults",
    "catalog_model",
    "check_max_tokens",
    "protocol_of_request",
    "stream_error",
]

#: The protocol each run operation speaks to its caller.
PROTOCOL_OF: Final[dict[wire.Operation, CallerProtocol]] = {
    "chat": "chat",
    "completion": "chat",
    "embedding": "chat",
    "messages": "messages",
    "count_tokens": "messages",
    "responses": "responses",
}

#: The operations whose runs carry an affinity: those that read a conversation.
_ROUTED: Final[frozenset[wire.Operation]] = frozenset(
    {"chat", "completion", "messages", "responses"}
)

#: What ends a stream after its last event.
STREAM_END: Final[dict[CallerProtocol, bytes]] = {
    "chat": b"data: [DONE]\n\n",
    "messages": b"",
    "responses": b"",
}


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request is and the ids it goes by: what every protocol's plan needs besides
    the body."""

    run_id: str
    request_id: str
    principal: PrincipalToken
    anthropic_headers: dict[str, str]
    """The `anthropic-version` and `anthropic-beta` headers it sent, for a native
    upstream (never credentials)."""
    session_headers: Mapping[str, str] = field(default_factory=dict)
    """The session headers it sent (`core.routing.affinity.SESSION_HEADERS`), lowercase names."""

    def plan(
        self,
        snapshot: Snapshot,
        *,
        model_id: str,
        operation: wire.Operation,
        body: dict[str, Any],
        stream: bool,
        prompt_tokens: int,
        caller_wants_usage: bool,
        protocol: CallerProtocol = "chat",
        caller_headers: dict[str, str] | None = None,
        keep_output: bool = False,
        hosted_tools: HostedTools = "drop",
        chained: bool = False,
        previous_response_id: str = "",
    ) -> RunPlan:
        """The plan of this caller's request: its ids and principal go with the run, it
        is a long run when its prompt estimate reaches the snapshot's threshold, and it
        carries its affinity (`core.routing.affinity`) unless its model routes by load alone
        (`chained`: a Responses continuation, its conversation rebuilt in `body`)."""
        principal = self.principal
        routing = snapshot.models[model_id].routing
        affinity = None
        if routing.affinity and operation in _ROUTED:
            affinity = affinity_of(
                protocol,
                body,
                self.session_headers,
                principal=principal.principal_ref,
                model=model_id,
                shared_prefixes=routing.shared_prefixes,
                chained=chained,
            )
        return RunPlan(
            run_id=self.run_id,
            request_id=self.request_id,
            model_id=model_id,
            operation=operation,
            body=body,
            stream=stream,
            long=prompt_tokens >= snapshot.long_context_threshold_tokens,
            caller_wants_usage=caller_wants_usage,
            prompt_tokens=prompt_tokens,
            principal_ref=principal.principal_ref,
            token_ref=principal.token_ref,
            principal_alias=principal.alias,
            protocol=protocol,
            caller_headers=caller_headers if caller_headers is not None else {},
            keep_output=keep_output,
            hosted_tools=hosted_tools,
            affinity=affinity,
            previous_response_id=previous_response_id,
        )


def catalog_model(snapshot: Snapshot, caller: Caller, model_id: str) -> ModelEntry:
    """The catalog model a request names; 404 `model_not_found` when there is none, or
    when the caller's principal may not use it (the very same 404: an allow-list does not
    reveal what it hides)."""
    model = snapshot.models.get(model_id)
    if model is None or not snapshot.policies.allows(caller.principal.principal_ref, model_id):
        raise model_not_found(model_id)
    return model


def check_max_tokens(model: ModelEntry, field: str, requested: object) -> None:
    """400 `max_tokens_exceeded` naming `field` when a request asks for more tokens than
    the model's `generation.max_tokens_limit`, in any protocol."""
    limit = model.generation.max_tokens_limit
    if isinstance(requested, int) and requested > limit:
        raise bad_request(
            f"{field}={requested} exceeds this model's limit of {limit}",
            param=field,
            code="max_tokens_exceeded",
        )


def apply_defaults(model: ModelEntry, body: dict[str, Any], fields: Mapping[str, str]) -> None:
    """The model's `generation.defaults` a protocol has a setting for, where the caller
    set none: `fields` maps a default's key (chat's name) to the protocol's field; a
    default with no counterpart is not applied."""
    for key, value in model.generation.defaults.items():
        if key in fields:
            body.setdefault(fields[key], value)


def protocol_of_request(path: str, *, anthropic_version: bool) -> CallerProtocol:
    """The protocol whose error shape a request outside the run endpoints gets: Anthropic's
    for its paths and for any request that says `anthropic-version` (an Anthropic client
    listing models, say), OpenAI's otherwise."""
    if anthropic_version or path.startswith("/v1/messages"):
        return "messages"
    return "chat"


class _FailedResponse(msgspec.Struct, frozen=True, kw_only=True):
    """A failed Response's own members; the echo of its request follows them
    (`schemas.responses_echo`), so it has every member the schema requires."""

    id: str
    object: str = "response"
    created_at: int
    completed_at: None = None
    status: str = "failed"
    background: bool = False
    error: _ResponseError
    incomplete_details: None = None
    model: str
    output: list[Any] = []
    usage: None = None


class _ResponseError(msgspec.Struct, frozen=True, kw_only=True):
    code: str
    message: str


class _ResponseFailed(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "response.failed"
    sequence_number: int
    response: msgspec.Raw


_encode: Final = msgspec.json.Encoder().encode


def stream_error(
    protocol: CallerProtocol,
    error: ApiError,
    *,
    plan: RunPlan,
    response_id: str,
    sequence: int,
    request_id: str | None = None,
) -> bytes:
    """`error` as the event that ends a stream of `plan`'s in `protocol`.

    For Responses, `sequence` is the event's `sequence_number` (the events the stream
    carried so far: they count from 0) and `response_id` the id the failed response
    goes by (the Edge does not read the Node's events, so it cannot know theirs); the
    response echoes the request as the Node's do. For Messages, `request_id` is the
    caller's request, which the error event names."""
    if protocol == "messages":
        return b"event: error\ndata: " + error.body(protocol, request_id) + b"\n\n"
    if protocol == "responses":
        kind, text = response_error(error.code, error.message)
        own = _FailedResponse(
            id=response_id,
            created_at=int(time.time()),
            model=plan.model_id,
            error=_ResponseError(code=kind, message=text),
        )
        echo = echo_members(
            _encode(plan.body),
            stored=plan.keep_output,
            previous_response_id=plan.previous_response_id or None,
        )
        failed = _ResponseFailed(
            sequence_number=sequence, response=msgspec.Raw(_encode(own)[:-1] + echo)
        )
        return b"event: response.failed\ndata: " + _encode(failed) + b"\n\n"
    return b"data: " + error.body(protocol) + b"\n\n"
