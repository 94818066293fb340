"""What differs between the caller protocols at the HTTP surface (design §8, §14): one
`CallerProtocol` object per protocol, found by name or path in one registry
(`protocol_registry`).

The run endpoints (`runs`) serve chat completions, Anthropic Messages and OpenAI Responses
with one flow; what differs is the protocol object's, and nothing else branches on a
protocol's name:

- the run endpoints it serves (`paths`: path -> operation) and how it plans a request
  (`plan`: the fields admission reads, the model's defaults and limits, the output bound,
  the conversation affinity keys on);
- the shapes it answers in: errors (`error_body`, `stream_error`), the model list of a
  request it claims (`claims`, `model_list`), the rate-limit headers' family;
- how a stream ends (`stream_end`), and the hosted tools a translated run leaves out.

Adding a protocol is a module that defines one (beside `chat`, `messages`, `responses`),
named in `protocol_registry`, and the Node's translator of the same name
(`iop_node.runs.protocol_run`).

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

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import msgspec

from iop_edge.core.routing.affinity import affinity_of, chat_conversation
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.errors import ApiError, bad_request, model_not_found
from iop_edge.http.protocols.compaction import Compaction
from iop_edge.http.rate_limit_headers import Headers, openai_rate_limit_headers
from iop_edge.runtime.metering.response_store import ResponseStore
from iop_edge.runtime.runs.dispatch import RunPlan
from iop_edge.runtime.runs.limits import RateLimits, output_bound
from schemas import openai as oai
from schemas import wire
from schemas.config import ModelEntry, PrincipalToken
from schemas.hosted_tools import HostedTools

__all__ = [
    "Caller",
    "CallerProtocol",
    "Planning",
    "ToStore",
    "apply_defaults",
    "catalog_model",
    "check_max_tokens",
]

_encode: Final = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class ToStore:
    """What a `store: true` run's response is stored with, once it is known."""

    principal_ref: str
    input_items: list[Any]
    """The request's own input items (not the conversation's)."""
    previous_id: str | None
    continues: tuple[str, ...]
    """The ids of the conversation it continues (renewed when it is stored)."""
    request_id: str = ""
    """The caller's request id, for the log line of a response not stored."""
    compaction: Compaction | None = None
    """The run is a summary turn (`http.protocols.compaction`): what its response becomes."""
    store: bool = True
    """Store the response (a compaction's turn may be unstored: `store: false`)."""


@dataclass(frozen=True, slots=True)
class Planning:
    """A request to plan: what every protocol's `plan` may read besides its operation."""

    path: str
    body: dict[str, Any]
    """The request body, decoded once; the plan may change it (defaults, `store`)."""
    snapshot: Snapshot
    caller: Caller
    store: ResponseStore
    """The stored responses (a protocol whose runs continue stored conversations)."""


class CallerProtocol(ABC):
    """One caller protocol at the Edge (see the module docstring). The defaults are
    OpenAI's: its error body and rate-limit headers, its model list, chat's
    conversation; a protocol in another vendor's shape overrides them."""

    name: ClassVar[str]
    """The protocol's name: its runs' `RunPlan.protocol` (what the pool ranks native
    providers by, the ledger's `protocol`), the traces' `iop.protocol`, and the name of
    the Node's translator of its runs (`run.operation` on the wire)."""
    paths: ClassVar[Mapping[str, wire.Operation]]
    """The run endpoints it serves: path -> the operation of their runs."""
    output_fields: ClassVar[Mapping[wire.Operation, tuple[str, ...]]] = {}
    """Per operation: the request fields that bound its output, the first one set wins
    (`runs.limits` Rule 2); an operation not listed generates nothing and reads no
    conversation to route by (embeddings, token counts)."""
    stream_end: ClassVar[bytes] = b""
    """What ends a stream after its last event."""

    @abstractmethod
    async def plan(
        self, operation: wire.Operation, request: Planning
    ) -> tuple[RunPlan, ToStore | None]:
        """The plan of a request to one of `paths`, and what to store of its result
        (None: nothing); raises `ApiError` naming what is wrong."""

    def conversation(self, body: Mapping[str, Any]) -> tuple[list[Any], Sequence[Any]]:
        """How a body lays its conversation out, for its affinity (`core.routing.affinity`)."""
        return chat_conversation(body)

    def error_body(self, error: ApiError, request_id: str | None = None) -> bytes:
        """`error` as this protocol's error body; `request_id`: the caller's request."""
        return error.body()

    def stream_error(
        self, error: ApiError, *, plan: RunPlan, sequence: int, request_id: str | None = None
    ) -> bytes:
        """`error` as the event that ends a stream of `plan`'s (`sequence`: the events it
        carried so far, counted from 0)."""
        return b"data: " + self.error_body(error, request_id) + b"\n\n"

    def rate_limit_headers(self, limits: RateLimits) -> Headers:
        """Where the caller's principal stands against its limits, as headers."""
        return openai_rate_limit_headers(limits)

    def claims(self, path: str, header_names: Collection[str]) -> bool:
        """Whether a request outside the run endpoints (`/v1/models`, an error page) is
        this protocol's client's, and gets its shapes (`header_names`: lowercase)."""
        return False

    def model_list(
        self, models: Mapping[str, ModelEntry], created_unix: int, query: Mapping[str, str]
    ) -> bytes:
        """`GET /v1/models`' body: the models the caller may use."""
        cards = [_model_card(entry, created_unix) for entry in models.values()]
        return _encode(oai.ModelList(data=cards))

    def model(self, entry: ModelEntry, created_unix: int) -> bytes:
        """`GET /v1/models/{id}`'s body."""
        return _encode(_model_card(entry, created_unix))

    def hosted_tools(self, body: dict[str, Any]) -> Sequence[str]:
        """The tools only a vendor's service runs that `body` offers
        (`schemas.hosted_tools`): what a translated run leaves out."""
        return ()


def _model_card(entry: ModelEntry, created_unix: int) -> oai.ModelCard:
    return oai.ModelCard(id=entry.id, display_name=entry.display_name, created=created_unix)


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
        protocol: CallerProtocol,
        caller_headers: dict[str, str] | None = None,
        keep_output: bool = False,
        hosted_tools: HostedTools = "drop",
        chained: bool = False,
        previous_response_id: str = "",
    ) -> RunPlan:
        """The plan of this caller's request: its ids and principal go with the run, it
        is a long run when its prompt estimate reaches the snapshot's threshold, and it
        carries its affinity (`core.routing.affinity`) unless its model routes by load alone
        or has one provider, where there is nothing to choose (`chained`: a Responses
        continuation, its conversation rebuilt in `body`); its output bound is the first
        of `protocol.output_fields` the body sets."""
        principal = self.principal
        model = snapshot.models[model_id]
        routing = model.routing
        fields = protocol.output_fields.get(operation)
        affinity = None
        # A run that reads a conversation, of a model with providers to choose between.
        if routing.affinity and fields is not None and len(model.providers) > 1:
            affinity = affinity_of(
                protocol.conversation,
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
            protocol=protocol.name,
            max_output=output_bound(fields, body),
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
