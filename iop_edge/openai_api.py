"""The caller-facing OpenAI-compatible HTTP API (Quart-Trio on Hypercorn).

A request is decoded once into a dict (provider-specific fields pass through untouched),
checked against a small view of the fields the Edge acts on, admitted by the scheduler
and run on a Node. Every response carries `x-request-id` and a `Server-Timing` header
with the Edge's share of the latency.

Ownership of a run: the handler starts it; for a stream, the response body continues it.
Quart may be cancelled (caller gone) between the two, before the body is ever iterated,
so an ASGI middleware owns a per-request list of run finalizers and runs them when the
request ends: whatever run is still open is closed, and metered as the caller's leaving.
`ActiveRun.close()` is idempotent, so the slot is released exactly once whichever path
gets there first.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, cast

import msgspec
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from iop_edge.dispatch import ActiveRun, BadPayload, RunFailure, RunPlan, relabel
from iop_edge.errors import ApiError, bad_request, model_not_found
from iop_edge.hub import RunEvent
from iop_edge.tokens import hash_token
from iop_edge.usage import UsageRecord
from schemas import openai as oai
from schemas import wire
from schemas.config import PrincipalToken
from schemas.tokens import estimate_input_tokens

if TYPE_CHECKING:
    from iop_edge.edge import Edge

log = logging.getLogger(__name__)

_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_FINALIZERS_KEY = "iop.run_finalizers"
_ID_KEY = "iop.request_id"
_STARTED_KEY = "iop.started"
_SSE_DONE = b"data: [DONE]\n\n"
#: Who a request is when the Edge has no principal tokens configured (open API).
ANONYMOUS = PrincipalToken(
    token_ref="anonymous", token_hash_sha256="0" * 64, principal_ref="anonymous"
)

_VIEWS: dict[wire.Operation, type[oai.RequestView]] = {
    "chat": oai.ChatRequest,
    "completion": oai.CompletionRequest,
    "embedding": oai.EmbeddingRequest,
}


def new_run_id() -> str:
    return f"req_{secrets.token_hex(12)}"


def _request_state() -> dict[str, Any]:
    """The ASGI scope as a plain dict: where the guard middleware keeps per-request state."""
    return cast(dict[str, Any], request.scope)


def _param_of(error: msgspec.ValidationError) -> str | None:
    match = re.search(r"at `\$\.([^`]*)`", str(error))
    return match.group(1) if match else None


def _json_response(
    body: bytes, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(body, status=status, headers=headers, content_type="application/json")


class _Timing:
    """Server-Timing: queue wait, upstream (node + provider) and the Edge's own share."""

    __slots__ = ("queued_s", "started", "upstream_s")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.queued_s = 0.0
        self.upstream_s = 0.0

    def header(self) -> str:
        total = time.perf_counter() - self.started
        edge = max(0.0, total - self.queued_s - self.upstream_s)
        return (
            f"queue;dur={self.queued_s * 1000:.2f}, upstream;dur={self.upstream_s * 1000:.2f}, "
            f"edge;dur={edge * 1000:.2f}"
        )


def _failed(run_id: str, code: str, message: str) -> wire.RunFailed:
    """A failure the Edge itself diagnosed in what a Node sent."""
    return wire.RunFailed(run_id=run_id, code=code, message=message)


