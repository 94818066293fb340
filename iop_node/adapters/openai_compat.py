"""The adapter for upstreams that speak the OpenAI HTTP API (vllm, sglang, lemonade, openai_api).

The Edge already did everything caller-facing (auth, alias -> served name, validation), so
this adapter is a careful relay: the request body goes upstream byte for byte, a
non-stream response comes back byte for byte, and a stream is relayed one SSE event at a
time as each arrives, never re-encoded, so every provider-specific field (reasoning
content, tool calls, logprobs) passes through untouched. JSON is decoded only to peek at
`usage` and at in-band errors, through small msgspec views that skip everything else.

Caller protocols (design §14): a runtime that speaks Anthropic Messages or OpenAI
Responses itself gets such runs as they are (`execute_native`), at `{base_url}/messages`
and `{base_url}/responses` (beside chat's `/chat/completions`), with the caller's protocol
headers (`anthropic-version`, `anthropic-beta`) and, for Messages, the API key as
`x-api-key` too. The reply comes back under the same deadlines and failure rules as
chat's, shaped by `native` (the caller's alias, usage read from the few events that carry
it). A 404 on the route itself (not about the model), or a 405, is `NativeUnsupported`:
the Node translates that run, and learns (`protocol_support`). Token counts, rare and
small, go through the client: Anthropic's `/messages/count_tokens`, and the runtime's
tokenizer endpoint at the server root (`tokenizer`).

Deadlines (set here, once, from the provider's adapter settings):

- *first byte* (streams only): from the start of the request until the first whole
  event, `first_byte_timeout_s` when set, else `request_timeout_s`; a server that sends
  headers (or keep-alive comments) at once and then stalls in prefill is still caught by
  it. A non-stream response has no such deadline: engines send its first byte only when
  the whole generation is done, so a first-byte bound there would cut every long answer
  (and, being retryable, fail it over and cool healthy providers down).
- *whole request*: `request_timeout_s` from the start, whatever happens.

One cancel scope carries both: it starts with the first-byte deadline and is moved to the
whole-request deadline when the first body byte arrives. The runner's own scope (caller
gone, Edge cancel) sits outside and simply propagates; cancelling it closes the HTTP
stream, which closes the upstream connection, which stops the generation upstream.

Failures become `AdapterError`s (see `base.py`), following one rule for `retryable`: a
failure is retryable iff no chunk was emitted yet. Before the first chunk:

    connect refused / DNS / connect timeout  upstream_unreachable  retryable
    no body byte within the first-byte budget upstream_timeout     retryable
    429, 503                                  upstream_busy        retryable, capacity
    408                                       upstream_timeout     retryable
    other 5xx, broken connection, bad body    upstream_error       retryable
    401, 403, 404                             upstream_misconfigured retryable: the
                                              provider's key or model is wrong, not
                                              the caller's request; another may serve
    other 4xx                                 upstream_rejected    not retryable,
                                                                   upstream's message
After the first chunk: anything                upstream_stream_error not retryable

An error status's message is the upstream's own, whitespace kept, up to `MESSAGE_LIMIT`
(8 KiB): llama.cpp puts the reason for a 500 at the end of a long validation report, and
the caller of a request the upstream refused deserves to read it. Whom a failure blames
(the provider, or the request) is the Edge's decision (design §4 item 10), not the adapter's.

The HTTP client is one long-lived `httpx2.AsyncClient` per adapter; httpcore2 picks its
Trio backend by sniffing the running async library, so nothing here names a backend.
Health probes go through the client. Runs do not: they are sent as prepared
`httpcore2.Request`s on keep-alive connections of their own (`RunConnections`: up to
capacity+2 idle, forgotten after 4 s), made by the httpcore2 pool the client routes
`base_url` to, its own pool or, when HTTP(S)_PROXY/ALL_PROXY apply (NO_PROXY honoured,
decided by httpx2's own routing), the proxy pool it mounted (`iop_node.compat.httpx2`). So
runs have the client's TLS settings (verification on) and proxy, and the hot path (every
run, every chunk of a stream) skips httpx2's per-request models, auth/redirect/cookie
plumbing, transport lookup and per-chunk stream wrappers, and the pool's bookkeeping of
every connection it holds (docs/benchmarks.md#results has what each saves). Because
httpcore2 does not decode content codings, runs ask for `Accept-Encoding: identity` and
refuse an encoded body as `upstream_error`. Once `aclose()`d the adapter cannot be
reused.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, ClassVar, Final, TypeVar, cast

import httpcore2
import httpx2
import msgspec
import trio

from iop_node.adapters import native
from iop_node.adapters.base import (
    AdapterError,
    Emit,
    EmitEvents,
    NativeRelay,
    NativeUnsupported,
    ProbeTimeout,
    RunResult,
)
from iop_node.adapters.model_states import LLAMA_LISTING_DECODER
from iop_node.adapters.run_connections import CLOSE_GRACE_S, RunConnections
from iop_node.adapters.runtime_lifecycle import RuntimeLifecycle
from iop_node.adapters.sse import SSEDecoder, SSEError
from iop_node.adapters.tokenizer import TokenizerEndpoint
from iop_node.adapters.upstream_errors import (
    CONTEXT_LENGTH_EXCEEDED,
    INPUT_FIELDS,
    error_message,
    read_error_facts,
)
from iop_node.cache_timings import timings_cached
from iop_node.compat.httpx2 import connection_pool_for
from iop_node.protocol_support import ProtocolSupport
from iop_node.reply import NotAnObject, ParsedChunk, UsageView, read_chunk
from iop_node.tracing import UpstreamCall, passed_on, upstream_call
from schemas.config import ProviderConfig
from schemas.protocols import CallerProtocol
from schemas.tokens import estimate_input_tokens, input_text, template_tokens
from schemas.wire import FailureCode, Operation, ProviderStatus, Run, Usage

log = logging.getLogger(__name__)

OPERATION_PATHS: Final[dict[Operation, str]] = {
    "chat": "/chat/completions",
    "completion": "/completions",
    "embedding": "/embeddings",
}
#: The endpoints of the caller protocols a runtime may speak natively, under `base_url`
#: like chat's (design §14).
NATIVE_PATHS: Final[dict[CallerProtocol, str]] = {
    "messages": "/messages",
    "responses": "/responses",
}
_NATIVE_OPERATIONS: Final[dict[str, CallerProtocol]] = {
    "messages": "messages",
    "responses": "responses",
}
COUNT_TOKENS_PATH: Final = "/messages/count_tokens"
#: Anthropic's API refuses a request without `anthropic-version`; a caller that sent none
#: (the Edge passes the caller's own when there is one) gets the first stable version,
#: which every Messages-speaking runtime accepts.
DEFAULT_ANTHROPIC_VERSION: Final = "2023-06-01"
#: Headers the adapter owns: a caller's header of these names is never passed on.
_OWN_HEADERS: Final = frozenset(
    {
        "host",
        "content-length",
        "content-type",
        "accept",
        "accept-encoding",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "authorization",
        "x-api-key",
        "user-agent",
        "proxy-authorization",
        "traceparent",
        "tracestate",
    }
)

#: uvicorn (under vLLM, SGLang, most Python servers) drops idle connections after 5 s;
#: forgetting ours a little earlier avoids sending a request on a connection being closed.
_KEEPALIVE_EXPIRY_S = 4.0
#: Bytes of an error response read to find the upstream's message; the rest is dropped.
_ERROR_BODY_LIMIT = 64 * 1024
#: Longest one-line detail of a probe or transport failure (a status detail, a log line).
_DETAIL_LIMIT = 500
#: After `[DONE]`, how long to wait for the end of the chunked body so the connection can
#: go back to the pool; a server that keeps talking past `[DONE]` just loses its connection.
_DRAIN_AFTER_DONE_S = 1.0
_DONE: Final = b"[DONE]"
#: What the run path raises from `httpcore2` (it has no common base class); the probe path
#: and anything httpx2 raises are `httpx2.HTTPError`s.
_CORE_ERRORS: Final = (
    httpcore2.TimeoutException,
    httpcore2.NetworkError,
    httpcore2.ProtocolError,
    httpcore2.ProxyError,
    httpcore2.UnsupportedProtocol,
)

_T = TypeVar("_T")


# --- msgspec views: decode only the few fields we look at ----------------------------------


class _BodyView(msgspec.Struct):
    """A whole response, as far as the relay cares (a stream chunk is read by
    `reply.read_chunk`, once for the whole Node)."""

    usage: UsageView | None = None
    error: Any = None
    object: str | None = None
    timings: msgspec.Raw = msgspec.Raw()

    def is_error(self) -> bool:
        return self.error is not None or self.object == "error"


class _TokenCount(msgspec.Struct):
    input_tokens: int


_body_decoder: Final = msgspec.json.Decoder(_BodyView)
_request_decoder: Final = msgspec.json.Decoder(dict[str, Any])


def _max_output_tokens(body: dict[str, Any]) -> int:
    """The output a request asks room for (its `max_completion_tokens` or `max_tokens`)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _decode_body(body: bytes) -> dict[str, Any] | None:
    """A run's request body as a dict (None if it is not one)."""
    try:
        return _request_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None


