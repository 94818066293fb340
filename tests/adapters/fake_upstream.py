"""A fake OpenAI-compatible upstream (plus Ollama's native health API) on a real socket.

It is a raw HTTP/1.1 server (h11 on Trio, keep-alive, chunked streaming) bound to
127.0.0.1 on a free port, so adapters are tested exactly as they run: real connects, real
connection reuse, real disconnects. The benchmark reuses it as its upstream.

    upstream = FakeUpstream(chunks=5)
    base_url = await nursery.start(upstream.serve)     # "http://127.0.0.1:PORT/v1"

Knobs are plain attributes, read per request, so a test may change them between requests:
`chunks`, `first_byte_delay_s`, `chunk_interval_s`, `hang`, `status`, `drop_after_chunks`,
`error_code`, `error_param`, `before_end`, `cache` (cached prompt tokens in chat usage,
or in llama.cpp's `timings`: `CacheReport`), `runs_per_connection`,
`error_after_chunks` (an in-band `data: {"error": ...}` event, then `[DONE]`, as vLLM
does when generation fails mid-stream), `models`, `models_status`, and `pace` (an async
hook awaited before each stream event, so a test can hold the stream until it has seen
the previous event). Observations: `requests` (the last few, with headers and exact body
bytes), `requests_total`, `connections_total`, `dropped`, `active`, `disconnects`, and
`wait_for(predicate)` to block until they reach a state (no sleeping in tests).

Behaviours of real runtimes, each off by default (llama.cpp's Python server shows all
four; `FakeUpstream(**LLAMA_CPP)` switches on the first three):

- `models_blocked_while_generating`: the model list (`GET /v1/models`, `/api/tags`) is
  not answered while an inference request is active; it waits until none is.
- `invalid_status`: a request the engine cannot take (`is_invalid`: a `json_schema`
  response format, a message whose `content` is null) is answered with this status
  (llama.cpp: 500) and a long, multi-line validation report whose reason comes last
  (`invalid_report`).
- `ignore_stream_options`: no usage chunk, whatever `stream_options` asks.
- `warmup`: an async hook the first inference request after start awaits before its
  first byte (a model loading on first use); a test holds it with an event.
- `interrupt_streams`: a stream stops at once (`[DONE]`, no finish reason) when any other
  request arrives while it generates, a model listing included (llama-cpp-python's
  `interrupt_requests`, on by default). Not in `LLAMA_CPP`: a test switches it on once
  its stream runs, so only requests that arrive from then on count.

Caller protocols (design §14; the bytes are in `fake_protocols`): `native` names the
ones served natively (`POST /v1/messages`, `/v1/responses`, stream and not, with usage;
`/v1/messages/count_tokens` unless `count_tokens_route` is off); a protocol not named
answers `native_missing_status` (404, or 405) as a chat-only server does;
`drop_after_chunks` and `error_after_chunks` (the protocol's own in-band error event)
apply to their streams too. `tokenizer`
names a tokenizer endpoint's dialect (llama.cpp's, vLLM's, llama-cpp-python's).

`tls`: a server context to serve HTTPS with (its URLs then start `https://`).

Endpoints: POST /v1/chat/completions, /v1/completions, /v1/embeddings; GET /v1/models;
Ollama's GET /api/tags and /api/version. Responses are serialized with `json.dumps`
defaults (spaces after separators, ASCII escapes) and carry provider-specific extras, so
a relay that re-encodes JSON instead of passing bytes through is caught byte for byte.
`expected_events()` and `expected_response()` give the exact bytes the server sends.
"""

from __future__ import annotations

import json
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import h11
import trio

from . import fake_protocols
from .fake_data import EMBEDDING, EXTRA, PROMPT_TOKENS

_MAX_RECORDED = 256


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class _ClientGone(Exception):
    """The client closed its side while we were answering."""


class _Drop(Exception):
    """Cut the connection on purpose (the `drop_after_chunks` knob)."""


