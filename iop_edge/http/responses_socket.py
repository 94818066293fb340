"""The OpenAI Responses API over WebSocket (design §14): `GET /v1/responses` upgraded on the
caller port, one connection carrying a conversation's turns in sequence.

The seam: Hypercorn already speaks WebSocket (wsproto under its own connection handler,
`connection.Connection`), and hands the Edge's ASGI app a `websocket` scope once a
client asks to upgrade. So no second server or socket library is needed: `server` passes
an upgrade on `/v1/responses` of the caller port to `OpenAIApp`, which gives it to
`ResponsesSocket`, and each turn runs through the HTTP path's own planning
(`ResponsesSurface.plan`) and dispatch (`RunEndpoints.run_planned`): the same admission,
limits, fair queueing, metering and response store. Only the writing differs: a
`SocketReply` turns the run's server-sent events into one WebSocket text message each,
and an error into an `error` event.

Rules:

1. The upgrade is authenticated as an HTTP request is (`Authorization: Bearer` or
   `x-api-key`); a caller without a known token is refused with the HTTP status and
   OpenAI's error body (401), before the connection is accepted.
2. Each client message is one JSON event, decoded as an HTTP body is (`request_body.decode_body`:
   an object, nesting at most `MAX_JSON_DEPTH` levels). `response.create` carries the
   body of a `POST /v1/responses` (its `type` aside): it is always streamed (`stream` is
   ignored), `background` is refused. Every other event type is an `error` event
   (`unsupported_event`); the connection stays open. A turn refused before it is
   planned is metered and access-logged as an HTTP refusal is; turns are not traced
   (`metering.tracing` spans are per HTTP request).
3. One turn at a time: a `response.create` while a turn runs is answered with an `error`
   event (`conversation_already_has_active_response`), and the running turn goes on.
4. Server events are those of the HTTP stream, in order, one per message; a turn refused
   (bad body, unknown model, a limit, admission) is one `error` event
   `{"type": "error", "status": <HTTP status>, "error": {...OpenAI's error object}}`.
5. `previous_response_id` continues a stored response as over HTTP, and also the
   connection's most recent response when it was not stored (`store: false`, or a store
   that could not take it): the connection keeps that one conversation (its input and
   output items; for a compaction turn, the conversation it summed up and its compaction
   item) in memory until the next response replaces it or the connection closes. A
   turn answered with an `error` event alone (refused, or failed before its stream
   began, on the Edge or on a Node) made no response, so the conversation stays and
   the turn may be sent again.
   It is bounded as a stored one is: a continuation of a conversation larger than
   `edge.responses.max_conversation_bytes` is refused (`conversation_too_large`).
8. `generate: false` is a warm-up: the turn is planned and checked as any other (its
   model, its body, the response it continues) but nothing runs. It is answered at once
   with `response.created` and `response.completed`, a Response with no output and no
   tokens that the next turn continues by its id (Rule 5; stored when `store` asks); no
   slot, no metering, no access line. A warm-up that ends in a `compaction_trigger` is
   refused: a summary is generated.
6. Every turn of a connection has the same affinity key (`core.routing.affinity` Rule 1 a): the
   session header of the upgrade when it sent one, else the connection's own id, so a
   model that routes by affinity keeps a connection's turns on one provider.
7. Limits: a message larger than `openai.max_request_bytes` closes the connection with
   1009 (after an `error` event; one more than `server.WEBSOCKET_MARGIN_BYTES` past it
   is not read to its end, and gets the 1009 alone); a connection lives at most
   `MAX_CONNECTION_S` (60 minutes), after which it gets an `error` event
   (`websocket_connection_limit_reached`) and is closed (1000); a turn still running then
   is cut (metered as the caller leaving). The caller closing the connection cancels the
   turn that runs.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping
from typing import Any, Final

import msgspec
import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, WebsocketScope

from iop_edge.core.responses.protocol_requests import input_items
from iop_edge.core.responses.response_chain import ConversationTooLarge
from iop_edge.core.routing.affinity import SESSION_HEADERS
from iop_edge.http.auth import authenticate_headers
from iop_edge.http.errors import ApiError, echoed, metering_unavailable
from iop_edge.http.protocols.caller_protocol import Caller, ToStore
from iop_edge.http.protocols.responses import (
    RESPONSES,
    conversation_too_large,
    warm_up_events,
    warm_up_response,
)
from iop_edge.http.request_body import decode_body
from iop_edge.http.request_ids import new_run_id, request_id
from iop_edge.http.runs import Reply, RunEndpoints, Timing
from iop_edge.runtime.runs.dispatch import RunPlan
from schemas.config import PrincipalToken

__all__ = ["MAX_CONNECTION_S", "ResponsesSocket", "SocketReply"]

log = logging.getLogger(__name__)

#: How long one WebSocket connection lives (the Responses WebSocket mode's limit).
MAX_CONNECTION_S: Final = 3600.0
#: Close codes (RFC 6455 §7.4.1).
CLOSE_NORMAL: Final = 1000
CLOSE_TOO_BIG: Final = 1009
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_TERMINAL: Final = frozenset({"response.completed", "response.incomplete", "response.failed"})
#: A final event's `type` as JSON holds it (a text that quotes it is escaped): an event
#: without one is sent unread.
_TERMINAL_MARKS: Final = tuple(f'"{kind}"'.encode() for kind in sorted(_TERMINAL))


class _Event(msgspec.Struct):
    """The members of a server event this module reads."""

    type: str = ""
    response: msgspec.Raw = msgspec.Raw(b"")


class _Sender:
    """Sends text messages on the socket, one at a time (a turn's events and the reader's
    error events may overlap)."""

    def __init__(self, send: ASGISendCallable) -> None:
        self._send = send
        self._lock = trio.Lock()

    async def text(self, data: bytes) -> None:
        async with self._lock:
            await self._send({"type": "websocket.send", "bytes": None, "text": data.decode()})

    async def error(self, error: ApiError, request_id: str | None = None) -> None:
        await self.text(error_event(error, request_id))

    async def close(self, code: int) -> None:
        async with self._lock:
            await self._send({"type": "websocket.close", "code": code, "reason": None})


def error_event(error: ApiError, request_id: str | None = None) -> bytes:
    """An `error` event (Rule 4): the HTTP status, and the error object of OpenAI's body."""
    body = _decode(error.body())
    return _encode({"type": "error", "status": error.status, "error": body.get("error", body)})