_token_count_decoder: Final = msgspec.json.Decoder(_TokenCount)


# --- helpers (pure) ---------------------------------------------------------------------------


def _clip(text: str) -> str:
    """One line of at most `_DETAIL_LIMIT` characters (a status detail, a log line)."""
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_LIMIT else text[: _DETAIL_LIMIT - 3] + "..."


def status_failure(status: int, body: bytes, operation: Operation | None = None) -> AdapterError:
    """Map a non-2xx upstream response onto an `AdapterError` (table in the module doc);
    a refusal keeps the upstream's error code and the field it names (`upstream_errors`)."""
    detail = error_message(body)
    suffix = f": {detail}" if detail else ""
    if status in (429, 503):
        return AdapterError(
            FailureCode.UPSTREAM_BUSY,
            f"upstream busy ({status}){suffix}",
            retryable=True,
            capacity=True,
            status=status,
        )
    if status in (401, 403, 404):
        return AdapterError(
            FailureCode.UPSTREAM_MISCONFIGURED,
            f"upstream refused this provider ({status}){suffix}",
            retryable=True,
            status=status,
        )
    if status == 408:
        return AdapterError(
            FailureCode.UPSTREAM_TIMEOUT,
            f"upstream timed out ({status}){suffix}",
            retryable=True,
            status=status,
        )
    if 400 <= status < 500:
        facts = read_error_facts(body, operation)
        return AdapterError(
            FailureCode.UPSTREAM_REJECTED,
            detail or f"upstream rejected the request ({status})",
            status=status,
            upstream_code=facts.code,
            param=facts.param,
        )
    # The upstream's own words: the Edge decides whom a 5xx blames (the provider, or the
    # request when another provider fails it the same way) and words the reply itself.
    return AdapterError(
        FailureCode.UPSTREAM_ERROR,
        detail or f"upstream returned {status}",
        retryable=True,
        status=status,
    )