# --- the bytes the server sends (pure, shared with tests) -------------------------------------


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


@dataclass(frozen=True, slots=True)
class CacheReport:
    """How a chat answer reports the prompt tokens the runtime took from its cache:
    `details` as OpenAI, vLLM and llama-server do (`usage.prompt_tokens_details
    .cached_tokens`), `timings` as llama.cpp's top-level `timings` alone (`cache_n`,
    `prompt_n`: the prompt tokens it actually processed), in the response and in a
    stream's last event."""

    tokens: int
    where: Literal["details", "timings"] = "details"

    def timings(self) -> dict[str, Any]:
        return {"cache_n": self.tokens, "prompt_n": PROMPT_TOKENS - self.tokens}


def _usage(completion_tokens: int, cache: CacheReport | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": completion_tokens,
        "total_tokens": PROMPT_TOKENS + completion_tokens,
    }
    if cache is not None and cache.where == "details":
        usage["prompt_tokens_details"] = {"cached_tokens": cache.tokens}
    return usage


def _chat_chunk(model: str, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "system_fingerprint": "fp_fake",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        **EXTRA,
    }


def _completion_chunk(model: str, text: str, finish: str | None) -> dict[str, Any]:
    return {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        **EXTRA,
    }


def expected_events(
    model: str,
    chunks: int,
    *,
    operation: str = "chat",
    include_usage: bool = False,
    cache: CacheReport | None = None,
) -> list[bytes]:
    """The `data:` payloads of one stream, in order, without the final `[DONE]`."""
    events: list[dict[str, Any]] = []
    for i in range(chunks):
        if operation == "completion":
            events.append(_completion_chunk(model, f"tok{i} ", None))
        else:
            delta: dict[str, Any] = {"content": f"tok{i} ", "reasoning_content": f"why{i}"}
            if i == 0:
                delta = {"role": "assistant", **delta}
            events.append(_chat_chunk(model, delta, None))
    if operation == "completion":
        events.append(_completion_chunk(model, "", "stop"))
    else:
        events.append(_chat_chunk(model, {}, "stop"))
    if include_usage:
        last = {**events[-1], "choices": [], "usage": _usage(chunks, cache)}
        events.append(last)
    if cache is not None and cache.where == "timings":
        events[-1] = {**events[-1], "timings": cache.timings()}
    return [_dumps(event) for event in events]


def expected_response(
    model: str, chunks: int, *, operation: str = "chat", cache: CacheReport | None = None
) -> bytes:
    """The exact body of a non-stream response."""
    text = "".join(f"tok{i} " for i in range(chunks))
    if operation == "embedding":
        body: dict[str, Any] = {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": EMBEDDING}],
            "model": model,
            "usage": {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS},
        }
    elif operation == "completion":
        body = {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}],
            "usage": _usage(chunks),
        }
    else:
        message = {"role": "assistant", "content": text, "reasoning_content": "why"}
        body = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "system_fingerprint": "fp_fake",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": _usage(chunks, cache),
        }
        if cache is not None and cache.where == "timings":
            body["timings"] = cache.timings()
    return _dumps({**body, **EXTRA})


#: What llama.cpp's Python server says (after `_answer`'s normal ones) when a request
#: fails its validation; the sentence a caller needs is the last line, past 500 characters.
INVALID_REASON = (
    "messages.2.content: Input should be a valid string (a tool result's content must not be null)"
)


#: The knobs that make the fake behave like llama.cpp's Python server.
LLAMA_CPP: dict[str, Any] = {
    "models_blocked_while_generating": True,
    "invalid_status": 500,
    "ignore_stream_options": True,
}


def is_invalid(payload: dict[str, Any]) -> bool:
    """A request llama.cpp's server cannot take (and answers with a 500)."""
    response_format = payload.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        return True
    messages = payload.get("messages")
    return isinstance(messages, list) and any(
        isinstance(message, dict) and "content" in message and message["content"] is None
        for message in messages
    )


