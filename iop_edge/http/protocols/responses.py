"""The OpenAI Responses surface's Edge side (design §14): the `RESPONSES` protocol object,
the plan of a `POST /v1/responses` (and `/v1/responses/compact`), the conversation it
continues, what is stored of it, and a stream's failure as `response.failed`.

The Edge reads the few fields admission needs (`core.responses.protocol_requests`) and relays the
body: the Node sends it natively to a provider that speaks Responses or translates it to
chat completions. Same catalog, aliases, limits and long-context admission as chat:

- `max_output_tokens` above the model's `generation.max_tokens_limit` is a 400.
- `generation.defaults` apply where the protocol has the same setting (`DEFAULT_KEYS`;
  chat's `max_tokens` is Responses' `max_output_tokens`).
- `previous_response_id`: the stored conversation is loaded (the principal's own only)
  and sent whole, without the id (`core.responses.response_chain`); the id goes beside the body
  (`run.previous_response_id`), for the response to echo. An unknown, expired or other
  principal's id is 404 `previous_response_not_found`. The estimate counts the whole
  conversation, which the model reads.
- `store` (true unless the caller says false): the run keeps its final response
  (`run.keep_output`) and the Edge stores it with the request's own input items before
  the caller's response completes (`ResponseStore.keep`). The runtime is always sent
  `store: false`: the Edge is the store. The caller still sees the `store` it asked for:
  the Node writes `store: true` into the response of a run that keeps its output
  (translated or relayed natively alike), and its id is IOP's own (`resp_<request id>`),
  never the upstream's, so an upstream that reuses ids cannot make two stored responses
  collide.
- A response that could not be stored (the store's bounds, its database failing) is
  still answered, never refused: storing is a side effect of a request already served.
  The reply says so (`core.responses.unstored_reply`): `store: false` in the body or the stream's
  final event, `x-iop-response-stored: false` on a non-stream reply (`true` when
  stored), the reason in `iop_responses_unstored_total` and a log line with the request
  id.
- A conversation longer than `edge.responses.max_conversation_bytes` is a 400
  `conversation_too_large`, refused before it is loaded whole.
- The conversation (stored turns and the request's own items) is sent as a runtime reads
  it: IOP's compactions as their summaries (`core.responses.compaction`), tool outputs no
  call asked for as user messages (`core.responses.uncalled_outputs`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final

import msgspec

from iop_edge.core.responses import uncalled_outputs
from iop_edge.core.responses.compaction import CompactionUnreadable, ends_with_trigger, expand
from iop_edge.core.responses.input_item_pages import PageRequestInvalid, item_page
from iop_edge.core.responses.protocol_requests import (
    ResponsesRequest,
    estimate_responses_tokens,
    input_items,
    openai_tool_choice_problem,
)
from iop_edge.core.responses.response_chain import (
    ChainBroken,
    ConversationTooLarge,
    StoredTurn,
    continue_body,
    conversation,
)
from iop_edge.core.routing.affinity import responses_conversation
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.errors import ApiError, bad_request, invalid_request, model_not_found
from iop_edge.http.protocols.caller_protocol import (
    Caller,
    CallerProtocol,
    Planning,
    ToStore,
    apply_defaults,
    catalog_model,
    check_max_tokens,
)
from iop_edge.http.protocols.compaction import COMPACT_PATH, Compaction, prepare
from iop_edge.runtime.metering.response_store import ResponseStore, StoreUnavailable, Unstored
from iop_edge.runtime.runs.dispatch import RunPlan
from schemas import wire
from schemas.hosted_tools import hosted_tool_types
from schemas.protocols import response_error
from schemas.responses_echo import echo_members
from schemas.responses_usage import ResponsesUsage

__all__ = [
    "DEFAULT_KEYS",
    "RESPONSES",
    "ResponsesProtocol",
    "ResponsesSurface",
    "conversation_too_large",
    "store_unavailable",
    "warm_up_events",
    "warm_up_response",
]

#: A model's `generation.defaults` key (chat's name) -> the Responses field it sets.
DEFAULT_KEYS: Final = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}


def store_unavailable(exc: StoreUnavailable) -> ApiError:
    return ApiError(
        503,
        f"Stored responses are unavailable now: {exc}",
        type="service_unavailable_error",
        code="store_unavailable",
        retry_after_s=1.0,
    )


def response_not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id}' not found.",
        type="not_found_error",
        code="response_not_found",
    )


class ResponsesSurface:
    """Plans Responses runs and stores their results (see the module docstring)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def plan(
        self,
        body: dict[str, Any],
        snapshot: Snapshot,
        caller: Caller,
        *,
        compact: bool = False,
        continued_items: int = 0,
    ) -> tuple[RunPlan, ToStore | None]:
        """The plan of a Responses request, and what to store of it (None: `store:
        false`); `compact`: a `/v1/responses/compact` request (`http.protocols.compaction`).
        `continued_items`: how many items at the front of `input` are not the caller's
        but the conversation it continues (a WebSocket's unstored last response), so an
        error names the caller's own item. Raises `ApiError`."""
        try:
            view = msgspec.convert(body, ResponsesRequest)
        except msgspec.ValidationError as exc:
            raise invalid_request(exc) from None
        model = catalog_model(snapshot, caller, view.model)
        apply_defaults(model, body, DEFAULT_KEYS)
        check_max_tokens(model, "max_output_tokens", body.get("max_output_tokens"))
        choice = body.get("tool_choice")
        if choice is not None:
            problem = openai_tool_choice_problem(choice, body.get("tools"), nested=False)
            if problem is not None:
                raise bad_request(problem, param="tool_choice")
        principal = caller.principal
        own_items = input_items(body.get("input", []))
        trigger = not compact and ends_with_trigger(own_items)
        earlier: list[msgspec.Raw] = []
        continues: tuple[str, ...] = ()
        previous_id = view.previous_response_id
        if previous_id is not None:
            chain = await self._continued(principal.principal_ref, previous_id)
            earlier = conversation(chain, ())
            continues = tuple(turn.id for turn in chain)
            continue_body(body, earlier + own_items)
        elif view.store:
            body["store"] = False
        conversation_items = input_items(body.get("input", []))
        try:
            expanded = uncalled_outputs.rewrite(expand(conversation_items))
        except CompactionUnreadable as exc:
            raise _unreadable_compaction(exc, stored=len(earlier) + continued_items) from None
        if expanded is not conversation_items:
            body["input"] = expanded
        compaction = None
        if compact or trigger:
            compaction = Compaction(
                endpoint=compact, conversation=expanded, stream=trigger and view.stream
            )
            prepare(body, expanded, model)
        plan = caller.plan(
            snapshot,
            model_id=view.model,
            operation="responses",
            body=body,
            stream=view.stream and compaction is None,
            prompt_tokens=estimate_responses_tokens(view, earlier),
            caller_wants_usage=True,  # usage is part of every Responses reply and stream
            protocol=RESPONSES,
            keep_output=view.store,
            hosted_tools=model.generation.hosted_tools,
            chained=previous_id is not None,
            previous_response_id=previous_id or "",
        )
        if compaction is not None:
            return plan, ToStore(
                principal_ref=principal.principal_ref,
                input_items=[] if compact else own_items[:-1],
                previous_id=None if compact else previous_id,
                continues=() if compact else continues,
                request_id=plan.request_id or plan.run_id,
                compaction=compaction,
                store=compact or view.store,
            )
        if not view.store:
            return plan, None
        return plan, ToStore(
            principal_ref=principal.principal_ref,
            input_items=own_items,
            previous_id=previous_id,
            continues=continues,
            request_id=plan.request_id or plan.run_id,
        )

    async def keep(self, to_store: ToStore, response: bytes | None) -> Unstored | None:
        """Store a finished run's final response (`run_done.response`); None when it is
        stored, else why not (the store logged and counted it)."""
        return await self.store.keep(
            to_store.principal_ref,
            response,
            to_store.input_items,
            previous_id=to_store.previous_id,
            continues=to_store.continues,
            request_id=to_store.request_id,
        )

    async def input_tokens(
        self, body: dict[str, Any], snapshot: Snapshot, principal_ref: str
    ) -> int:
        """`POST /v1/responses/input_tokens`: the input tokens of a Responses request, by
        the estimate admission uses (`estimate_responses_tokens`), the stored
        conversation it continues included (the principal's own only); raises `ApiError`.
        No runtime is asked: none behind IOP counts a Responses request but llama.cpp's
        server, and the Edge's estimate is what the request is admitted and queued by."""
        try:
            view = msgspec.convert(body, ResponsesRequest)
        except msgspec.ValidationError as exc:
            raise invalid_request(exc) from None
        if view.model not in snapshot.models or not snapshot.policies.allows(
            principal_ref, view.model
        ):
            raise model_not_found(view.model)
        earlier: list[msgspec.Raw] = []
        if view.previous_response_id is not None:
            chain = await self._continued(principal_ref, view.previous_response_id)
            earlier = conversation(chain, ())
        return estimate_responses_tokens(view, earlier)

    async def _continued(self, principal_ref: str, previous_id: str) -> list[StoredTurn]:
        """The stored conversation a request's `previous_response_id` continues (the
        principal's own only); raises `ApiError` naming that field."""
        try:
            return await self.store.conversation(principal_ref, previous_id)
        except ChainBroken as exc:
            raise ApiError(
                404, str(exc), code="previous_response_not_found", param="previous_response_id"
            ) from None
        except ConversationTooLarge as exc:
            raise conversation_too_large(exc) from None
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from None

    async def read(self, principal_ref: str, response_id: str) -> bytes:
        """`GET /v1/responses/{id}`: the stored response object; raises `ApiError`."""
        try:
            response = await self.store.read(principal_ref, response_id)
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from None
        if response is None:
            raise response_not_found(response_id)
        return response

    async def input_items(
        self, principal_ref: str, response_id: str, query: Mapping[str, str]
    ) -> bytes:
        """`GET /v1/responses/{id}/input_items`: a page of the items the stored response
        was generated from (`core.responses.input_item_pages`); raises `ApiError`."""
        try:
            chain = await self.store.conversation(principal_ref, response_id)
        except ChainBroken as exc:
            if exc.missing is None:
                raise response_not_found(response_id) from None
            raise ApiError(
                404,
                f"Response '{response_id}' continues response '{exc.missing}', which is no "
                "longer stored: the items it was generated from cannot all be listed.",
                code="previous_response_not_found",
            ) from None
        except ConversationTooLarge as exc:
            raise ApiError(400, str(exc), code="conversation_too_large") from None
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from None
        try:
            return item_page(chain, query)
        except PageRequestInvalid as exc:
            raise bad_request(str(exc), param=exc.param) from None

    async def delete(self, principal_ref: str, response_id: str) -> None:
        """`DELETE /v1/responses/{id}`; raises `ApiError`."""
        try:
            deleted = await self.store.delete(principal_ref, response_id)
        except StoreUnavailable as exc:
            raise store_unavailable(exc) from None
        if not deleted:
            raise response_not_found(response_id)