class SocketReply(Reply):
    """A turn's reply as WebSocket messages: one per server-sent event (Rule 4)."""

    __slots__ = ("_sender", "final_response")

    def __init__(self, sender: _Sender, request_id: str) -> None:
        super().__init__(_unused_send, request_id, RESPONSES)
        self._sender = sender
        self.final_response: bytes | None = None
        """The response object of the turn's terminal event, as the caller got it."""

    async def error(self, error: ApiError, timing: Timing) -> None:
        self.error_code = error.code
        self.status = error.status
        self.started = True
        self.complete = True
        await self._sender.error(error, self.request_id)

    async def json(
        self,
        body: bytes,
        timing: Timing,
        status: int = 200,
        extra: Any = (),
    ) -> None:
        """A reply that is not a stream (a turn always streams: never expected), as one
        message."""
        self.started = True
        self.status = status
        self.complete = True
        await self._sender.text(body)

    async def start_stream(self, timing: Timing) -> None:
        self.started = True
        self.status = 200

    async def stream(self, data: bytes) -> None:
        for event in _sse_data(data):
            await self._send_event(event)

    async def finish(self, data: bytes) -> None:
        self.complete = True
        await self.stream(data)

    def chunk_writer(self) -> None:
        return None

    async def _send_event(self, event: bytes) -> None:
        if any(mark in event for mark in _TERMINAL_MARKS):  # only a final event is read
            try:
                kind = msgspec.json.decode(event, type=_Event)
            except (msgspec.DecodeError, RecursionError):  # a ValidationError too
                kind = _Event()
            if kind.type in _TERMINAL and kind.response:
                self.final_response = bytes(kind.response)
        await self._sender.text(event)


async def _unused_send(message: Any) -> None:  # pragma: no cover - SocketReply overrides all
    raise AssertionError("SocketReply writes through its own sender")


def _sse_data(data: bytes) -> list[bytes]:
    """The `data` payloads of whole server-sent events (`runs` checked their framing)."""
    events = []
    for block in data.split(b"\n\n"):
        lines = [line[6:] for line in block.split(b"\n") if line.startswith(b"data: ")]
        if lines:
            events.append(b"\n".join(lines))
    return events


class _Conversation(msgspec.Struct):
    """The connection's most recent unstored response (Rule 5)."""

    response_id: str
    items: list[Any]
    size: int
    """The conversation's bytes as JSON: bounded as a stored one is (Rule 5)."""