def invalid_report() -> str:
    """A validation report shaped like llama.cpp's: several indented lines, reason last."""
    noise = [
        f"  {{'type': 'literal_error', 'loc': ('body', 'messages', 2, 'Variant{i}', 'role'), "
        f"'msg': \"Input should be 'variant{i}'\", 'input': 'tool'}}"
        for i in range(6)
    ]
    return "\n".join([f"{len(noise) + 1} validation errors:", *noise, f"  {INVALID_REASON}"])


def error_body(
    message: str, status: int, *, code: str | None = None, param: str | None = None
) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return _dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def prompt_tokens(payload: dict[str, Any]) -> int:
    """The fake's count of a chat request's prompt: a token per 4 characters of text."""
    messages = payload.get("messages") or []
    return sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, dict)) // 4


def overflow_body(tokens: int, context: int) -> bytes:
    """llama.cpp's answer to a prompt longer than its context (llama-server's words)."""
    message = (
        f"request ({tokens} tokens) exceeds the available context size ({context} tokens), "
        "try increasing it"
    )
    error = {
        "code": 400,
        "message": message,
        "type": "exceed_context_size_error",
        "n_prompt_tokens": tokens,
        "n_ctx": context,
    }
    return _dumps({"error": error})


_LISTINGS = frozenset({"/v1/models", "/api/tags"})
_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
#: Inference in a caller protocol: answered only when the `native` knob names it.
_NATIVE = frozenset({"messages", "responses"})
_TOKENIZE_PATHS = frozenset({"/tokenize", "/extras/tokenize/count"})


# --- the server -----------------------------------------------------------------------------