def describe_transport_error(exc: Exception) -> str:
    """A short, secret-free description of a transport (or event-stream) failure."""
    match exc:
        case httpx2.ConnectTimeout() | httpcore2.ConnectTimeout():
            what = "connect timed out"
        case httpx2.ConnectError() | httpcore2.ConnectError():
            what = "cannot connect"
        case httpx2.TimeoutException() | httpcore2.TimeoutException():
            what = "timed out"
        case httpx2.RemoteProtocolError() | httpcore2.RemoteProtocolError():
            what = "protocol error"
        case SSEError():
            what = "bad event stream"
        case _:
            what = "connection failed"
    detail = str(exc).strip()
    return _clip(f"{what}: {detail}") if detail else what


@dataclass(slots=True)
class _Progress:
    """How far one request got: drives the deadline switch and the `retryable` rule."""

    scope: trio.CancelScope
    request_deadline: float
    first_byte: bool = False
    emitted: int = 0
    call: UpstreamCall | None = None
    """The request's span when the run is traced (`iop_node.tracing`)."""

    def saw_first_byte(self) -> None:
        if not self.first_byte:
            self.first_byte = True
            self.scope.deadline = self.request_deadline
            if self.call is not None:
                self.call.first_byte()

    def trace_headers(self, run: Run) -> list[tuple[bytes, bytes]]:
        """The W3C trace context the upstream request carries: its own span's when
        traced, else the Edge's as the run brought it."""
        return self.call.headers if self.call is not None else passed_on(run)


class _ProbeFailure(Exception):
    """A health check found the upstream unusable; the message is the status detail."""


class _EmptyStream(Exception):
    """A stream answered 200 and ended with no event at all: how llama.cpp's server
    answers a streamed prompt longer than its context. `failure` is what it is when the
    prompt fits (a broken stream)."""

    def __init__(self, failure: AdapterError) -> None:
        super().__init__(failure.message)
        self.failure = failure


class _PropsView(msgspec.Struct):
    """llama.cpp's `GET /props`, as far as the context size goes (per slot)."""

    n_ctx: int | None = None
    default_generation_settings: dict[str, Any] | None = None

    def context_tokens(self) -> int | None:
        settings = self.default_generation_settings or {}
        value = settings.get("n_ctx", self.n_ctx)
        return value if isinstance(value, int) and value > 0 else None


_props_decoder: Final = msgspec.json.Decoder(_PropsView)
#: Bound on what a failed stream may spend finding out whether it was a context overflow.
_OVERFLOW_CHECK_S: Final = 2.0


# --- the adapter ------------------------------------------------------------------------------


def missing_route(status: int, body: bytes, model: str) -> bool:
    """Whether a native endpoint's error answer means the route does not exist: a 405, or
    a 404 that is not about the model (a server without the route says "Not Found"; one
    with it says which model it does not know, and that is no lesson about the protocol)."""
    if status == 405:
        return True
    if status != 404:
        return False
    message = error_message(body) or ""
    return not model or model not in message