class ResponsesSocket:
    """Serves the Responses WebSocket mode (see the module docstring)."""

    def __init__(self, runs: RunEndpoints) -> None:
        self._runs = runs

    async def __call__(
        self, scope: WebsocketScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
        }
        snapshot = self._runs.snapshot()
        try:  # Rule 1
            principal = authenticate_headers(
                snapshot.principals, headers, listen=snapshot.config.openai.listen
            )
        except ApiError as refused:
            await _deny(send, refused)
            return
        connection_id = f"ws_{secrets.token_hex(12)}"
        await send({"type": "websocket.accept", "subprotocol": None, "headers": []})
        session = _Session(
            self._runs, _Sender(send), principal, _sessions(headers, connection_id), connection_id
        )
        try:
            await self._serve(session, receive, snapshot.config.openai.max_request_bytes)
        finally:
            log.info(
                "Responses WebSocket %s of %s closed after %d turns",
                connection_id,
                principal.principal_ref,
                session.turns,
            )

    async def _serve(self, session: _Session, receive: ASGIReceiveCallable, limit: int) -> None:
        """Read client events until the caller leaves or the connection's time is up."""
        with trio.move_on_after(MAX_CONNECTION_S) as lifetime:
            async with trio.open_nursery() as turns:
                while True:
                    message = await receive()
                    if message["type"] == "websocket.disconnect":
                        turns.cancel_scope.cancel()  # the caller left: its turn with it
                        return
                    if message["type"] != "websocket.receive":
                        continue
                    raw = message.get("bytes") or (message.get("text") or "").encode()
                    if len(raw) > limit:
                        await session.sender.error(
                            ApiError(
                                413,
                                f"The message of {len(raw)} bytes exceeds the limit of "
                                f"{limit} bytes",
                                code="request_too_large",
                            )
                        )
                        await session.sender.close(CLOSE_TOO_BIG)
                        turns.cancel_scope.cancel()
                        return
                    await session.receive(raw, turns)
        if lifetime.cancelled_caught:  # Rule 7
            with trio.move_on_after(5) as cleanup:
                cleanup.shield = True
                await session.sender.error(
                    ApiError(
                        400,
                        f"The WebSocket connection reached its limit of "
                        f"{MAX_CONNECTION_S / 60:g} minutes: open a new one",
                        code="websocket_connection_limit_reached",
                    )
                )
                await session.sender.close(CLOSE_NORMAL)


