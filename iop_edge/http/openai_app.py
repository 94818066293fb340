"""The caller-facing HTTP API (OpenAI's, and Anthropic's Messages), served by Hypercorn.

`OpenAIApp` is the ASGI app: the run endpoints (each caller protocol's `paths`, found in
`protocol_registry`: chat completions, completions, embeddings, Messages, count_tokens,
Responses and its compaction) are plain
ASGI in `runs`, because they carry the traffic and a web framework's per-request cost
would outweigh the Edge's own work per run (see there). Everything else (`/v1/models`,
stored responses, `/`, `/healthz`, 404/405/413 pages and the ASGI lifespan) is a small
Quart-Trio app. The Responses WebSocket mode (an upgrade on `/v1/responses`) is
`responses_socket`'s.
Every response carries `x-request-id` and `Server-Timing`. Every error, and the model
list, has the shape of the caller protocol whose client sent the request
(`Protocols.of_request`): OpenAI's, except for Anthropic's clients (a request with
`anthropic-version`, or on a `/v1/messages` path), which get Anthropic's (the model list
paged as Anthropic pages it, `messages.model_page`).

Anthropic's clients check the server first: Claude Code sends `HEAD /`, so `/` answers
200.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import msgspec
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope, Scope
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from iop_edge.core.routing.readiness import Readiness
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.auth import authenticate_headers
from iop_edge.http.errors import ApiError, method_not_allowed, model_not_found
from iop_edge.http.final_send import shield_final_send
from iop_edge.http.protocols.caller_protocol import CallerProtocol
from iop_edge.http.protocols.protocol_registry import PROTOCOLS
from iop_edge.http.protocols.responses import ResponsesSurface
from iop_edge.http.request_body import decode_body
from iop_edge.http.request_ids import new_run_id, request_id
from iop_edge.http.responses_socket import ResponsesSocket
from iop_edge.http.runs import RunEndpoints

log = logging.getLogger(__name__)

_encode_json = msgspec.json.Encoder().encode
_ID_KEY = "iop.request_id"
_STARTED_KEY = "iop.started"


class _InputTokens(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /v1/responses/input_tokens`' answer."""

    object: str = "response.input_tokens"
    input_tokens: int


class _Deleted(msgspec.Struct, frozen=True, kw_only=True):
    """`DELETE /v1/responses/{id}`'s answer."""

    id: str
    object: str = "response"
    deleted: bool = True


class OpenAIApp:
    """The caller API's ASGI app: run endpoints as plain ASGI, the rest on Quart."""

    def __init__(
        self,
        runs: RunEndpoints,
        *,
        snapshot: Callable[[], Snapshot],
        started_unix: int,
        readiness: Callable[[], Readiness],
        responses: ResponsesSurface,
    ) -> None:
        self._runs = runs
        self._socket = ResponsesSocket(runs)
        self._quart = _create_quart_app(snapshot, started_unix, readiness, responses)

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http":
            if scope["path"][:1] != "/":  # absolute-form (`POST http://host/v1/...`)
                _to_origin_form(scope)
            route = PROTOCOLS.route(scope["path"])
            if route is not None:
                await self._runs(route, scope, receive, send)
                return
            send = shield_final_send(send)  # Quart would cancel a closing connection's close
        elif scope["type"] == "websocket":  # only `/v1/responses` comes here (`server`)
            await self._socket(scope, receive, send)
            return
        await self._quart(scope, receive, send)


def _to_origin_form(scope: HTTPScope) -> None:
    """A request target in absolute form (RFC 9112 §3.2.2, which a server must accept:
    a client speaking to a proxy sends it) routed by its path, as Quart's routes do."""
    scope["path"] = _path_of(scope["path"])
    scope["raw_path"] = _path_of(scope["raw_path"].decode("latin-1")).encode("latin-1")


def _path_of(target: str) -> str:
    """`scheme://authority/path` -> `/path` (`/` when it has none)."""
    authority = target.find("//")
    if authority < 0:
        return target
    path = target.find("/", authority + 2)
    return target[path:] if path >= 0 else "/"


def _request_state() -> dict[str, Any]:
    """The ASGI scope as a plain dict: where per-request state is kept."""
    return cast(dict[str, Any], request.scope)


