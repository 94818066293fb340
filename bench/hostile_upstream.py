"""A scripted OpenAI-compatible runtime that misbehaves the ways real ones did, for the
soak's upstream phases (`bench.soak_upstreams`). In process, on 127.0.0.1.

It speaks chat completions only (a provider in front of it says `protocols: [chat]`, so
the Node translates Messages and Responses runs), one request per connection
(`Connection: close`; a stream's body ends when the connection does). What it answers
depends on the request:

- tools offered with `tool_choice: "auto"`: a 200 event stream with no event at all
  (llama-cpp-python's function calling answers that shape so);
- a tool named `MALFORMED_TOOL` offered: a streamed tool call whose arguments never
  close (not JSON);
- a last message containing `FAIL_MARK`: a 500 whose error message names the runtime's
  own address (what a caller must never see relayed);
- anything else: a short answer, streamed or not, with usage.

`POST /v1/responses` (non-stream) is answered natively, always with one id,
`REUSED_ID` (a runtime whose ids are not unique), and the text `turn N`, N being the
user turns in the input it was sent: a stored response that another overwrote says so.

`GET /v1/models` and `GET /health` answer as a runtime that is up does. `stop()` closes
the listener and every connection, as a crashed runtime; `start()` listens again on the
same port, as the runtime back after a restart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

import trio

__all__ = ["FAIL_MARK", "MALFORMED_TOOL", "REUSED_ID", "SERVED", "HostileUpstream", "turn_text"]

SERVED: Final = "hostile-model"
MALFORMED_TOOL: Final = "read_file_malformed"
FAIL_MARK: Final = "fail-upstream"
REUSED_ID: Final = "resp_reused"
_HEAD_END: Final = b"\r\n\r\n"
_MAX_REQUEST_BYTES: Final = 1 << 20


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-hostile",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": SERVED,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


_USAGE: Final = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def _events(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + (
        b"data: [DONE]\n\n"
    )


def _answer(payload: dict[str, Any], root: str) -> tuple[int, str, bytes]:
    """(status, content type, body) for one chat completion request (module docstring)."""
    stream = bool(payload.get("stream"))
    tools = payload.get("tools") or []
    names = {tool.get("function", {}).get("name") for tool in tools if isinstance(tool, dict)}
    messages = payload.get("messages") or [{}]
    last = str(messages[-1].get("content", "")) if isinstance(messages[-1], dict) else ""
    if tools and payload.get("tool_choice") == "auto" and MALFORMED_TOOL not in names:
        return 200, "text/event-stream", b""
    if MALFORMED_TOOL in names:
        call = {"index": 0, "id": "call_1", "function": {"name": MALFORMED_TOOL, "arguments": ""}}
        pieces = ['{"path": ', '"a.txt"']  # never closed
        chunks = [_chunk({"role": "assistant", "tool_calls": [call]})]
        chunks += [
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            for piece in pieces
        ]
        return 200, "text/event-stream", _events([*chunks, _chunk({}, "tool_calls")])
    if FAIL_MARK in last:
        error = {"message": f"the backend at {root} ran out of memory", "type": "server_error"}
        return 500, "application/json", json.dumps({"error": error}).encode()
    if stream:
        chunks = [
            _chunk({"role": "assistant", "content": "ok"}),
            _chunk({"content": " then"}, "stop"),
            {**_chunk({}), "choices": [], "usage": _USAGE},
        ]
        return 200, "text/event-stream", _events(chunks)
    message = {"role": "assistant", "content": "ok then"}
    body = {
        "id": "chatcmpl-hostile",
        "object": "chat.completion",
        "created": 0,
        "model": SERVED,
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": _USAGE,
    }
    return 200, "application/json", json.dumps(body).encode()


def turn_text(turn: int) -> str:
    """What the native Responses answer says to a conversation of `turn` user turns."""
    return f"turn {turn}"


def _responses_answer(payload: dict[str, Any]) -> bytes:
    """The native Responses answer (module docstring): always `REUSED_ID`."""
    given = payload.get("input", [])
    items = [given] if isinstance(given, str) else given
    turns = sum(1 for item in items if isinstance(item, str) or item.get("role") == "user")
    content = [{"type": "output_text", "text": turn_text(turns), "annotations": []}]
    message = {"type": "message", "id": "msg_reused", "status": "completed",
               "role": "assistant", "content": content}  # fmt: skip
    usage = {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}
    answer = {"id": REUSED_ID, "object": "response", "created_at": 0, "status": "completed",
              "model": SERVED, "output": [message], "usage": usage,
              "store": payload.get("store", True)}  # fmt: skip
    return json.dumps(answer).encode()


@dataclass
class HostileUpstream:
    """The runtime (module docstring), owned by the nursery given to `start`."""

    nursery: trio.Nursery
    port: int = 0
    answered: int = 0
    _scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    _stopped: trio.Event = field(default_factory=trio.Event)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> str:
        """Listen (on the same port again after a `stop`); the `/v1` base URL."""
        self._scope, self._stopped = trio.CancelScope(), trio.Event()
        await self.nursery.start(self._serve)
        return f"{self.root}/v1"

    async def stop(self) -> None:
        """Close the listener and every open connection, as a crashed runtime does."""
        self._scope.cancel()
        await self._stopped.wait()

    async def _serve(self, *, task_status: trio.TaskStatus[None]) -> None:
        try:
            with self._scope:
                listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
                self.port = listeners[0].socket.getsockname()[1]
                task_status.started()
                await trio.serve_listeners(self._connection, listeners)
        finally:
            self._stopped.set()

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                request = await _read_request(stream)
            except (trio.BrokenResourceError, ValueError):
                return
            if request is None:
                return
            method, path, body = request
            if method == "GET" and path.split("?")[0] in ("/v1/models", "/health"):
                listing = {"object": "list", "data": [{"id": SERVED, "object": "model"}]}
                status, kind, payload = 200, "application/json", json.dumps(listing).encode()
            elif method == "POST" and path == "/v1/chat/completions":
                status, kind, payload = _answer(json.loads(body), self.root)
            elif method == "POST" and path == "/v1/responses":
                status, kind, payload = 200, "application/json", _responses_answer(json.loads(body))
            else:
                status, kind, payload = 404, "application/json", b'{"error": "not found"}'
            head = f"HTTP/1.1 {status} X\r\ncontent-type: {kind}\r\nconnection: close\r\n"
            if kind == "application/json":
                head += f"content-length: {len(payload)}\r\n"
            try:
                await stream.send_all(head.encode() + b"\r\n" + payload)
            except trio.BrokenResourceError:
                return
            self.answered += 1


async def _read_request(stream: trio.SocketStream) -> tuple[str, str, bytes] | None:
    """(method, path, body) of the one request on the connection; None if it closed."""
    data = b""
    while _HEAD_END not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        data += chunk
        if len(data) > _MAX_REQUEST_BYTES:
            raise ValueError("request too large")
    head, _, body = data.partition(_HEAD_END)
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    if length > _MAX_REQUEST_BYTES:
        raise ValueError("request too large")
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        body += chunk
    return method, path, body