@dataclass
class FakeUpstream:
    """Knobs (read per request) and observations of one fake upstream server."""

    chunks: int = 3
    first_byte_delay_s: float = 0.0
    chunk_interval_s: float = 0.0
    hang: bool = False
    status: int = 200
    error_message: str = "fake upstream error"
    drop_after_chunks: int | None = None
    error_after_chunks: int | None = None
    pace: Callable[[int], Awaitable[None]] | None = None
    before_end: Callable[[], Awaitable[None]] | None = None
    """Awaited after a stream's last event (chat's `[DONE]`), before its body ends: the
    relay has the whole reply while the transport is not done with it yet."""
    models: list[str] = field(default_factory=lambda: ["fake-model"])
    models_status: int = 200
    version: str = "0.0.0-fake"
    models_blocked_while_generating: bool = False
    invalid_status: int | None = None
    ignore_stream_options: bool = False
    warmup: Callable[[], Awaitable[None]] | None = None
    interrupt_streams: bool = False
    native: frozenset[str] = frozenset()
    """The caller protocols served natively ("messages", "responses"); the others' routes
    answer `native_missing_status`, as a chat-only server does."""
    native_missing_status: int = 404
    cut_after_end: bool = False
    """A stream's body breaks off right after its last event (`[DONE]`, or the protocol's
    last one): the connection closes without the chunked body's terminator."""
    answer_body: bytes | None = None
    """A whole (non-stream) answer's body, in place of the completion, in any protocol."""
    indexed_responses: bool = True
    """False: a native Responses stream numbers nothing, as llama.cpp's server's does (no
    `sequence_number`, `output_index`, `content_index`)."""
    missing: frozenset[str] = frozenset()
    """OpenAI-compatible operations it has no endpoint for ("completion", "embedding"):
    answered 404 Not Found, as a chat-only server does."""
    count_tokens_route: bool = True
    """With "messages" native: whether `/v1/messages/count_tokens` exists."""
    tokenizer: str | None = None
    """The tokenizer endpoint's dialect (`fake_protocols.TOKENIZERS`); None: none. A
    `status` other than 200 fails it too."""
    error_code: str | None = None
    error_param: str | None = None
    """The `code` and `param` of the error answers `status` makes (None: null)."""
    error_headers: dict[str, str] = field(default_factory=dict)
    """Headers the error answers `status` makes carry besides their own (`Retry-After`)."""
    context_tokens: int | None = None
    """llama.cpp's context (`n_ctx`, told by `GET /props`): a chat prompt longer than this
    (`prompt_tokens`) is refused as llama.cpp refuses it, with a 400
    `exceed_context_size_error` (`overflow_body`), or, streamed, with a 200 whose body
    ends at once."""
    empty_streams: bool = False
    """Every stream is answered with a 200 whose body ends at once."""
    strict_messages: bool = False
    """A native Messages request with an input a strict runtime does not know (an
    `anthropic-beta` header, `context_management`, a `cache_control.ttl`) is answered
    400 "Extra inputs are not permitted", naming the first one, as a runtime validating
    with pydantic's `extra = "forbid"` answers (`fake_protocols.unknown_input`)."""
    lifecycle: str | None = None
    """The lifecycle API it speaks of its models' load states (`model_states`):
    "llama_router" (a `status` in each `/v1/models` entry, `/props` with `max_instances`),
    "ollama" (`/api/ps`), "lmstudio" (`/api/v1/models`), "vllm_sleep" (`/is_sleeping`);
    None: none (`/props`, `/api/ps`, `/is_sleeping` answer 404)."""
    loaded: set[str] = field(default_factory=set)
    """With `lifecycle`: the models in memory (the others are on disk)."""
    failed: dict[str, int] = field(default_factory=dict)
    """With "llama_router": models whose instance exited, and its exit code."""
    sleeping: bool = False
    """With "vllm_sleep": the engine is asleep."""
    max_loaded: int = 0
    """`--models-max` of a router; how many any dialect keeps loaded (0: no bound)."""
    loading: set[str] = field(default_factory=set)
    """Models a load was asked for: listed `loading` once, then loaded."""
    loads_evicted: bool = False
    """With "llama_router": a model a load was asked for is listed `loading` once and is
    gone by the next listing (another load took its place)."""
    loads_ignored: bool = False
    """With "llama_router": a load is answered 200 and never started."""
    load_order: list[str] = field(default_factory=list)
    """The loaded models, oldest load first (what a load evicts past `max_loaded`)."""
    loads: int = 0
    """With "llama_router": the loads its inference requests caused (autoload)."""
    scripted: Callable[[dict[str, Any]], list[bytes] | None] | None = None
    """A stream's `data:` payloads by its request's body, sent in place of the usual ones
    and followed by `[DONE]` (an empty list: a 200 whose body ends at once); None from
    it: the usual answer."""
    tls: ssl.SSLContext | None = None
    """Serve HTTPS with this server context (None: plain HTTP)."""
    runs_per_connection: int | None = None
    """A connection that has answered this many POSTs drops the next one unanswered, as
    a server closing an idle keep-alive connection just as a request arrives does (None:
    never)."""
    listings_dropped: int = 0
    """The next this many model listings (`GET /v1/models`) are dropped unanswered, as a
    runtime closing a keep-alive connection the client reuses does."""
    cache: CacheReport | None = None
    """Chat answers report this many prompt tokens read from the runtime's cache (None:
    they say nothing of a cache)."""

    requests: deque[RecordedRequest] = field(
        init=False, default_factory=lambda: deque(maxlen=_MAX_RECORDED)
    )
    requests_total: int = field(init=False, default=0)
    arrivals: int = field(init=False, default=0)
    """Requests of any kind received (model listings too)."""
    interrupted: int = field(init=False, default=0)
    """Streams cut short by `interrupt_streams`."""
    connections_total: int = field(init=False, default=0)
    dropped: int = field(init=False, default=0)
    """Requests dropped unanswered (`runs_per_connection`, `listings_dropped`)."""
    active: int = field(init=False, default=0)
    disconnects: int = field(init=False, default=0)
    root_url: str = field(init=False, default="")
    _changed: trio.Event = field(init=False, default_factory=trio.Event, repr=False)
    _warmed: bool = field(init=False, default=False, repr=False)

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL (`.../v1`), as an adapter's `base_url` wants it."""
        return self.root_url + "/v1"

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on 127.0.0.1:0; `task_status.started(base_url)` once accepting."""
        plain = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = plain[0].socket.getsockname()[1]
        listeners: list[trio.abc.Listener[trio.abc.Stream]] = list(plain)
        if self.tls is not None:
            listeners = [trio.SSLListener(one, self.tls) for one in plain]
        self.root_url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        task_status.started(self.base_url)
        await trio.serve_listeners(self._serve_connection, listeners)

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Block until `predicate()` holds; it is re-checked whenever an observation changes."""
        while not predicate():
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # --- one connection -------------------------------------------------------------------

    async def _serve_connection(self, stream: trio.abc.Stream) -> None:
        self.connections_total += 1
        self._notify()
        conn = h11.Connection(h11.SERVER)
        posts = 0
        try:
            while True:
                request = await self._read_request(stream, conn)
                if request is None:
                    return
                if self.listings_dropped and request.path == "/v1/models":
                    self.listings_dropped -= 1
                    self.dropped += 1
                    return
                if request.method == "POST":
                    if posts == self.runs_per_connection:
                        self.dropped += 1
                        return
                    posts += 1
                await self._respond(stream, conn, request)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except* (_ClientGone, trio.BrokenResourceError, trio.ClosedResourceError):
            self.disconnects += 1
            self._notify()
        except* (_Drop, h11.ProtocolError):
            pass
        finally:
            with trio.move_on_after(1, shield=True):
                await stream.aclose()

    async def _next_event(self, stream: trio.abc.Stream, conn: h11.Connection) -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(bytes(await stream.receive_some(65536)))

    async def _read_request(
        self, stream: trio.abc.Stream, conn: h11.Connection
    ) -> RecordedRequest | None:
        head = await self._next_event(stream, conn)
        if not isinstance(head, h11.Request):
            return None
        body = bytearray()
        while True:
            event = await self._next_event(stream, conn)
            if isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                return None
        request = RecordedRequest(
            method=head.method.decode(),
            path=head.target.decode(),
            headers={k.decode(): v.decode() for k, v in head.headers},
            body=bytes(body),
        )
        self.requests.append(request)
        self.arrivals += 1
        return request

    async def _send(self, stream: trio.abc.Stream, conn: h11.Connection, event: Any) -> None:
        data = conn.send(event)
        if data:
            await stream.send_all(data)

    async def _send_json(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        status: int,
        body: bytes,
        extra: dict[str, str] | None = None,
    ) -> None:
        headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
        headers += (extra or {}).items()
        await self._send(stream, conn, h11.Response(status_code=status, headers=headers))
        await self._send(stream, conn, h11.Data(data=body))
        await self._send(stream, conn, h11.EndOfMessage())

    def _answer_query(self, request: RecordedRequest) -> tuple[int, bytes]:
        """The JSON answer to a request that is not an inference (listings, health, 404)."""
        if request.method == "GET" and request.path == "/v1/models":
            if self.models_status != 200:
                return self.models_status, error_body(self.error_message, self.models_status)
            listing: list[dict[str, Any]] = [
                {"id": m, "object": "model", "owned_by": "fake"} for m in self.models
            ]
            if self.lifecycle == "llama_router":
                for entry in listing:
                    entry["status"] = self._router_status(entry["id"])
            return 200, _dumps({"object": "list", "data": listing})
        lifecycle = self._answer_lifecycle(request)
        if lifecycle is not None:
            return lifecycle
        if request.method == "GET" and request.path == "/api/tags":
            tags = [
                {"name": m, "model": m, "modified_at": "2025-01-01T00:00:00Z", "size": 1}
                for m in self.models
            ]
            return 200, _dumps({"models": tags})
        if request.method == "GET" and request.path == "/api/version":
            return 200, _dumps({"version": self.version})
        if (
            request.method == "POST"
            and request.path == "/v1/messages/count_tokens"
            and "messages" in self.native
            and self.count_tokens_route
        ):
            return 200, _dumps({"input_tokens": fake_protocols.NATIVE_COUNT})
        if request.method == "GET" and request.path == "/props" and self.context_tokens:
            settings = {"n_ctx": self.context_tokens, "params": {}}
            return 200, _dumps({"default_generation_settings": settings, "total_slots": 1})
        if request.method == "POST" and request.path in _TOKENIZE_PATHS and self.tokenizer:
            if self.status != 200:
                return self.status, error_body(self.error_message, self.status)
            answer = fake_protocols.tokenize_answer(
                self.tokenizer, request.path, json.loads(request.body)
            )
            if answer is not None:
                return answer
        return 404, error_body(f"no route for {request.method} {request.path}", 404)

    def _router_status(self, model: str) -> dict[str, Any]:
        if model in self.loading:
            self.loading.discard(model)
            if not self.loads_evicted:
                self._load(model)
            return {"value": "loading"}
        if model in self.failed:
            return {"value": "unloaded", "failed": True, "exit_code": self.failed[model]}
        return {"value": "loaded" if model in self.loaded else "unloaded", "args": ["llama"]}

    def _autoload(self, request: RecordedRequest) -> None:
        """A router loads the model a request names when it does not hold it."""
        model = json.loads(request.body or b"{}").get("model")
        if isinstance(model, str) and model in self.models and model not in self.loaded:
            self.loads += 1
            self._load(model)

    def _load(self, model: str) -> None:
        """Hold `model`, evicting the models loaded longest ago past `max_loaded`."""
        self.loaded.add(model)
        self.load_order = [m for m in self.load_order if m != model] + [model]
        while self.max_loaded and len(self.loaded) > self.max_loaded:
            self.loaded.discard(self.load_order.pop(0))

    def _command(self, request: RecordedRequest) -> tuple[int, bytes] | None:
        """A lifecycle dialect's load and unload routes, as each runtime answers them."""
        body = json.loads(request.body or b"{}")
        model = body.get("model", "")
        match (self.lifecycle, request.path):
            case ("llama_router", "/models/load"):
                if model not in self.models:
                    return 404, error_body("File Not Found", 404)
                if model in self.loaded:
                    return 400, error_body("model is already running", 400)
                if model not in self.failed and not self.loads_ignored:  # failed stays so
                    self.loading.add(model)  # loaded by the next listing (its load takes time)
                return 200, _dumps({"success": True})
            case ("llama_router", "/models/unload"):
                if model not in self.loaded:
                    return 400, error_body("model is not running", 400)
                self.loaded.discard(model)
                return 200, _dumps({"success": True})
            case ("ollama", "/api/generate"):
                if body.get("keep_alive") == 0:
                    self.loaded.discard(model)
                else:
                    self._load(model)
                return 200, _dumps({"model": model, "done": True, "response": ""})
            case ("lmstudio", "/api/v1/models/load"):
                self._load(model)
                return 200, _dumps({"type": "llm", "instance_id": model, "status": "loaded"})
            case ("lmstudio", "/api/v1/models/unload"):
                self.loaded.discard(body.get("instance_id", ""))
                return 200, _dumps({"instance_id": body.get("instance_id")})
            case ("vllm_sleep", "/wake_up"):
                self.sleeping = False
                return 200, b""
            case ("vllm_sleep", path) if path.partition("?")[0] == "/sleep":
                self.sleeping = True
                return 200, b""
        return None

    def _answer_lifecycle(self, request: RecordedRequest) -> tuple[int, bytes] | None:
        """The lifecycle dialect's own routes (`lifecycle`), or None for any other."""
        if request.method == "POST":
            return self._command(request)
        if request.method != "GET":
            return None
        match (self.lifecycle, request.path):
            case ("llama_router", "/props"):
                return 200, _dumps({"role": "router", "max_instances": self.max_loaded})
            case ("ollama", "/api/ps"):
                return 200, _dumps({"models": [{"name": m} for m in sorted(self.loaded)]})
            case ("lmstudio", "/api/v1/models"):
                models = [
                    {
                        "type": "llm",
                        "key": m,
                        "loaded_instances": [{"id": m}] if m in self.loaded else [],
                    }
                    for m in self.models
                ]
                return 200, _dumps({"models": models})
            case ("vllm_sleep", "/is_sleeping"):
                return 200, _dumps({"is_sleeping": self.sleeping})
        return None

    async def _respond(
        self, stream: trio.abc.Stream, conn: h11.Connection, request: RecordedRequest
    ) -> None:
        operation = _OPERATIONS.get(request.path)
        if operation in _NATIVE and operation not in self.native:
            status = self.native_missing_status
            await self._send_json(stream, conn, status, _not_found(status))
            return
        if operation in self.missing:
            await self._send_json(stream, conn, 404, _not_found(404))
            return
        if request.method != "POST" or operation is None:
            if self.models_blocked_while_generating and request.path in _LISTINGS:
                await self.wait_for(lambda: self.active == 0)
            status, body = self._answer_query(request)
            await self._send_json(stream, conn, status, body)
            return
        self.requests_total += 1
        if self.lifecycle == "llama_router":
            self._autoload(request)
        self.active += 1
        self._notify()
        try:
            await self._infer(stream, conn, request, operation)
        finally:
            self.active -= 1
            self._notify()

    async def _infer(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        request: RecordedRequest,
        operation: str,
    ) -> None:
        """Answer one inference request while watching for the client to leave.

        Like a real engine, the fake notices a disconnect at any point (waiting, hanging,
        streaming, paused by `pace`) and stops work on it, counting it in `disconnects`.
        """
        gone = False
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal gone
                while data := await stream.receive_some(65536):
                    conn.receive_data(bytes(data))  # a pipelined next request: keep it
                gone = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await self._answer(stream, conn, request, operation)
            nursery.cancel_scope.cancel()
        if gone:
            raise _ClientGone

    async def _answer(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        request: RecordedRequest,
        operation: str,
    ) -> None:
        if self.first_byte_delay_s:
            await trio.sleep(self.first_byte_delay_s)
        if self.warmup is not None and not self._warmed:
            self._warmed = True
            await self.warmup()
        if self.hang:
            await trio.sleep_forever()
        if self.status != 200:
            if operation == "messages":
                body = fake_protocols.messages_error(self.error_message, self.status)
            else:
                body = error_body(
                    self.error_message, self.status, code=self.error_code, param=self.error_param
                )
            await self._send_json(stream, conn, self.status, body, self.error_headers)
            return
        payload = json.loads(request.body)
        if operation == "messages" and self.strict_messages:
            unknown = fake_protocols.unknown_input(payload, request.headers)
            if unknown is not None:
                await self._send_json(stream, conn, 400, fake_protocols.extra_forbidden(unknown))
                return
        tokens = prompt_tokens(payload)
        overflow = self.context_tokens is not None and tokens > self.context_tokens
        script = self.scripted(payload) if self.scripted and payload.get("stream") else None
        if script is not None:
            await self._script(stream, conn, script)
            return
        if payload.get("stream") and (overflow or self.empty_streams):
            headers = [("content-type", "text/event-stream")]
            await self._send(stream, conn, h11.Response(status_code=200, headers=headers))
            await self._send(stream, conn, h11.EndOfMessage())
            return
        if overflow and self.context_tokens is not None:
            await self._send_json(stream, conn, 400, overflow_body(tokens, self.context_tokens))
            return
        if self.invalid_status is not None and is_invalid(payload):
            body = error_body(invalid_report(), self.invalid_status)
            await self._send_json(stream, conn, self.invalid_status, body)
            return
        model = str(payload.get("model", ""))
        if self.answer_body is not None and not payload.get("stream"):
            await self._send_json(stream, conn, 200, self.answer_body)
            return
        if operation in _NATIVE:
            await self._answer_natively(
                stream,
                conn,
                operation,
                model,
                bool(payload.get("stream")),
                store=payload.get("store") is not False,
            )
            return
        if operation == "embedding" or not payload.get("stream"):
            body = expected_response(model, self.chunks, operation=operation, cache=self.cache)
            await self._send_json(stream, conn, 200, body)
            return
        include_usage = not self.ignore_stream_options and bool(
            (payload.get("stream_options") or {}).get("include_usage")
        )
        events = expected_events(
            model,
            self.chunks,
            operation=operation,
            include_usage=include_usage,
            cache=self.cache,
        )
        headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
        await self._send(stream, conn, h11.Response(status_code=200, headers=headers))
        seen = self.arrivals
        for i, event in enumerate(events):
            if self.drop_after_chunks is not None and i >= self.drop_after_chunks:
                raise _Drop
            if self.error_after_chunks is not None and i >= self.error_after_chunks:
                failure = error_body(self.error_message, 500)
                await self._send(stream, conn, h11.Data(data=b"data: " + failure + b"\n\n"))
                break
            if i and self.chunk_interval_s:
                await trio.sleep(self.chunk_interval_s)
            if self.pace is not None:
                await self.pace(i)
            if not self.interrupt_streams:
                seen = self.arrivals
            elif self.arrivals != seen:  # another request came in: stop generating
                self.interrupted += 1
                self._notify()
                break
            await self._send(stream, conn, h11.Data(data=b"data: " + event + b"\n\n"))
        await self._send(stream, conn, h11.Data(data=b"data: [DONE]\n\n"))
        if self.before_end is not None:
            await self.before_end()
        if self.cut_after_end:
            raise _Drop
        await self._send(stream, conn, h11.EndOfMessage())

    async def _script(
        self, stream: trio.abc.Stream, conn: h11.Connection, script: list[bytes]
    ) -> None:
        headers = [("content-type", "text/event-stream")]
        await self._send(stream, conn, h11.Response(status_code=200, headers=headers))
        if script:
            for event in [*script, b"[DONE]"]:
                await self._send(stream, conn, h11.Data(data=b"data: " + event + b"\n\n"))
        await self._send(stream, conn, h11.EndOfMessage())

    async def _answer_natively(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        operation: str,
        model: str,
        streaming: bool,
        *,
        store: bool = True,
    ) -> None:
        """A Messages or Responses request, answered as a runtime that speaks it does (a
        Responses answer echoes the request's `store`)."""
        if not streaming:
            if operation == "messages":
                body = fake_protocols.messages_response(model, self.chunks)
            else:
                body = fake_protocols.responses_response(model, self.chunks, store=store)
            await self._send_json(stream, conn, 200, body)
            return
        if operation == "messages":
            events = fake_protocols.messages_events(model, self.chunks)
        else:
            events = fake_protocols.responses_events(
                model, self.chunks, store=store, indexed=self.indexed_responses
            )
        headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
        await self._send(stream, conn, h11.Response(status_code=200, headers=headers))
        for i, (name, data) in enumerate(events):
            if self.drop_after_chunks is not None and i >= self.drop_after_chunks:
                raise _Drop
            if self.error_after_chunks is not None and i >= self.error_after_chunks:
                failure = fake_protocols.sse(
                    *fake_protocols.in_band_error(operation, self.error_message)
                )
                await self._send(stream, conn, h11.Data(data=failure))
                break
            if self.pace is not None:
                await self.pace(i)
            await self._send(stream, conn, h11.Data(data=fake_protocols.sse(name, data)))
        if self.before_end is not None:
            await self.before_end()
        if self.cut_after_end:
            raise _Drop
        await self._send(stream, conn, h11.EndOfMessage())


def _not_found(status: int) -> bytes:
    """What a server without the route says (FastAPI's words, as vLLM's would be)."""
    return _dumps({"detail": "Not Found" if status == 404 else "Method Not Allowed"})