def _json_response(
    body: bytes, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(body, status=status, headers=headers, content_type="application/json")


def _create_quart_app(
    snapshot: Callable[[], Snapshot],
    started_unix: int,
    readiness: Callable[[], Readiness],
    responses: ResponsesSurface,
) -> QuartTrio:
    app = QuartTrio("iop_edge.http.openai_app")
    app.config.update(
        RESPONSE_TIMEOUT=None,
        MAX_CONTENT_LENGTH=snapshot().config.openai.max_request_bytes,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )

    def current_request_id() -> str:
        """The caller's `x-request-id` when it is sane, else ours; kept for error replies."""
        state = _request_state()
        rid = state.get(_ID_KEY)
        if rid is None:
            rid = state[_ID_KEY] = request_id(request.headers.get("x-request-id"), new_run_id())
        return str(rid)

    def check_caller() -> str:
        """The caller's principal_ref (401 without a known token)."""
        current = snapshot()
        return authenticate_headers(
            current.principals, request.headers, listen=current.config.openai.listen
        ).principal_ref

    @app.before_request
    async def start_clock() -> None:
        _request_state()[_STARTED_KEY] = time.perf_counter()

    @app.after_request
    async def stamp(response: Response) -> Response:
        """Every response carries `x-request-id` and `Server-Timing`, as the run endpoints'
        do (theirs also split out queue and upstream time)."""
        if "x-request-id" not in response.headers:
            response.headers["x-request-id"] = current_request_id()
        if "Server-Timing" not in response.headers:
            started = _request_state().get(_STARTED_KEY, time.perf_counter())
            response.headers["Server-Timing"] = (
                f"edge;dur={(time.perf_counter() - started) * 1000:.2f}"
            )
        return response

    def caller_protocol() -> CallerProtocol:
        """The protocol whose shapes this request gets (its client's)."""
        names = {name.lower() for name, _ in request.headers.items()}
        return PROTOCOLS.of_request(request.path, names)

    @app.get("/v1/models")
    async def list_models() -> Response:
        principal_ref = check_caller()
        current = snapshot()
        allowed = {
            model_id: entry
            for model_id, entry in current.models.items()
            if current.policies.allows(principal_ref, model_id)  # only what it may use
        }
        return _json_response(caller_protocol().model_list(allowed, started_unix, request.args))

    @app.get("/v1/models/<path:model_id>")
    async def get_model(model_id: str) -> Response:
        principal_ref = check_caller()
        current = snapshot()
        if model_id not in current.models or not current.policies.allows(principal_ref, model_id):
            raise model_not_found(model_id)
        return _json_response(caller_protocol().model(current.models[model_id], started_unix))

    @app.post("/v1/responses/input_tokens")
    async def responses_input_tokens() -> Response:
        """The input tokens a Responses request would take (OpenAI's
        `responses.input_tokens.count`), by the Edge's estimate (`ResponsesSurface`)."""
        principal_ref = check_caller()
        body = await request.get_data(cache=False, as_text=False)
        if isinstance(body, str):  # not with as_text=False; the stubs cannot say so
            body = body.encode()
        count = await responses.input_tokens(decode_body(body), snapshot(), principal_ref)
        return _json_response(_encode_json(_InputTokens(input_tokens=count)))

    def not_an_action(method: str, response_id: str) -> None:
        """`/v1/responses/input_tokens` names an action, not a stored response: another
        method than its POST is a 405 there, as on the run paths."""
        if response_id == "input_tokens":
            path = "/v1/responses/input_tokens"
            raise method_not_allowed(method, path, allow="POST")

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str) -> Response:
        """A stored response (design §14): the caller's own only."""
        not_an_action("GET", response_id)
        principal_ref = check_caller()
        return _json_response(await responses.read(principal_ref, response_id))

    @app.get("/v1/responses/<response_id>/input_items")
    async def response_input_items(response_id: str) -> Response:
        """The items a stored response was generated from, a page at a time."""
        principal_ref = check_caller()
        query = {key: request.args[key] for key in request.args}
        return _json_response(await responses.input_items(principal_ref, response_id, query))

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        not_an_action("DELETE", response_id)
        principal_ref = check_caller()
        await responses.delete(principal_ref, response_id)
        return _json_response(_encode_json(_Deleted(id=response_id)))

    @app.route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        """The server answers (Claude Code sends `HEAD /` before anything else). Callers
        need no token here, as for `/healthz`."""
        return _json_response(b'{"service":"iop-edge","status":"ok"}')

    @app.get("/healthz")
    async def healthz() -> Response:
        """Liveness: the process answers."""
        return _json_response(b'{"status":"ok"}')

    @app.get("/readyz")
    async def readyz() -> Response:
        """Readiness (design §12): 200 only when some model could be served now. Callers
        need no token here (a load balancer asks), so it names no model."""
        state = readiness()
        if state.ready:
            return _json_response(b'{"status":"ready"}')
        return _json_response(
            msgspec.json.encode({"status": "not_ready", "reason": state.reason}), 503
        )

    @app.errorhandler(ApiError)
    async def on_api_error(error: ApiError) -> Response:
        headers = error.headers()
        headers.setdefault("x-request-id", current_request_id())
        body = caller_protocol().error_body(error, headers["x-request-id"])
        return _json_response(body, error.status, headers)

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
            allowed = getattr(error, "valid_methods", None)
            api = method_not_allowed(
                request.method, request.path, ", ".join(sorted(allowed)) if allowed else None
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
