"""A scripted inference runtime on a real socket, for the agent CLI tests.

HTTP/1.1 (h11 on Trio, keep-alive, chunked streams) on 127.0.0.1 port 0, serving the
loop of `script.py` in the caller protocols it is told to speak:

- `chat`: `POST /v1/chat/completions` (what IOP's Node sends when it translates);
- `messages`: `POST /v1/messages` (any query, e.g. `?beta=true`) and
  `POST /v1/messages/count_tokens`;
- `responses`: `POST /v1/responses`;

each stream and non-stream, plus `GET /v1/models` (the Node's health check). An endpoint
of a protocol it does not speak is a 404, as on a runtime that lacks it, so a test of the
translated path fails if anything reaches the runtime natively.

    upstream = ScriptedUpstream(protocols=("chat",))
    base_url = await nursery.start(upstream.serve)     # "http://127.0.0.1:PORT/v1"

Every request is kept in `exchanges`, with the turn the script read from it and the reply
it chose, so a test can check what went round (the tool call's id coming back with its
result, the protocol each request arrived in).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import h11
import trio

from tests.agents.script import (
    Call,
    Protocol,
    Reply,
    Turn,
    decide,
    read_turn,
    render_body,
    render_events,
    usage_for,
)
from tests.h11_server import Send, listen_local, serve_connection

_INFERENCE: Final[dict[str, Protocol]] = {
    "/v1/chat/completions": "chat",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
_COUNT_TOKENS: Final = "/v1/messages/count_tokens"
_CALL_ID_PREFIX: Final[dict[Protocol, str]] = {
    "chat": "call_iop_",
    "messages": "toolu_iop_",
    "responses": "call_iop_",
}


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request as it arrived, and what the script made of it."""

    method: str
    path: str
    """Without the query string."""
    query: str
    headers: dict[str, str]
    body: bytes
    status: int
    turn: Turn | None = None
    reply: Reply | None = None

    @property
    def protocol(self) -> Protocol | None:
        return None if self.turn is None else self.turn.protocol


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    body: bytes
    events: list[bytes] | None = None
    """A stream's SSE events, in place of `body`."""
    turn: Turn | None = None
    reply: Reply | None = None


def _error(message: str) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None}}
    ).encode()


@dataclass
class ScriptedUpstream:
    protocols: Sequence[Protocol] = ("chat", "messages", "responses")
    models: Sequence[str] = ("scripted-model",)

    exchanges: list[Exchange] = field(init=False, default_factory=list)
    root_url: str = field(init=False, default="")
    _calls: int = field(init=False, default=0)

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"

    def inference(self) -> list[Exchange]:
        """The inference requests, in arrival order."""
        return [exchange for exchange in self.exchanges if exchange.turn is not None]

    def calls(self) -> list[tuple[Exchange, Call]]:
        """The requests answered with a tool call, and the call."""
        return [(ex, ex.reply) for ex in self.exchanges if isinstance(ex.reply, Call)]

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on 127.0.0.1:0; `task_status.started(base_url)` once accepting."""
        listeners, self.root_url = await listen_local()
        task_status.started(self.base_url)
        await trio.serve_listeners(self._connection, listeners)

    # --- HTTP ---------------------------------------------------------------------------

    async def _connection(self, stream: trio.SocketStream) -> None:
        await serve_connection(stream, self._answer)

    async def _answer(self, head: h11.Request, body: bytes, send: Send) -> None:
        path, _, query = head.target.decode().partition("?")
        headers = {name.decode(): value.decode() for name, value in head.headers}
        method = head.method.decode()
        encoding = headers.get("content-encoding", "identity")
        if encoding == "gzip":
            body = gzip.decompress(body)
        if encoding not in ("gzip", "identity"):
            answer = _Answer(415, _error(f"unsupported content-encoding {encoding!r}"))
        else:
            answer = self._route(method, path, body)
        self.exchanges.append(
            Exchange(method, path, query, headers, body, answer.status, answer.turn, answer.reply)
        )
        if answer.events is None:
            await self._send_json(send, answer.status, answer.body, head_only=method == "HEAD")
            return
        response_headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
        await send(h11.Response(status_code=200, headers=response_headers))
        for event in answer.events:
            await send(h11.Data(data=event))
        await send(h11.EndOfMessage())

    def _route(self, method: str, path: str, body: bytes) -> _Answer:
        if method in ("GET", "HEAD") and path in ("/", "/v1/models", "/models"):
            listing = [{"id": m, "object": "model", "owned_by": "scripted"} for m in self.models]
            return _Answer(200, json.dumps({"object": "list", "data": listing}).encode())
        protocol = _INFERENCE.get(path)
        counts_tokens = "messages" in self.protocols and path == _COUNT_TOKENS
        if method != "POST" or not (protocol in self.protocols or counts_tokens):
            return _Answer(404, _error(f"no route for {method} {path}"))
        try:
            request = json.loads(body)
        except ValueError as exc:
            return _Answer(400, _error(f"the body is not JSON: {exc}"))
        if not isinstance(request, dict):
            return _Answer(400, _error("the body is not a JSON object"))
        if protocol is None:  # count_tokens
            return _Answer(200, json.dumps({"input_tokens": max(1, len(body) // 4)}).encode())
        turn = read_turn(protocol, request)
        self._calls += 1
        reply = decide(turn, call_id=f"{_CALL_ID_PREFIX[protocol]}{self._calls}")
        usage = usage_for(len(body), reply)
        reply_id = f"scripted{self._calls}"
        if turn.stream:
            events = render_events(turn, reply, usage, reply_id)
            return _Answer(200, b"", events=events, turn=turn, reply=reply)
        return _Answer(200, render_body(turn, reply, usage, reply_id), turn=turn, reply=reply)

    @staticmethod
    async def _send_json(send: Send, status: int, body: bytes, *, head_only: bool = False) -> None:
        headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
        await send(h11.Response(status_code=status, headers=headers))
        if not head_only:
            await send(h11.Data(data=body))
        await send(h11.EndOfMessage())