class OpenAICompatAdapter(NativeRelay):
    """Relay runs to an OpenAI-compatible HTTP upstream at `provider.adapter.base_url`."""

    #: Used when the config has no `base_url`; None means the setting is required.
    default_base_url: ClassVar[str | None] = None

    def __init__(self, provider: ProviderConfig) -> None:
        self.provider = provider
        settings = provider.adapter
        base_url = settings.base_url or self.default_base_url
        if base_url is None:
            raise ValueError(f"provider {provider.id!r}: adapter.base_url is required")
        try:
            url = httpx2.URL(base_url)
        except httpx2.InvalidURL:
            url = httpx2.URL()
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"provider {provider.id!r}: adapter.base_url must be an http(s) URL")
        self.base_url = base_url.rstrip("/")
        self._origin = url.netloc.decode("ascii")

        headers = {"User-Agent": "iop-node"}
        self._missing_key_env: str | None = None
        key: str | None = None
        if settings.api_key_env is not None:
            key = os.environ.get(settings.api_key_env)
            if key:
                headers["Authorization"] = f"Bearer {key}"
            else:
                self._missing_key_env = settings.api_key_env
        self.protocol_support = ProtocolSupport(provider)
        self.root_url = base_url.rstrip("/").removesuffix("/v1")
        """The server root, where runtimes put what is not OpenAI's (tokenizers)."""
        self._tokenizer = TokenizerEndpoint()
        self._probe_sent = False
        self._context_tokens: int | None = None
        """The runtime's context size (per slot), once learnt: from llama.cpp's `/props`
        or an overflow answer's `n_ctx`."""
        self._props_absent = False

        self._first_byte_s = min(
            settings.first_byte_timeout_s or settings.request_timeout_s,
            settings.request_timeout_s,
        )
        self._closed = False
        # Concurrency is bounded by the Edge's admission (`capacity`), not here: a pool
        # limit could only make runs wait where the Edge cannot see them. Runs and the
        # client's pool each keep up to `idle_kept` idle connections: enough for every
        # slot and then some. The per-operation timeouts are ceilings; the real budgets
        # are the two deadlines of `execute`. Proxy settings from the Node's environment
        # (HTTPS_PROXY, NO_PROXY) apply, as for any client.
        idle_kept = provider.capacity + 2
        self._client = httpx2.AsyncClient(
            headers=headers,
            timeout=httpx2.Timeout(
                connect=settings.connect_timeout_s,
                read=settings.request_timeout_s,
                write=settings.request_timeout_s,
                pool=settings.request_timeout_s,
            ),
            limits=httpx2.Limits(
                max_connections=None,
                max_keepalive_connections=idle_kept,
                keepalive_expiry=_KEEPALIVE_EXPIRY_S,
            ),
            follow_redirects=False,
        )
        self._models_url = httpx2.URL(self.base_url + "/models")
        self._lifecycle = RuntimeLifecycle(
            self._client,
            self.root_url,
            self.base_url + "/models",
            asks_sleep=provider.type == "vllm",
        )
        # Runs skip the httpx2 layer: they go out on connections made by the httpcore2
        # pool the client above routes `base_url` to (see the module doc for why). Asking
        # the client for that pool, rather than building a second one, keeps every
        # connection setting (expiry, TLS verification, the environment's proxy) exactly
        # the client's. Everything about a run's request that does not depend on the run
        # is prepared here, once: URLs, header lists, the timeout table; per run only the
        # body and its length change.
        self._pool = connection_pool_for(self._client, url)
        self._connections = RunConnections(self._pool, keep=idle_kept, expiry_s=_KEEPALIVE_EXPIRY_S)
        self._run_urls = {
            operation: _core_url(httpx2.URL(self.base_url + path))
            for operation, path in OPERATION_PATHS.items()
        }
        fixed = [
            (b"Host", _host_header(url)),
            (b"Connection", b"keep-alive"),
            # We relay bytes as they arrive, so we ask for them unencoded (httpx2 would
            # decode gzip for us; httpcore2 does not). See `_check_encoding`.
            (b"Accept-Encoding", b"identity"),
            (b"Content-Type", b"application/json"),
            *((name.encode(), value.encode()) for name, value in headers.items()),
        ]
        self._run_headers = {
            stream: [
                *fixed,
                (b"Accept", b"text/event-stream" if stream else b"application/json"),
            ]
            for stream in (False, True)
        }
        # Anthropic's clients authenticate with `x-api-key`; a Messages runtime may read
        # either header, so both carry the key.
        api_key = [(b"x-api-key", key.encode())] if key else []
        self._native_urls = {
            protocol: _core_url(httpx2.URL(self.base_url + path))
            for protocol, path in NATIVE_PATHS.items()
        }
        self._native_headers: dict[tuple[CallerProtocol, bool], list[tuple[bytes, bytes]]] = {
            (protocol, stream): [
                *self._run_headers[stream],
                *(api_key if protocol == "messages" else ()),
            ]
            for protocol in NATIVE_PATHS
            for stream in (False, True)
        }
        self._count_tokens_url = httpx2.URL(self.base_url + COUNT_TOKENS_PATH)
        self._count_tokens_headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            **({"x-api-key": key} if key else {}),
        }
        self._request_extensions: dict[str, object] = {"timeout": self._client.timeout.as_dict()}

    # --- Adapter protocol -----------------------------------------------------------------

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        if self._lifecycle.asleep:  # a vLLM in sleep mode wakes first
            await self._lifecycle.awake(self.provider.adapter.load_timeout_s)
        url = self._run_urls.get(run.operation)
        if url is None:
            raise AdapterError(
                FailureCode.UNSUPPORTED_OPERATION,
                f"operation {run.operation!r} is not an OpenAI-compatible endpoint",
            )

        async def exchange(progress: _Progress) -> RunResult:
            return await self._exchange(run, url, emit, progress)

        try:
            return await self._bounded(run, exchange, OPERATION_PATHS[run.operation])
        except _EmptyStream as empty:
            raise await self._overflow_or(run, empty.failure) from None

    async def execute_native(self, run: Run, events: EmitEvents) -> RunResult:
        if self._lifecycle.asleep:  # a vLLM in sleep mode wakes first
            await self._lifecycle.awake(self.provider.adapter.load_timeout_s)
        protocol = _NATIVE_OPERATIONS.get(run.operation)
        if protocol is None:
            raise AdapterError(
                FailureCode.UNSUPPORTED_OPERATION,
                f"operation {run.operation!r} is not a caller protocol",
            )

        async def exchange(progress: _Progress) -> RunResult:
            return await self._exchange_native(run, protocol, events, progress)

        return await self._bounded(run, exchange, NATIVE_PATHS[protocol])

    async def count_tokens_native(self, run: Run) -> int | None:
        headers = {**self._count_tokens_headers, **_caller_headers(run, "messages")}
        status, body = await self._post_bounded(self._count_tokens_url, run.body, headers)
        if status in (404, 405):
            self.protocol_support.learn_no_token_count()
            return None
        if not 200 <= status < 300:
            raise status_failure(status, body)
        try:
            return max(_token_count_decoder.decode(body).input_tokens, 0)
        except msgspec.DecodeError:
            raise AdapterError(
                FailureCode.UPSTREAM_ERROR,
                "upstream's count_tokens answer has no `input_tokens` count",
                retryable=True,
            ) from None

    async def tokenize_count(self, model: str, text: str) -> int | None:
        tokenizer = self._tokenizer
        for candidate in tokenizer.plan():
            url = self.root_url + tokenizer.path(candidate)
            body = tokenizer.body(candidate, model, text)
            try:
                status, answer = await self._post_bounded(
                    url, body, {"Content-Type": "application/json"}
                )
            except AdapterError as exc:
                log.debug("tokenizer of provider %s failed: %s", self.provider.id, exc.message)
                return None
            count = tokenizer.learn(candidate, status, answer)
            if count is not None:
                return count
            if not tokenizer.missing(status):
                log.debug(
                    "tokenizer of provider %s answered %s: %s",
                    self.provider.id,
                    status,
                    _clip(error_message(answer) or ""),
                )
                return None
        return None

    # --- context overflow -----------------------------------------------------------------

    def _learn_context(self, tokens: int | None) -> None:
        if tokens is not None:
            self._context_tokens = tokens

    async def _overflow_or(self, run: Run, failure: AdapterError) -> AdapterError:
        """What an empty stream was: a context overflow when the prompt and the output
        it asks room for exceed the runtime's context (llama-cpp-python counts both),
        else `failure`. Only on this failure path, within `_OVERFLOW_CHECK_S`: the
        context size (learnt from an earlier overflow answer, else llama.cpp's `/props`)
        and the prompt's tokens (the runtime's tokenizer, else the estimate)."""
        with trio.move_on_after(_OVERFLOW_CHECK_S):
            context = self._context_tokens or await self._fetch_context()
            if context is None:
                return failure
            body = _decode_body(run.body)
            if body is None:
                return failure
            counted = await self.runtime_prompt_tokens(run.target, body)
            tokens = estimate_input_tokens(body) if counted is None else counted
            output = _max_output_tokens(body)
            if tokens + output > context:
                asked = f" and {output} of output" if output else ""
                return AdapterError(
                    FailureCode.UPSTREAM_REJECTED,
                    f"the request needs about {tokens} tokens of prompt{asked}, more than "
                    f"the provider's context of {context} tokens (the upstream ended the "
                    "stream without a word)",
                    status=400,
                    upstream_code=CONTEXT_LENGTH_EXCEEDED,
                    param=INPUT_FIELDS.get(run.operation),
                )
        return failure

    async def _fetch_context(self) -> int | None:
        """The runtime's context size from llama.cpp's `GET /props` (asked until it says
        there is no such route)."""
        if self._props_absent:
            return None
        try:
            response = await self._client.get(
                self.root_url + "/props", headers={"Accept": "application/json"}
            )
        except httpx2.HTTPError:
            return None
        if response.status_code in (404, 405):
            self._props_absent = True
            return None
        try:
            tokens = _props_decoder.decode(response.content).context_tokens()
        except msgspec.DecodeError:
            return None
        self._learn_context(tokens)
        return tokens

    async def runtime_prompt_tokens(self, model: str, body: dict[str, Any]) -> int | None:
        """The prompt tokens of a request `body` by the runtime's own tokenizer: its count
        of the text plus the chat template's share (`schemas.tokens`); None when the
        runtime has no tokenizer endpoint (or it failed). The caller bounds the wait."""
        counted = await self.tokenize_count(model, input_text(body))
        return None if counted is None else counted + template_tokens(body)

    async def _bounded(
        self, run: Run, exchange: Callable[[_Progress], Awaitable[RunResult]], path: str
    ) -> RunResult:
        """Run one exchange to `path` under the adapter's deadlines, in its own span when
        the run is traced (`iop_node.tracing`)."""
        call = upstream_call(self.base_url, path)
        if call is None:
            return await self._within_deadlines(run, exchange, None)
        try:
            return await self._within_deadlines(run, exchange, call)
        except AdapterError as exc:
            call.failed(str(exc.code))
            raise
        except _EmptyStream as exc:
            call.failed(str(exc.failure.code))
            raise
        finally:
            call.done()

    async def _within_deadlines(
        self,
        run: Run,
        exchange: Callable[[_Progress], Awaitable[RunResult]],
        call: UpstreamCall | None,
    ) -> RunResult:
        """Run one exchange under the adapter's deadlines (see the module doc), mapping
        transport failures and deadlines onto `AdapterError`s."""
        if self._closed:
            raise AdapterError(FailureCode.ADAPTER_CLOSED, "adapter was retired", retryable=True)
        start = trio.current_time()
        request_timeout_s = self.provider.adapter.request_timeout_s
        first_byte_s = self._first_byte_s if run.stream else request_timeout_s
        with trio.CancelScope(deadline=start + first_byte_s) as scope:
            progress = _Progress(scope=scope, request_deadline=start + request_timeout_s, call=call)
            try:
                return await exchange(progress)
            except (*_CORE_ERRORS, SSEError) as exc:
                raise self._transport_failure(exc, progress) from exc
        # Only reached when one of our own deadlines fired.
        if progress.emitted:
            raise AdapterError(
                FailureCode.UPSTREAM_STREAM_ERROR,
                f"request did not complete within {request_timeout_s:g}s "
                f"(after {progress.emitted} chunks)",
            )
        if not progress.first_byte:
            raise AdapterError(
                FailureCode.UPSTREAM_TIMEOUT,
                f"no response from {self._origin} within {first_byte_s:g}s",
                retryable=True,
            )
        raise AdapterError(
            FailureCode.UPSTREAM_TIMEOUT,
            f"request did not complete within {request_timeout_s:g}s",
            retryable=True,
        )

    @property
    def probe_reached_upstream(self) -> bool:
        """Whether the last probe's request went out on a connection the upstream
        accepted (`base.ProbeWitness`)."""
        return self._probe_sent

    async def _note_probe_progress(self, event: str, info: dict[str, Any]) -> None:
        """httpcore2's trace of a probe: its request headers were sent, so the upstream
        accepted the connection (a fresh one or a kept-alive one)."""
        if event.endswith("send_request_headers.complete"):
            self._probe_sent = True

    async def probe(self) -> ProviderStatus:
        self._probe_sent = False
        if self._closed:
            return self._unavailable("adapter was retired")
        if self._missing_key_env is not None:
            return self._unavailable(f"environment variable {self._missing_key_env} is not set")
        try:
            return await self._check_health()
        except _ProbeFailure as exc:
            return self._unavailable(str(exc))
        except httpx2.ConnectTimeout as exc:  # nothing accepted the connection: down
            return self._unavailable(describe_transport_error(exc))
        except httpx2.TimeoutException as exc:  # connected, no answer: maybe busy
            raise ProbeTimeout(describe_transport_error(exc)) from exc
        except httpx2.HTTPError as exc:
            return self._unavailable(describe_transport_error(exc))

    async def aclose(self) -> None:
        self._closed = True
        await self._connections.aclose()
        with trio.move_on_after(CLOSE_GRACE_S, shield=True):
            await self._client.aclose()

    # --- health ---------------------------------------------------------------------------

    async def _check_health(self) -> ProviderStatus:
        """One health check; raise `_ProbeFailure` or an httpx error when unhealthy.

        Subclasses override this to use a runtime's native API."""
        listing = await self._get_json(self._models_url, LLAMA_LISTING_DECODER, "/models")
        # The OpenAI API lists models; some runtimes say more of their load states.
        return await self._lifecycle.status(self.provider.id, listing)

    async def load_model(self, model: str) -> None:
        """`base.ModelLifecycle`: a llama.cpp router loads it, a sleeping vLLM wakes."""
        await self._lifecycle.load(model)

    async def unload_model(self, model: str) -> None:
        await self._lifecycle.unload(model)

    async def _get_json(
        self, url: httpx2.URL | str, decoder: msgspec.json.Decoder[_T], name: str
    ) -> _T:
        response = await self._client.get(
            url,
            headers={"Accept": "application/json"},
            extensions={"trace": self._note_probe_progress},
        )
        if response.status_code != 200:
            detail = error_message(response.content[:_ERROR_BODY_LIMIT])
            suffix = f": {detail}" if detail else ""
            raise _ProbeFailure(f"GET {name} returned {response.status_code}{suffix}")
        try:
            return decoder.decode(response.content)
        except msgspec.DecodeError as exc:
            raise _ProbeFailure(f"GET {name} returned an unexpected body: {exc}") from None

    def _unavailable(self, detail: str) -> ProviderStatus:
        return ProviderStatus(id=self.provider.id, health="unavailable", detail=_clip(detail))

    # --- one request ----------------------------------------------------------------------

    async def _exchange(
        self, run: Run, url: httpcore2.URL, emit: Emit, progress: _Progress
    ) -> RunResult:
        request = self._post(
            url, [*self._run_headers[run.stream], *progress.trace_headers(run)], run.body
        )
        connection, response = await self._send(request, progress)
        try:
            if not 200 <= response.status < 300:
                body = await _error_body(response, progress)
                self._learn_context(read_error_facts(body).context_tokens)
                raise status_failure(response.status, body, run.operation)
            _check_encoding(response)
            if run.stream:
                return await self._relay_stream(response, emit, progress)
            body = await _read_body(response, progress)
        finally:
            await self._close(connection, response)
        try:
            view = _body_decoder.decode(body)
        except msgspec.ValidationError:
            return RunResult(response=body)  # valid JSON we cannot read usage from
        except msgspec.DecodeError:
            raise AdapterError(
                FailureCode.UPSTREAM_ERROR,
                "upstream returned a body that is not JSON",
                retryable=True,
                reply_fault=True,
            ) from None
        if view.is_error():
            raise AdapterError(
                FailureCode.UPSTREAM_ERROR,
                f"upstream returned an error: {error_message(body) or 'unknown error'}",
                retryable=True,
            )
        usage = view.usage.to_usage(timings_cached(view.timings)) if view.usage else None
        return RunResult(usage=usage, response=body)

    def _post(
        self, url: httpcore2.URL, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> httpcore2.Request:
        """A run's POST: `headers` and the body's length, within the client's timeouts."""
        return httpcore2.Request(
            b"POST",
            url,
            headers=[*headers, (b"Content-Length", b"%d" % len(body))],
            content=body,
            extensions=self._request_extensions,
        )

    async def _send(
        self, request: httpcore2.Request, progress: _Progress
    ) -> tuple[httpcore2.AsyncConnectionInterface, httpcore2.Response]:
        """Send a run's request on a pooled connection (`_close` gives it back), noting
        the status on the run's trace."""
        connection, response = await self._connections.send(request)
        if progress.call is not None:
            progress.call.status(response.status)
        return connection, response

    async def _close(
        self, connection: httpcore2.AsyncConnectionInterface, response: httpcore2.Response
    ) -> None:
        """Close a run's response and give its connection back, even when closing fails."""
        try:
            await response.aclose()
        finally:
            await self._connections.give_back(connection)

    async def _relay_stream(
        self, response: httpcore2.Response, emit: Emit, progress: _Progress
    ) -> RunResult:
        decoder = SSEDecoder()
        usage: Usage | None = None
        finished = False
        done = False
        async with aclosing(_body_chunks(response)) as body:
            async for raw in body:
                for event in decoder.feed(raw):
                    progress.saw_first_byte()
                    data = event.data
                    if data == _DONE:
                        done = True
                        break
                    if not data.strip():
                        continue
                    parsed = self._inspect_chunk(data, event.event, progress)
                    if parsed is not None:
                        if parsed.usage is not None:
                            usage = parsed.usage.to_usage(
                                timings_cached(parsed.fields.get("timings"))
                            )
                        finished = finished or parsed.finished
                    await emit(data, parsed)
                    progress.emitted += 1
                if done:
                    break
            if done:
                # Let the end of the chunked body arrive so the connection is reused.
                with trio.move_on_after(_DRAIN_AFTER_DONE_S):
                    async for _ in body:
                        pass
                return RunResult(usage=usage)
        # The body ended without `[DONE]`: fine if the model had finished, else truncated.
        if finished:
            return RunResult(usage=usage)
        failure = self._stream_cut(
            progress, "upstream stream ended before [DONE]", reply_fault=True
        )
        if not progress.first_byte:
            raise _EmptyStream(failure)
        raise failure

    async def _exchange_native(
        self, run: Run, protocol: CallerProtocol, events: EmitEvents, progress: _Progress
    ) -> RunResult:
        """A `messages` or `responses` run sent as it is (`native` has the rules of what
        comes back)."""
        headers = [
            *self._native_headers[protocol, run.stream],
            *_caller_header_pairs(run, protocol),
            *progress.trace_headers(run),
        ]
        request = self._post(self._native_urls[protocol], headers, run.body)
        reply = native.NativeReply(run, protocol)
        connection, response = await self._send(request, progress)
        try:
            if not 200 <= response.status < 300:
                body = await _error_body(response, progress)
                failure = status_failure(response.status, body)
                if missing_route(response.status, body, run.target):
                    raise NativeUnsupported(protocol, failure)
                raise failure
            _check_encoding(response)
            if run.stream:
                return await self._relay_native_stream(response, reply, events, progress)
            body = await _read_body(response, progress)
        finally:
            await self._close(connection, response)
        try:
            shaped = reply.response(body)
        except native.NotAnObject as exc:
            raise AdapterError(
                FailureCode.UPSTREAM_ERROR,
                f"bad upstream output: {exc}",
                retryable=True,
                reply_fault=True,
            ) from None
        except native.InBandError as exc:
            raise AdapterError(
                FailureCode.UPSTREAM_ERROR, f"upstream returned an error: {exc}", retryable=True
            ) from None
        return RunResult(usage=reply.usage, response=shaped)

    async def _relay_native_stream(
        self,
        response: httpcore2.Response,
        reply: native.NativeReply,
        events: EmitEvents,
        progress: _Progress,
    ) -> RunResult:
        """Relay a native stream: what one upstream read completed leaves as one piece;
        the last events, when the run holds them back, leave with its end (`native`,
        Rule 6), or, when the stream breaks off, ahead of the failure, as they came."""
        try:
            result = await self._relay_native_events(response, reply, events, progress)
            if result is None:
                raise self._stream_cut(
                    progress, "upstream stream ended before its last event", reply_fault=True
                )
        except (*_CORE_ERRORS, SSEError, AdapterError):
            if held := reply.release():
                await events(held, 0)
            raise
        return result

    async def _relay_native_events(
        self,
        response: httpcore2.Response,
        reply: native.NativeReply,
        events: EmitEvents,
        progress: _Progress,
    ) -> RunResult | None:
        """`_relay_native_stream`'s loop; None when the body ended before the last event."""
        decoder = SSEDecoder()
        async with aclosing(_body_chunks(response)) as body:
            async for raw in body:
                framed: list[bytes] = []
                output = 0
                failure: str | None = None
                malformed = False
                for event in decoder.feed(raw):
                    progress.saw_first_byte()
                    data = event.data
                    if not data.strip() or data == _DONE:
                        continue
                    try:
                        shaped, tokens = reply.event(event.event, data)
                    except native.NotAnObject as exc:
                        failure, malformed = f"bad upstream output: {exc}", True
                        break
                    except native.InBandError as exc:
                        failure = f"upstream reported an error: {exc}"
                        break
                    if shaped:
                        framed.append(shaped)
                    output += tokens
                    if reply.ended:
                        break
                if framed:
                    await events(framed[0] if len(framed) == 1 else b"".join(framed), output)
                    progress.emitted += len(framed)
                if failure is not None:
                    # The events before the error went out; the failure names the error.
                    raise self._stream_cut(progress, failure, reply_fault=malformed)
                if reply.ended:
                    # Let the end of the chunked body arrive so the connection is reused.
                    with trio.move_on_after(_DRAIN_AFTER_DONE_S):
                        async for _ in body:
                            pass
                    return RunResult(
                        usage=reply.usage,
                        response=reply.final_response,
                        tail=reply.release() or None,
                    )
        return None

    async def _post_bounded(
        self, url: httpx2.URL | str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """One small JSON POST through the client (token counts: rare, not the hot path),
        within the whole-request deadline; transport failures as `AdapterError`s."""
        if self._closed:
            raise AdapterError(FailureCode.ADAPTER_CLOSED, "adapter was retired", retryable=True)
        timeout_s = self.provider.adapter.request_timeout_s
        with trio.move_on_after(timeout_s):
            try:
                response = await self._client.post(url, content=body, headers=headers)
            except httpx2.HTTPError as exc:
                raise self._unanswered(
                    exc,
                    unreachable=isinstance(exc, httpx2.ConnectError),
                    timed_out=isinstance(exc, httpx2.TimeoutException),
                ) from exc
            return response.status_code, response.content
        raise AdapterError(
            FailureCode.UPSTREAM_TIMEOUT,
            f"no answer from {self._origin} within {timeout_s:g}s",
            retryable=True,
        )

    def _inspect_chunk(self, data: bytes, event: str, progress: _Progress) -> ParsedChunk | None:
        """Read one chunk (once: the runner shapes and counts it from this reading), or
        raise if it is not JSON or reports an error.

        Returns None for valid JSON that is not an object: the runner refuses it."""
        try:
            parsed: ParsedChunk | None = read_chunk(data)
        except NotAnObject as exc:
            if exc.malformed:
                raise self._stream_cut(
                    progress, "upstream sent a chunk that is not JSON", reply_fault=True
                ) from None
            parsed = None
        if event == "error" or (parsed is not None and parsed.is_error):
            message = error_message(data) or "unknown error"
            raise self._stream_cut(progress, f"upstream reported an error: {message}")
        return parsed

    def _stream_cut(
        self, progress: _Progress, message: str, *, reply_fault: bool = False
    ) -> AdapterError:
        """A stream that cannot go on; `reply_fault` when what the upstream said is empty
        or malformed (`wire.RunFailed.reply_fault`), not an error it reported."""
        if progress.emitted:
            return AdapterError(
                FailureCode.UPSTREAM_STREAM_ERROR,
                f"{message} (after {progress.emitted} chunks)",
                reply_fault=reply_fault,
            )
        return AdapterError(
            FailureCode.UPSTREAM_ERROR, message, retryable=True, reply_fault=reply_fault
        )

    def _transport_failure(self, exc: Exception, progress: _Progress) -> AdapterError:
        """A run's transport (httpcore2) or event-stream failure, as the table says."""
        detail = describe_transport_error(exc)
        if progress.emitted:
            return AdapterError(
                FailureCode.UPSTREAM_STREAM_ERROR,
                f"upstream stream broke after {progress.emitted} chunks: {detail}",
            )
        return self._unanswered(
            exc,
            unreachable=isinstance(exc, httpcore2.ConnectError | httpcore2.ConnectTimeout),
            timed_out=isinstance(exc, httpcore2.TimeoutException),
        )

    def _unanswered(self, exc: Exception, *, unreachable: bool, timed_out: bool) -> AdapterError:
        """A request the upstream did not answer, nothing relayed yet: retryable, coded by
        what went wrong (`unreachable`, `timed_out`: as the client library that sent it
        classes the error)."""
        detail = describe_transport_error(exc)
        if unreachable:
            return AdapterError(
                FailureCode.UPSTREAM_UNREACHABLE,
                f"{self._origin} unreachable: {detail}",
                retryable=True,
            )
        code = FailureCode.UPSTREAM_TIMEOUT if timed_out else FailureCode.UPSTREAM_ERROR
        return AdapterError(code, f"{self._origin}: {detail}", retryable=True)


async def _error_body(response: httpcore2.Response, progress: _Progress) -> bytes:
    """The start of an error response's body, to find the upstream's message in. An
    encoded one cannot be read: the status alone has to do."""
    body = await _read_body(response, progress, limit=_ERROR_BODY_LIMIT)
    return b"" if _encoded(response) else body


def _caller_headers(run: Run, protocol: CallerProtocol) -> dict[str, str]:
    """The caller's protocol headers a native upstream sees (never one the adapter owns),
    with Anthropic's version header for a Messages request that came without one."""
    headers = {
        name: value
        for name, value in run.caller_headers.items()
        if name.lower() not in _OWN_HEADERS
    }
    if protocol == "messages" and not any(name.lower() == "anthropic-version" for name in headers):
        headers["anthropic-version"] = DEFAULT_ANTHROPIC_VERSION
    return headers


def _caller_header_pairs(run: Run, protocol: CallerProtocol) -> list[tuple[bytes, bytes]]:
    return [
        (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in _caller_headers(run, protocol).items()
    ]


def _core_url(url: httpx2.URL) -> httpcore2.URL:
    return httpcore2.URL(
        scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
    )


def _host_header(url: httpx2.URL) -> bytes:
    """The Host header httpx2 would send: the host (IPv6 in brackets), with the port unless
    it is the scheme's default."""
    return url.netloc


def _encoded(response: httpcore2.Response) -> bytes | None:
    """The response's content coding, when it has one other than `identity`."""
    for name, value in response.headers:
        if name.lower() == b"content-encoding":
            coding = value.strip().lower()
            if coding and coding != b"identity":
                return coding
    return None


def _check_encoding(response: httpcore2.Response) -> None:
    """Refuse a body the upstream encoded although we asked for `identity`: we relay bytes
    as they arrive and cannot read (or relay) a compressed stream."""
    coding = _encoded(response)
    if coding is not None:
        raise AdapterError(
            FailureCode.UPSTREAM_ERROR,
            f"upstream sent a {coding.decode('latin-1')}-encoded body "
            "despite Accept-Encoding: identity",
            retryable=True,
        )


def _body_chunks(response: httpcore2.Response) -> AsyncGenerator[bytes]:
    """The response body straight from the pool's stream (an async generator), one
    generator layer fewer per chunk than `response.aiter_stream()`."""
    return cast(AsyncGenerator[bytes], aiter(cast(AsyncIterable[bytes], response.stream)))


async def _read_body(
    response: httpcore2.Response, progress: _Progress, *, limit: int | None = None
) -> bytes:
    """Read a response body (up to `limit` bytes), marking the first byte as it arrives."""
    parts: list[bytes] = []
    size = 0
    async with aclosing(_body_chunks(response)) as body:
        async for raw in body:
            if not progress.first_byte:
                progress.saw_first_byte()
            parts.append(raw)
            size += len(raw)
            if limit is not None and size >= limit:
                break
    data = b"".join(parts)
    return data if limit is None else data[:limit]
