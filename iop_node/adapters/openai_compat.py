"""The adapter for upstreams that speak the OpenAI HTTP API (vllm, sglang, lemonade, openai_api).

The Edge already did everything caller-facing (auth, alias -> served name, validation), so
this adapter is a careful relay: the request body goes upstream byte for byte, a
non-stream response comes back byte for byte, and a stream is relayed one SSE event at a
time as each arrives, never re-encoded, so every provider-specific field (reasoning
content, tool calls, logprobs) passes through untouched. JSON is decoded only to peek at
`usage` and at in-band errors, through small msgspec views that skip everything else.

Caller protocols (design §14): a runtime that speaks Anthropic Messages or OpenAI
Responses itself gets such runs as they are (`execute_native`), at the protocol's path
under `base_url` (its `NativeForm`'s: `{base_url}/messages`, `{base_url}/responses`,
beside chat's `/chat/completions`), with the caller's protocol headers
(`anthropic-version`, `anthropic-beta`) and, for Messages, the API key as `x-api-key`
too. The reply comes back under the same deadlines and failure rules as chat's, shaped by
`native` (the caller's alias, usage read from the few events that carry it:
`upstream_http.native_exchange`). A 404 on the route itself (not about the model), or
a 405, is `NativeUnsupported`: the Node translates that run, and learns
(`protocol_support`). Token counts, rare and small, go through the client: Anthropic's
`/messages/count_tokens`, and the runtime's tokenizer endpoint at the server root
(`tokenizer`).

Deadlines (set here, once, from the provider's adapter settings):

- *first byte* (streams only): from the start of the request until the first whole
  event, `first_byte_timeout_s` when set, else `request_timeout_s`; a server that sends
  headers (or keep-alive comments) at once and then stalls in prefill is still caught by
  it. A non-stream response has no such deadline: engines send its first byte only when
  the whole generation is done, so a first-byte bound there would cut every long answer
  (and, being retryable, fail it over and cool healthy providers down).
- *whole request*: `request_timeout_s` from the start, whatever happens.

One cancel scope carries both: it starts with the first-byte deadline and is moved to the
whole-request deadline when the first body byte arrives. A run's request has no other
timeout than its connection's `connect_timeout_s`: a read or write timeout of the
client's (`request_timeout_s`) could only end after the whole-request deadline. The
runner's own scope (caller gone, Edge cancel) sits outside and simply propagates;
cancelling it closes the HTTP stream, which closes the upstream connection, which stops
the generation upstream.

Failures become `AdapterError`s (see `base.py`, worded by `upstream_http.failures`),
following one rule for `retryable`: a failure is retryable iff no chunk was emitted
yet. Before the first chunk:

    connect refused / DNS / connect timeout  upstream_unreachable  retryable
    no body byte within the first-byte budget upstream_timeout     retryable
    404/405 of a runtime without the completions or embeddings endpoint (not about
    the model)                                unsupported_operation retryable: the
                                                                   request's, not the
                                                                   provider's fault
    429, 503                                  upstream_busy        retryable, capacity;
                                                                   how long to rest the
                                                                   provider, when its
                                                                   Retry-After says
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
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Any, Final, TypeVar

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
from iop_node.adapters.upstream_errors import error_message, read_error_facts
from iop_node.adapters.upstream_http.context_window import ContextWindow
from iop_node.adapters.upstream_http.exchange import (
    CORE_ERRORS,
    DONE,
    ERROR_BODY_LIMIT,
    Progress,
    body_chunks,
    check_encoding,
    core_url,
    drain,
    error_body,
    host_header,
    whole_answer,
)
from iop_node.adapters.upstream_http.failures import (
    clip,
    describe_transport_error,
    missing_route,
    no_endpoint,
    status_failure,
    stream_cut,
)
from iop_node.adapters.upstream_http.native_exchange import (
    OWN_HEADERS,
    caller_header_pairs,
    relay_native_stream,
    shaped,
)
from iop_node.cache_timings import timings_cached
from iop_node.compat.httpx2 import connection_pool_for
from iop_node.protocol_support import ProtocolSupport
from iop_node.protocols.native import ANTHROPIC_VERSION, NativeForm
from iop_node.reply import NotAnObject, ParsedChunk, UsageView, read_chunk
from iop_node.tls import upstream_tls_context
from iop_node.tracing import UpstreamCall, upstream_call
from schemas.config import ProviderConfig
from schemas.tokens import input_text, template_tokens
from schemas.wire import FailureCode, Operation, ProviderStatus, Run, Usage

__all__ = ["COUNT_TOKENS_PATH", "OPERATION_PATHS", "OpenAICompatAdapter", "status_failure"]

log = logging.getLogger(__name__)

OPERATION_PATHS: Final[dict[Operation, str]] = {
    "chat": "/chat/completions",
    "completion": "/completions",
    "embedding": "/embeddings",
}
#: Anthropic's token count, beside its Messages endpoint (a runtime that speaks Messages
#: natively may have it).
COUNT_TOKENS_PATH: Final = "/messages/count_tokens"
#: uvicorn (under vLLM, SGLang, most Python servers) drops idle connections after 5 s;
#: forgetting ours a little earlier avoids sending a request on a connection being closed.
_KEEPALIVE_EXPIRY_S = 4.0

_T = TypeVar("_T")


# --- msgspec views: decode only the few fields we look at ----------------------------------


class _BodyView(msgspec.Struct):
    """A whole response, as far as the relay cares (a stream chunk is read by
    `reply.read_chunk`, once for the whole Node)."""

    usage: UsageView | None = None
    error: Any = None
    object: str | None = None
    timings: msgspec.Raw = msgspec.Raw()
    choices: msgspec.Raw = msgspec.Raw()
    data: msgspec.Raw = msgspec.Raw()

    def is_error(self) -> bool:
        return self.error is not None or self.object == "error"

    def answers(self) -> bool:
        """Whether it is an answer: a completion's `choices`, or embeddings' `data`."""
        return bool(self.choices) or bool(self.data)


class _TokenCount(msgspec.Struct):
    input_tokens: int


_body_decoder: Final = msgspec.json.Decoder(_BodyView)
_token_count_decoder: Final = msgspec.json.Decoder(_TokenCount)


class _ProbeFailure(Exception):
    """A health check found the upstream unusable; the message is the status detail."""


class _EmptyStream(Exception):
    """A stream answered 200 and ended with no event at all: how llama.cpp's server
    answers a streamed prompt longer than its context. `failure` is what it is when the
    prompt fits (a broken stream)."""

    def __init__(self, failure: AdapterError) -> None:
        super().__init__(failure.message)
        self.failure = failure


# --- the adapter ------------------------------------------------------------------------------


class OpenAICompatAdapter(NativeRelay):
    """Relay runs to an OpenAI-compatible HTTP upstream at `provider.adapter.base_url`."""

    def __init__(self, provider: ProviderConfig) -> None:
        self.provider = provider
        settings = provider.adapter
        base_url = settings.base_url
        if base_url is None:  # the Edge's config validation requires it for these types
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
        self._missing_key: str | None = None
        """Why the provider has no key when its config names one (unset, or empty)."""
        key: str | None = None
        if settings.api_key_env is not None:
            key = os.environ.get(settings.api_key_env)
            if key:
                headers["Authorization"] = f"Bearer {key}"
            else:
                how = "is not set" if key is None else "is empty"
                self._missing_key = f"environment variable {settings.api_key_env} {how}"
        self.protocol_support = ProtocolSupport(provider)
        self.root_url = base_url.rstrip("/").removesuffix("/v1")
        """The server root, where runtimes put what is not OpenAI's (tokenizers)."""
        self._tokenizer = TokenizerEndpoint()
        self._probe_sent = False

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
            verify=upstream_tls_context(),
        )
        self._context = ContextWindow(self._client, self.root_url)
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
            operation: core_url(httpx2.URL(self.base_url + path))
            for operation, path in OPERATION_PATHS.items()
        }
        fixed = [
            (b"Host", host_header(url)),
            (b"Connection", b"keep-alive"),
            # We relay bytes as they arrive, so we ask for them unencoded (httpx2 would
            # decode gzip for us; httpcore2 does not). See `check_encoding`.
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
        self._key = key
        self._native: dict[tuple[str, bool], tuple[httpcore2.URL, list[tuple[bytes, bytes]]]] = {}
        """Per native protocol and stream: its URL and fixed headers (`_native_request`)."""
        self._count_tokens_url = httpx2.URL(self.base_url + COUNT_TOKENS_PATH)
        self._count_tokens_headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            **({"x-api-key": key} if key else {}),
            "anthropic-version": ANTHROPIC_VERSION,
        }
        # A run's request is bounded by its connect timeout only: its reads, writes and
        # wait for a connection are within the run's deadlines (`_within_deadlines`), which
        # end before any of the client's ceilings would, so httpcore2 registers no
        # deadline per read and write (a cancel scope without one costs less).
        self._request_extensions: dict[str, object] = {
            "timeout": {"connect": settings.connect_timeout_s}
        }

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

        exchange = partial(self._exchange, run, url, emit)
        try:
            return await self._bounded(run, exchange, OPERATION_PATHS[run.operation])
        except _EmptyStream as empty:
            failure = empty.failure
            raise await self._context.overflow_or(
                run, failure, self.runtime_prompt_tokens
            ) from None

    async def execute_native(self, run: Run, native: NativeForm, events: EmitEvents) -> RunResult:
        if self._lifecycle.asleep:  # a vLLM in sleep mode wakes first
            await self._lifecycle.awake(self.provider.adapter.load_timeout_s)
        exchange = partial(self._exchange_native, run, native, events)
        return await self._bounded(run, exchange, native.path)

    async def count_tokens_native(self, run: Run) -> int | None:
        sent = {
            name: value
            for name, value in run.caller_headers.items()
            if name.lower() not in OWN_HEADERS
        }
        headers = {**self._count_tokens_headers, **sent}
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
                    clip(error_message(answer) or ""),
                )
                return None
        return None

    async def runtime_prompt_tokens(self, model: str, body: dict[str, Any]) -> int | None:
        """The prompt tokens of a request `body` by the runtime's own tokenizer: its count
        of the text plus the chat template's share (`schemas.tokens`); None when the
        runtime has no tokenizer endpoint (or it failed). The caller bounds the wait."""
        counted = await self.tokenize_count(model, input_text(body))
        return None if counted is None else counted + template_tokens(body)

    def _bounded(
        self, run: Run, exchange: Callable[[Progress], Awaitable[RunResult]], path: str
    ) -> Awaitable[RunResult]:
        """Run one exchange to `path` under the adapter's deadlines, in its own span when
        the run is traced (`iop_node.tracing`). An untraced one adds no frame to the
        run's await chain (each frame is passed on every resumption of the run), nor
        does the exchange (`partial`, no closure)."""
        call = upstream_call(self.base_url, path)
        if call is None:
            return self._within_deadlines(run, exchange, None)
        return self._traced(run, exchange, call)

    async def _traced(
        self, run: Run, exchange: Callable[[Progress], Awaitable[RunResult]], call: UpstreamCall
    ) -> RunResult:
        """`_within_deadlines` in the upstream call's span."""
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
        exchange: Callable[[Progress], Awaitable[RunResult]],
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
            progress = Progress(scope=scope, request_deadline=start + request_timeout_s, call=call)
            try:
                return await exchange(progress)
            except (*CORE_ERRORS, SSEError) as exc:
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
        if self._missing_key is not None:
            return self._unavailable(self._missing_key)
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
            detail = error_message(response.content[:ERROR_BODY_LIMIT])
            suffix = f": {detail}" if detail else ""
            raise _ProbeFailure(f"GET {name} returned {response.status_code}{suffix}")
        try:
            return decoder.decode(response.content)
        except msgspec.DecodeError as exc:
            raise _ProbeFailure(f"GET {name} returned an unexpected body: {exc}") from None

    def _unavailable(self, detail: str) -> ProviderStatus:
        return ProviderStatus(id=self.provider.id, health="unavailable", detail=clip(detail))

    # --- one request ----------------------------------------------------------------------

    async def _exchange(
        self, run: Run, url: httpcore2.URL, emit: Emit, progress: Progress
    ) -> RunResult:
        request = self._post(
            url, [*self._run_headers[run.stream], *progress.trace_headers(run)], run.body
        )
        connection, response = await self._send(request, progress)
        try:
            if not 200 <= response.status < 300:
                body = await error_body(response, progress)
                if run.operation != "chat" and missing_route(response.status, body, run.target):
                    raise no_endpoint(OPERATION_PATHS[run.operation], response.status)
                self._context.learn(read_error_facts(body).context_tokens)
                raise status_failure(response.status, body, run.operation, headers=response.headers)
            check_encoding(response)
            if run.stream:
                return await self._relay_stream(response, emit, progress)
            body = await whole_answer(response, progress)
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
        if not view.answers():
            raise AdapterError(
                FailureCode.UPSTREAM_ERROR,
                "upstream returned a body with no answer in it (no choices, no data)",
                retryable=True,
                reply_fault=True,
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
        self, request: httpcore2.Request, progress: Progress
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
        self, response: httpcore2.Response, emit: Emit, progress: Progress
    ) -> RunResult:
        decoder = SSEDecoder()
        usage: Usage | None = None
        finished = False
        done = False
        async with aclosing(body_chunks(response)) as body:
            async for raw in body:
                for event in decoder.feed(raw):
                    progress.saw_first_byte()
                    data = event.data
                    if data == DONE:
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
                await drain(body)  # so the connection is reused
                return RunResult(usage=usage)
        # The body ended without `[DONE]`: fine if the model had finished, else truncated.
        if finished:
            return RunResult(usage=usage)
        failure = stream_cut(
            progress.emitted, "upstream stream ended before [DONE]", reply_fault=True
        )
        if not progress.first_byte:
            raise _EmptyStream(failure)
        raise failure

    async def _exchange_native(
        self, run: Run, form: NativeForm, events: EmitEvents, progress: Progress
    ) -> RunResult:
        """A run of a caller protocol sent as it is (`native` has the rules of what
        comes back)."""
        url, fixed = self._native_request(form, run.stream)
        headers = [*fixed, *caller_header_pairs(run, form), *progress.trace_headers(run)]
        request = self._post(url, headers, run.body)
        reply = native.NativeReply(run, form)
        connection, response = await self._send(request, progress)
        try:
            if not 200 <= response.status < 300:
                body = await error_body(response, progress)
                failure = status_failure(response.status, body, headers=response.headers)
                if missing_route(response.status, body, run.target):
                    raise NativeUnsupported(form.name, failure)
                raise failure
            check_encoding(response)
            if run.stream:
                return await relay_native_stream(response, reply, events, progress)
            body = await whole_answer(response, progress)
        finally:
            await self._close(connection, response)
        return shaped(reply, body)

    def _native_request(
        self, form: NativeForm, stream: bool
    ) -> tuple[httpcore2.URL, list[tuple[bytes, bytes]]]:
        """A native protocol's URL under `base_url` and its fixed headers (the key in
        `form.key_header` too, where the protocol's clients send it), made once."""
        known = self._native.get((form.name, stream))
        if known is None:
            key = (
                []
                if form.key_header is None or not self._key
                else [(form.key_header.encode(), self._key.encode())]
            )
            url = core_url(httpx2.URL(self.base_url + form.path))
            known = self._native[form.name, stream] = (url, [*self._run_headers[stream], *key])
        return known

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

    def _inspect_chunk(self, data: bytes, event: str, progress: Progress) -> ParsedChunk | None:
        """Read one chunk (once: the runner shapes and counts it from this reading), or
        raise if it is not JSON or reports an error.

        Returns None for valid JSON that is not an object: the runner refuses it."""
        try:
            parsed: ParsedChunk | None = read_chunk(data)
        except NotAnObject as exc:
            if exc.malformed:
                raise stream_cut(
                    progress.emitted, "upstream sent a chunk that is not JSON", reply_fault=True
                ) from None
            parsed = None
        if event == "error" or (parsed is not None and parsed.is_error):
            message = error_message(data) or "unknown error"
            raise stream_cut(progress.emitted, f"upstream reported an error: {message}")
        return parsed

    def _transport_failure(self, exc: Exception, progress: Progress) -> AdapterError:
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