class ResponsesProtocol(CallerProtocol):
    """OpenAI Responses: OpenAI's shapes (the defaults), a stream failed as
    `response.failed`; its runs may continue a stored conversation and be stored."""

    name = "responses"
    paths: ClassVar[Mapping[str, wire.Operation]] = {
        "/v1/responses": "responses",
        COMPACT_PATH: "responses",
    }
    output_fields: ClassVar[Mapping[wire.Operation, tuple[str, ...]]] = {
        "responses": ("max_output_tokens",)
    }

    def conversation(self, body: Mapping[str, Any]) -> tuple[list[Any], Sequence[Any]]:
        return responses_conversation(body)

    async def plan(
        self, operation: wire.Operation, request: Planning
    ) -> tuple[RunPlan, ToStore | None]:
        compact = request.path == COMPACT_PATH
        surface = ResponsesSurface(request.store)
        return await surface.plan(request.body, request.snapshot, request.caller, compact=compact)

    def stream_error(
        self, error: ApiError, *, plan: RunPlan, sequence: int, request_id: str | None = None
    ) -> bytes:
        """A `response.failed` event: `sequence` is its `sequence_number`, and the failed
        response goes by IOP's id for the request (the Edge does not read the Node's
        events, so it cannot know theirs); it echoes the request as the Node's do, with
        `store: false`: a failed response is not stored."""
        kind, text = response_error(error.code, error.message)
        own = _FailedResponse(
            id=f"resp_{plan.run_id}",
            created_at=int(time.time()),
            model=plan.model_id,
            error=_ResponseError(code=kind, message=text),
        )
        echo = echo_members(
            _encode(plan.body), previous_response_id=plan.previous_response_id or None
        )
        failed = _ResponseFailed(
            sequence_number=sequence, response=msgspec.Raw(_encode(own)[:-1] + echo)
        )
        return b"event: response.failed\ndata: " + _encode(failed) + b"\n\n"

    def hosted_tools(self, body: dict[str, Any]) -> Sequence[str]:
        return hosted_tool_types(self.name, body)