class _Session:
    """One connection's state: its principal, affinity and last unstored response."""

    def __init__(
        self,
        runs: RunEndpoints,
        sender: _Sender,
        principal: PrincipalToken,
        sessions: dict[str, str],
        connection_id: str,
    ) -> None:
        self._runs = runs
        self.connection_id = connection_id
        self.sender = sender
        self._principal = principal
        self._sessions = sessions
        self._busy = False
        self._last: _Conversation | None = None
        self.turns = 0
        """The `response.create` events that became a turn (planned or refused)."""

    async def receive(self, raw: bytes, turns: trio.Nursery) -> None:
        """One client event (Rules 2 and 3)."""
        try:
            event = decode_body(raw, "event")
        except ApiError as exc:
            await self.sender.error(exc)
            return
        if event.get("type") != "response.create":
            kind = event.get("type")
            await self.sender.error(
                ApiError(
                    400,
                    f"Unsupported event type {echoed(str(kind))!r}: this connection takes "
                    "response.create",
                    code="unsupported_event",
                    param="type",
                )
            )
            return
        if self._busy:
            await self.sender.error(
                ApiError(
                    400,
                    "A response is already in progress on this connection: send the next "
                    "response.create once it has completed",
                    code="conversation_already_has_active_response",
                )
            )
            return
        self._busy = True
        self.turns += 1
        log.debug("Responses WebSocket %s: turn %d", self.connection_id, self.turns)
        turns.start_soon(self._turn, event)

    async def _turn(self, body: dict[str, Any]) -> None:
        """One turn; a bug of ours in it is its `error` event (as a 500 is over HTTP), and
        the connection, with the conversation it holds, serves the next turn."""
        try:
            await self._run_turn(body)
        except Exception:
            log.exception("Responses WebSocket %s: unexpected error in a turn", self.connection_id)
            await self.sender.error(
                ApiError(
                    500, "Internal error in the IOP Edge", type="api_error", code="internal_error"
                )
            )
        finally:
            self._busy = False

    async def _run_turn(self, body: dict[str, Any]) -> None:
        started = time.perf_counter()
        runs = self._runs
        run_id = new_run_id()
        rid = request_id(None, run_id)
        body.pop("type", None)
        background = body.pop("background", None)
        generate = body.pop("generate", True)
        body["stream"] = True
        snapshot = runs.snapshot()
        caller = Caller(
            run_id=run_id,
            request_id=rid,
            principal=self._principal,
            anthropic_headers={},
            session_headers=self._sessions,
        )
        try:
            limit = snapshot.config.edge.responses.max_conversation_bytes
            local_previous, continued_items = self._continue_locally(body, limit)
            if background:
                raise ApiError(
                    400,
                    "background is not supported over WebSocket",
                    code="unsupported_parameter",
                    param="background",
                )
            if not isinstance(generate, bool):
                raise ApiError(
                    400,
                    f"generate must be a boolean, not {type(generate).__name__}",
                    code="invalid_type",
                    param="generate",
                )
            unmetered = runs.metering.refusal()
            if unmetered is not None:
                raise metering_unavailable(unmetered)
            plan, to_store = await runs.responses.plan(
                body, snapshot, caller, continued_items=continued_items
            )
            summing_up = to_store is not None and to_store.compaction is not None
            if not generate and summing_up:
                raise ApiError(
                    400,
                    "A compaction_trigger generates a summary: send it with generate true",
                    code="unsupported_parameter",
                    param="generate",
                )
        except ApiError as exc:
            runs.refused(exc, rid, "/v1/responses", started)
            await self.sender.error(exc, rid)
            return
        if local_previous is not None:
            plan.previous_response_id = local_previous  # echoed as over HTTP
        if to_store is not None and to_store.compaction is not None:
            # The summary turn's body is the summary request, not the conversation.
            items: list[Any] = to_store.compaction.conversation
        else:
            items = input_items(plan.body.get("input", []))
        conversation = [  # a stored conversation's items come as the store keeps them
            msgspec.json.decode(item) if isinstance(item, msgspec.Raw) else item for item in items
        ]
        reply = SocketReply(self.sender, rid)
        if generate:
            await runs.run_planned(plan, reply, to_store)
        else:
            await self._warm_up(plan, to_store, reply)
        self._remember(conversation, reply.final_response)

    async def _warm_up(self, plan: RunPlan, to_store: ToStore | None, reply: SocketReply) -> None:
        """Rule 8: answer a warm-up, its Response stored when `store` asks and the store
        takes it."""
        stored = False
        if to_store is not None:
            response = warm_up_response(plan, stored=True)
            stored = await self._runs.responses.keep(to_store, response) is None
        await reply.stream(warm_up_events(warm_up_response(plan, stored=stored)))
        log.debug("Responses WebSocket %s: a warm-up, %s", self.connection_id, plan.run_id)

    def _continue_locally(self, body: dict[str, Any], limit: int) -> tuple[str | None, int]:
        """Rule 5: a continuation of the connection's last unstored response gets that
        conversation in its input; the id it continues (or None) and how many items were
        put before the caller's own. Raises `ApiError` for a conversation past `limit`
        bytes, as a stored one is refused."""
        previous = body.get("previous_response_id")
        last = self._last
        if last is None or not isinstance(previous, str) or previous != last.response_id:
            return None, 0
        if last.size > limit:
            raise conversation_too_large(ConversationTooLarge(previous, limit))
        body.pop("previous_response_id")
        body["input"] = [*last.items, *input_items(body.get("input", []))]
        return previous, len(last.items)

    def _remember(self, conversation: list[Any], response: bytes | None) -> None:
        """Keep an unstored response's conversation for the next turn (Rule 5): the final
        event's Response says whether it was stored (`store`), as the caller read it. A
        turn that made no response (`None`: an `error` event alone) changes nothing."""
        if response is None:
            return
        self._last = None
        try:
            final = _decode(response)
        except (msgspec.DecodeError, RecursionError):
            return
        if not isinstance(final, dict) or not isinstance(final.get("id"), str):
            return
        if final.get("store") is True:
            return
        output = final.get("output")
        items = [*conversation, *(output if isinstance(output, list) else [])]
        size = len(msgspec.json.encode(items))
        self._last = _Conversation(response_id=final["id"], items=items, size=size)


def _sessions(headers: Mapping[str, str], connection_id: str) -> dict[str, str]:
    """The upgrade's session headers, or the connection's id as `session_id` when it sent
    none (Rule 6): a turn then ranks them, and `prompt_cache_key`, as a request over HTTP
    does (`affinity.session_header`)."""
    sessions = {name: headers[name] for name in SESSION_HEADERS if name in headers}
    return sessions or {"session_id": connection_id}


async def _deny(send: ASGISendCallable, error: ApiError) -> None:
    """Refuse the upgrade with `error`'s HTTP status and OpenAI's error body (Rule 1)."""
    body = error.body()
    await send(
        {
            "type": "websocket.http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
            ],
        }
    )
    await send({"type": "websocket.http.response.body", "body": body, "more_body": False})