def create_openai_app(edge: Edge) -> QuartTrio:
    app = QuartTrio("iop_edge.openai_api")
    app.config.update(
        RESPONSE_TIMEOUT=None,
        BODY_TIMEOUT=60,
        MAX_CONTENT_LENGTH=edge.snapshot.config.openai.max_request_bytes,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )

    inner = app.asgi_app

    async def guarded_asgi_app(scope: Any, receive: Any, send: Any) -> None:
        """Close any run a request left behind, whatever ended the request."""
        finalizers: list[Callable[[], None]] = []
        scope[_FINALIZERS_KEY] = finalizers
        try:
            await inner(scope, receive, send)
        finally:
            for finalize in finalizers:
                finalize()

    app.asgi_app = guarded_asgi_app  # type: ignore[method-assign]

    def request_id(run_id: str | None = None) -> str:
        """The caller's `x-request-id` when it is sane, else ours; kept for error replies."""
        state = _request_state()
        rid = state.get(_ID_KEY)
        if rid is None:
            supplied = request.headers.get("x-request-id")
            rid = supplied if supplied and _REQUEST_ID.match(supplied) else run_id or new_run_id()
            state[_ID_KEY] = rid
        return str(rid)

    def authenticate() -> PrincipalToken:
        principals = edge.snapshot.principals
        if not principals:
            return ANONYMOUS
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(
                401,
                "Missing bearer token in the Authorization header",
                type="authentication_error",
                code="invalid_api_key",
            )
        principal = principals.get(hash_token(token))
        if principal is None:
            raise ApiError(
                401,
                "Incorrect API key provided",
                type="authentication_error",
                code="invalid_api_key",
            )
        return principal

    async def read_body() -> dict[str, Any]:
        limit = edge.snapshot.config.openai.max_request_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise ApiError(
                413,
                f"Request body of {length} bytes exceeds the limit of {limit} bytes",
                code="request_too_large",
            )
        raw = await request.get_data(cache=False)
        assert isinstance(raw, bytes)
        if len(raw) > limit:
            raise ApiError(
                413, f"Request body exceeds the limit of {limit} bytes", code="request_too_large"
            )
        try:
            body = _decode_json(raw)
        except msgspec.DecodeError as exc:
            raise bad_request(
                f"Could not parse the JSON body: {exc}", code="invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object", code="invalid_json")
        return body

    async def handle(operation: wire.Operation) -> Response:
        timing = _Timing()
        run_id = new_run_id()
        rid = request_id(run_id)
        try:
            plan = await prepare(operation, run_id)
        except ApiError as exc:
            edge.metrics.observe_refusal(status=exc.status, code=exc.code or "")
            raise
        return await run_plan(plan, rid, timing)

    async def prepare(operation: wire.Operation, run_id: str) -> RunPlan:
        """Authenticate, read and check the request; the plan the dispatcher runs."""
        principal = authenticate()
        body = await read_body()
        try:
            view = msgspec.convert(body, _VIEWS[operation])
        except msgspec.ValidationError as exc:
            raise bad_request(f"Invalid request: {exc}", param=_param_of(exc)) from None
        snapshot = edge.snapshot
        model = snapshot.models.get(view.model)
        if model is None:
            raise model_not_found(view.model)
        stream = view.stream and operation != "embedding"
        caller_wants_usage = False
        if operation != "embedding":
            for key, value in model.generation.defaults.items():
                body.setdefault(key, value)
            limit = model.generation.max_tokens_limit
            for key in ("max_tokens", "max_completion_tokens"):
                requested = body.get(key)
                if limit is not None and isinstance(requested, int) and requested > limit:
                    raise bad_request(
                        f"{key}={requested} exceeds this model's limit of {limit}",
                        param=key,
                        code="max_tokens_exceeded",
                    )
            if stream:
                options = body.get("stream_options")
                caller_wants_usage = (
                    isinstance(options, dict) and options.get("include_usage") is True
                )
                body["stream_options"] = {**(options or {}), "include_usage": True}
        plan = RunPlan(
            run_id=run_id,
            model_id=view.model,
            operation=operation,
            body=body,
            stream=stream,
            long=estimate_input_tokens(body) >= snapshot.long_context_threshold_tokens,
            caller_wants_usage=caller_wants_usage,
            principal_ref=principal.principal_ref,
            token_ref=principal.token_ref,
            principal_alias=principal.alias,
        )
        return plan

    def observe(
        plan: RunPlan,
        provider: str,
        status: int,
        timing: _Timing,
        run: ActiveRun | None = None,
        *,
        code: str | None = None,
    ) -> None:
        """Meter a finished request: Prometheus always, the usage ledger when a run happened."""
        latency_s = time.perf_counter() - plan.received_at
        ttft_s = None
        if run is not None and run.timings.first_event_at is not None:
            ttft_s = run.timings.first_event_at - plan.received_at
        usage = run.usage if run is not None else None
        if run is not None:
            run.metered = True
        edge.metrics.observe_request(
            model=plan.model_id,
            provider=provider,
            status=status,
            code=code or "",
            latency_s=latency_s,
            ttft_s=ttft_s,
            queued_s=timing.queued_s if provider else None,
            usage=usage,
            principal_ref=plan.principal_ref,
            token_ref=plan.token_ref,
        )
        if run is None and not provider:
            return  # refused at admission: no run, nothing to bill
        edge.usage.record(
            UsageRecord(
                time=time.time(),
                run_id=plan.run_id,
                principal_ref=plan.principal_ref,
                token_ref=plan.token_ref,
                alias=plan.principal_alias,
                model=plan.model_id,
                provider=provider,
                node=run.lease.node_id if run is not None else "",
                prompt_tokens=usage.prompt_tokens if usage else 0,
                completion_tokens=usage.completion_tokens if usage else 0,
                status=status,
                latency_ms=latency_s * 1000,
                ttft_ms=None if ttft_s is None else ttft_s * 1000,
            )
        )

    async def run_plan(plan: RunPlan, rid: str, timing: _Timing) -> Response:
        try:
            active = await edge.dispatcher.start(plan, edge.snapshot)
        except ApiError as exc:
            observe(plan, "", exc.status, timing, code=exc.code)
            raise
        except RunFailure as exc:
            error = exc.api_error()
            observe(plan, exc.provider_id, error.status, timing, code=error.code)
            raise error from None

        def finalize() -> None:
            """The request ended before its response finished the run (caller gone)."""
            if not active.metered:
                active.close()
                observe(plan, active.provider_id, 499, timing, active, code="client_closed")

        _request_state()[_FINALIZERS_KEY].append(finalize)
        timing.queued_s = active.timings.queued_s
        timing.upstream_s = active.timings.dispatch_s
        headers = {"x-request-id": rid, "x-iop-provider": active.provider_id}
        if plan.stream:
            headers["Server-Timing"] = timing.header()
            headers["Cache-Control"] = "no-cache"
            return Response(
                sse_body(active, plan, timing),
                status=200,
                headers=headers,
                content_type="text/event-stream",
            )
        status = 499  # until the run ends, leaving early means the caller went away
        code: str | None = "client_closed"
        try:
            while True:
                event = await active.next_event()
                if isinstance(event, wire.RunChunk):
                    continue  # a non-stream run carries no chunks; ignore strays
                if isinstance(event, wire.RunFailed):
                    active.finished(event)
                    error = RunFailure(event, active.provider_id).api_error()
                    status, code = error.status, error.code
                    raise error
                try:
                    if event.response is None:
                        raise BadPayload("no response body")
                    payload = relabel(event.response, plan.model_id, strip_usage=False)
                except BadPayload as exc:
                    status, code = 502, "bad_response"
                    active.finished(_failed(event.run_id, code, str(exc)))
                    raise ApiError(
                        502,
                        f"provider '{active.provider_id}' returned a bad response: {exc}",
                        type="api_error",
                        code=code,
                    ) from None
                active.finished(event)
                status, code = 200, None
                headers["Server-Timing"] = timing.header()
                return _json_response(payload or b"{}", headers=headers)
        finally:
            active.close()
            observe(plan, active.provider_id, status, timing, active, code=code)

    async def sse_body(active: ActiveRun, plan: RunPlan, timing: _Timing) -> AsyncIterator[bytes]:
        """Relay the run as SSE. The slot is released and the run metered *before* the
        final frames go out, so a caller that saw `[DONE]` can count on both."""
        strip_usage = not plan.caller_wants_usage
        # A caller that leaves mid-stream is closed and metered by the request's finalizer.
        diagnosed = False  # the Edge itself ended the run (a bad chunk)
        event: RunEvent | None = await active.next_event()
        while True:
            # Chunks that are already here go out in one write: when the caller's
            # side is slower than the provider, the per-chunk cost stays flat.
            frames = []
            while isinstance(event, wire.RunChunk):
                try:
                    payload = relabel(event.data, plan.model_id, strip_usage=strip_usage)
                except BadPayload as exc:
                    # End the stream properly; the run may still be live on the Node,
                    # and close() below cancels it there.
                    event = _failed(event.run_id, "bad_chunk", f"bad chunk: {exc}")
                    diagnosed = True
                    break
                if payload is not None:
                    frames.append(b"data: " + payload + b"\n\n")
                event = active.next_event_nowait()
            if frames:
                yield b"".join(frames)
            if event is None:
                event = await active.next_event()
                continue
            active.finished(event, on_node=not diagnosed)
            tail = [_SSE_DONE]
            status, code = 200, None
            if isinstance(event, wire.RunFailed):
                error = RunFailure(event, active.provider_id).api_error()
                status, code = error.status, error.code
                tail.insert(0, b"data: " + error.body() + b"\n\n")
            active.close()
            observe(plan, active.provider_id, status, timing, active, code=code)
            for frame in tail:
                yield frame
            return

    @app.before_request
    async def start_clock() -> None:
        _request_state()[_STARTED_KEY] = time.perf_counter()

    @app.after_request
    async def stamp(response: Response) -> Response:
        """Every response carries `x-request-id` and `Server-Timing` (runs set richer ones)."""
        if "x-request-id" not in response.headers:
            response.headers["x-request-id"] = request_id()
        if "Server-Timing" not in response.headers:
            started = _request_state().get(_STARTED_KEY, time.perf_counter())
            response.headers["Server-Timing"] = (
                f"edge;dur={(time.perf_counter() - started) * 1000:.2f}"
            )
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await handle("chat")

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await handle("completion")

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        return await handle("embedding")

    def model_card(model_id: str) -> oai.ModelCard:
        entry = edge.snapshot.models[model_id]
        return oai.ModelCard(
            id=entry.id, display_name=entry.display_name, created=edge.started_unix
        )

    @app.get("/v1/models")
    async def list_models() -> Response:
        authenticate()
        cards = [model_card(model_id) for model_id in edge.snapshot.models]
        return _json_response(_encode_json(oai.ModelList(data=cards)))

    @app.get("/v1/models/<path:model_id>")
    async def get_model(model_id: str) -> Response:
        authenticate()
        if model_id not in edge.snapshot.models:
            raise model_not_found(model_id)
        return _json_response(_encode_json(model_card(model_id)))

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json_response(b'{"status":"ok"}')

    @app.errorhandler(ApiError)
    async def on_api_error(error: ApiError) -> Response:
        headers = error.headers()
        headers.setdefault("x-request-id", request_id())
        return _json_response(error.body(), error.status, headers)

    @app.errorhandler(HTTPException)
    async def on_http_error(error: HTTPException) -> Response:
        status = error.code or 500
        if status == 413:
            api = ApiError(413, "Request body too large", code="request_too_large")
        elif status == 404:
            api = ApiError(
                404, f"Unknown path {request.path}", type="not_found_error", code="unknown_url"
            )
        elif status == 405:
            api = ApiError(
                405,
                f"Method {request.method} not allowed on {request.path}",
                code="method_not_allowed",
            )
        else:
            api = ApiError(status, error.description or error.name, type="invalid_request_error")
        return await on_api_error(api)

    @app.errorhandler(Exception)
    async def on_unexpected(error: Exception) -> Response:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return await on_api_error(
            ApiError(500, "Internal error in the IOP Edge", type="api_error", code="internal_error")
        )

    return app