RESPONSES: Final = ResponsesProtocol()


def warm_up_response(plan: RunPlan, *, stored: bool) -> bytes:
    """The Response of a turn that generates nothing (the WebSocket mode's `generate:
    false`, a warm-up): completed at once, no output, no tokens, echoing the request as a
    run's Response does, under IOP's id for the request."""
    now = int(time.time())
    own = _WarmedUp(id=f"resp_{plan.run_id}", created_at=now, completed_at=now, model=plan.model_id)
    echo = echo_members(
        _encode(plan.body), stored=stored, previous_response_id=plan.previous_response_id or None
    )
    return _encode(own)[:-1] + echo


def warm_up_events(response: bytes) -> bytes:
    """A warm-up's Response as the server-sent events of a stream: created, completed."""
    final: dict[str, Any] = msgspec.json.decode(response)
    started = {**final, "status": "in_progress", "completed_at": None, "usage": None}
    events = (("response.created", started), ("response.completed", final))
    return b"".join(
        b"event: %s\ndata: %s\n\n"
        % (kind.encode(), _encode({"type": kind, "sequence_number": number, "response": body}))
        for number, (kind, body) in enumerate(events)
    )


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


class _WarmedUp(msgspec.Struct, frozen=True, kw_only=True):
    """A warm-up's Response's own members; the echo of its request follows them."""

    id: str
    object: str = "response"
    created_at: int
    completed_at: int
    status: str = "completed"
    background: bool = False
    error: None = None
    incomplete_details: None = None
    model: str
    output: list[Any] = []
    usage: ResponsesUsage = ResponsesUsage()


class _ResponseError(msgspec.Struct, frozen=True, kw_only=True):
    code: str
    message: str


class _ResponseFailed(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "response.failed"
    sequence_number: int
    response: msgspec.Raw


_encode: Final = msgspec.json.Encoder().encode


def conversation_too_large(error: ConversationTooLarge) -> ApiError:
    """The 400 for a `previous_response_id` that continues more than the Edge carries
    (the store's chain, or a WebSocket connection's own conversation)."""
    return ApiError(400, str(error), code="conversation_too_large", param="previous_response_id")


def _unreadable_compaction(error: CompactionUnreadable, *, stored: int) -> ApiError:
    """The 400 for a damaged compaction item, naming it where the caller sent it: the
    conversation expanded is the `stored` items of the conversation it continues, then
    the request's own `input`."""
    index = error.index or 0
    if index < stored:  # a stored item: it read back when it was stored
        where = f"the conversation of previous_response_id (its item {index})"
        param = "previous_response_id"
    else:
        where = param = f"input[{index - stored}].encrypted_content"
    return ApiError(
        400,
        f"{where} is not a compaction IOP can read: {error}",
        code="invalid_compaction",
        param=param,
    )
