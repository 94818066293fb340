"""The loopback-only admin API: health, status, catalog, metrics, config refresh, restart,
and the live pool page.

design §5.1: the listener itself must be a loopback address (checked at startup), every
request with a `Host` that is not a loopback name is refused (DNS rebinding), and a
browser page cannot drive it (CSRF). The one thing a browser may do is *read* the pool
page: the rules, checked before every request (`browser_request_reason`):

1. `Host` must be a loopback name, whoever asks.
2. A request with neither `Origin` nor any `Sec-Fetch-*` header is not from a browser
   page (curl, the CLI): the API answers it as always.
3. A browser request may only GET the page, its assets and the read-only documents the
   page polls (`BROWSER_READABLE`); every mutation (POST /refresh) and every other
   document (/usage, /metrics) is refused.
4. Such a GET must come from the page itself: an `Origin`, if sent, is this listener's
   own (`http://` + Host), and `Sec-Fetch-Site` is `same-origin`. Only a top-level
   navigation to the page (`/`, `Sec-Fetch-Dest: document`) may come from elsewhere (a
   bookmark, a link): it returns static HTML, and the page may not be framed.

Mutations are POST only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Final, Protocol

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestTimeout

from iop_edge.core.catalog_query import CatalogQuery, CatalogQueryError
from iop_edge.core.listen import is_loopback_host_header
from iop_edge.core.readiness import NO_SERVABLE_MODEL, Readiness
from iop_edge.http.admin_models import ModelCommandRunner, add_model_routes
from iop_edge.http.catalog_stream import CatalogSource, catalog_chunks, catalog_summary
from iop_edge.runtime.metering.activity import ActivityReport
from iop_edge.runtime.metering.usage_store import LedgerUnavailable, UsageReport
from iop_edge.runtime.refresh.refresh import RefreshResult, decode_request
from schemas.principals import PrincipalsReport
from schemas.refresh import RefreshRequest, RefreshVerdict, StatusReport
from schemas.restart import RestartOutcome, RestartReport

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
_MAX_REFRESH_BODY = 16 * 1024 * 1024


#: A larger answer (a fleet's refresh report: megabytes) is sent this much at a time.
#: Whole, it would be copied on the event loop by Quart and again by h11, steps of
#: milliseconds each, and of tens in memory the process has not used yet.
_ANSWER_PIECE: Final = 64 * 1024


def _json(payload: object, status: int = 200) -> Response:
    return _json_answer(_encode(payload), status)


def _json_answer(body: bytes, status: int = 200) -> Response:
    """`body`, JSON, as the answer: past `_ANSWER_PIECE`, sent in pieces of that size."""
    if len(body) <= _ANSWER_PIECE:
        return Response(body, status=status, content_type="application/json")
    response = Response(_in_pieces(body), status=status, content_type="application/json")
    response.content_length = len(body)
    return response


async def _in_pieces(body: bytes) -> AsyncIterator[bytes]:
    view = memoryview(body)
    for start in range(0, len(view), _ANSWER_PIECE):
        yield bytes(view[start : start + _ANSWER_PIECE])


def _error(status: int, message: str) -> Response:
    return _json({"error": {"message": message, "status": status}}, status)


async def _body_pieces() -> list[bytes]:
    """The current request's body in the pieces it arrived in, within the request's body
    timeout (`RequestTimeout` past it, as Quart's `get_data`). A fleet's refresh
    candidate is megabytes: gathered here into one growing buffer, then copied out, it
    would cost the event loop a few steps of 10 ms or more each; its pieces are joined
    by `decode_request`, off the loop."""
    timeout = math.inf if request.body_timeout is None else request.body_timeout
    with trio.move_on_after(timeout) as waited:
        return [piece async for piece in request.body]
    assert waited.cancelled_caught
    raise RequestTimeout()


DEFAULT_GROUP_BY = "principal_ref,token_ref,model"
#: `Retry-After` of a `/usage` the ledger's database cannot answer now.
USAGE_RETRY_AFTER_S: Final = 5


def parse_time(value: str | None) -> float | None:
    """Unix seconds or an ISO 8601 timestamp (naive = UTC)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise ValueError(f"'{value}' is not a point in time")
        return seconds
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"'{value}' is neither unix seconds nor an ISO 8601 time") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


#: Groups one `GET /usage` returns unless told (`limit`), and the most it returns.
DEFAULT_USAGE_LIMIT: Final = 1000
MAX_USAGE_LIMIT: Final = 10_000


def parse_limit(value: str | None) -> int:
    """`limit`: groups per page, 1 to `MAX_USAGE_LIMIT` (`DEFAULT_USAGE_LIMIT` if absent)."""
    if not value:
        return DEFAULT_USAGE_LIMIT
    try:
        limit = int(value)
    except ValueError:
        raise ValueError(f"limit: '{value}' is not a whole number") from None
    if not 1 <= limit <= MAX_USAGE_LIMIT:
        raise ValueError(f"limit: {limit} is not between 1 and {MAX_USAGE_LIMIT}")
    return limit


#: The pool page's files (package data in `pool_page/`) by the path they are served at.
POOL_PAGE_FILES: Final[dict[str, tuple[str, str]]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/pool.js": ("pool.js", "text/javascript; charset=utf-8"),
    "/pool.css": ("pool.css", "text/css; charset=utf-8"),
}
#: What a browser page may GET (Rule 3): the page, its assets, what it polls.
BROWSER_READABLE: Final = frozenset(
    {
        *POOL_PAGE_FILES,
        "/catalog",
        "/catalog/summary",
        "/status",
        "/activity",
        "/readyz",
        "/principals",
    }
)
#: Sent with the page's files: nothing from elsewhere, no inline script, no framing.
_PAGE_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def browser_request_reason(method: str, path: str, headers: dict[str, str]) -> str | None:
    """Why the admin API refuses this request (None when it serves it); module Rules 1-4."""
    lowered = {name.lower(): value for name, value in headers.items()}
    host = lowered.get("host", "")
    if not is_loopback_host_header(host):
        return f"Host '{host}' is not a loopback name"
    origin = lowered.get("origin")
    if origin is None and not any(name.startswith("sec-fetch-") for name in lowered):
        return None
    if method != "GET" or path not in BROWSER_READABLE:
        return (
            f"browser pages may only read the pool page; {method} {path} is refused "
            "(use curl or iop-edge from a shell)"
        )
    if origin is not None and origin != f"http://{host}":
        return f"Origin '{origin}' is not this listener's own (http://{host})"
    # A browser that sends Sec-Fetch-* sends Sec-Fetch-Site; one that sends only a
    # matching Origin (an older browser) made a same-origin request.
    site = lowered.get("sec-fetch-site", "same-origin" if origin is not None else "unknown")
    navigation = path == "/" and lowered.get("sec-fetch-dest", "document") == "document"
    if site != "same-origin" and not navigation:
        return f"a {site} request is refused: only the pool page itself may read {path}"
    return None


def _pool_page_file(name: str) -> bytes:
    return (resources.files(__package__) / "pool_page" / name).read_bytes()


#: What each refresh verdict is answered with.
REFRESH_STATUS: Final[dict[RefreshVerdict, int]] = {
    "accepted": 200,
    "invalid": 400,
    "conflict": 409,
    "unavailable": 503,
}


#: What each restart outcome is answered with.
RESTART_STATUS: Final[dict[RestartOutcome, int]] = {
    "handed_over": 200,
    "failed": 500,
    "refused": 409,
}


class UsageQuery(Protocol):
    def __call__(
        self,
        *,
        since: float | None,
        until: float | None,
        group_by: Sequence[str],
        limit: int | None,
        after: str | None,
    ) -> Awaitable[UsageReport]: ...


@dataclass(frozen=True, slots=True)
class AdminServices:
    """What the admin API reads and drives; the composition root wires each one."""

    revision: Callable[[], int]
    status: Callable[[], StatusReport]
    catalog: CatalogSource
    """The pool, read a slice at a time (`catalog_stream`)."""
    metrics: Callable[[], bytes]
    usage: UsageQuery
    refresh: Callable[[RefreshRequest], Awaitable[RefreshResult]]
    readiness: Callable[[], Readiness]
    activity: Callable[[], ActivityReport]
    refuse_refresh: Callable[[str], Awaitable[None]]
    """Audit a refresh request that could not be read."""
    restart: Callable[[], Awaitable[RestartReport]] | None = None
    principals: Callable[[], PrincipalsReport] | None = None
    """Each principal against its limits now (design §15)."""
    model_command: ModelCommandRunner | None = None
    """The operator's model loads and unloads (design §18); None: not offered."""


def create_admin_app(services: AdminServices) -> QuartTrio:
    app = QuartTrio("iop_edge.http.admin")
    app.config.update(RESPONSE_TIMEOUT=None, MAX_CONTENT_LENGTH=_MAX_REFRESH_BODY)

    page_files = {
        path: (_pool_page_file(name), content_type)
        for path, (name, content_type) in POOL_PAGE_FILES.items()
    }

    @app.before_request
    async def refuse_browsers() -> Response | None:
        reason = browser_request_reason(request.method, request.path, dict(request.headers.items()))
        if reason is not None:
            log.warning("admin API refused %s %s: %s", request.method, request.path, reason)
            return _error(403, reason)
        return None

    @app.get("/")
    @app.get("/pool.js")
    @app.get("/pool.css")
    async def pool_page() -> Response:
        """The live pool page (read-only; it polls /catalog, /status, /activity,
        /principals)."""
        body, content_type = page_files[request.path]
        return Response(body, content_type=content_type, headers=_PAGE_HEADERS)

    @app.get("/healthz")
    async def healthz() -> Response:
        """Liveness: the process answers (and which config revision runs)."""
        return _json({"status": "ok", "revision": services.revision()})

    @app.get("/readyz")
    async def readyz() -> Response:
        """Readiness (design §12): 200 only when some model could be served now."""
        state = services.readiness()
        body = {
            "status": "ready" if state.ready else "not_ready",
            "revision": services.revision(),
            "servable_models": state.servable_models,
            "models": state.models,
        }
        if not state.ready:
            reason = state.reason or NO_SERVABLE_MODEL
            body["reason"] = f"{reason} (see /catalog)" if reason == NO_SERVABLE_MODEL else reason
        return _json(body, 200 if state.ready else 503)

    @app.get("/activity")
    async def activity() -> Response:
        """Requests and errors per 10 s over the last 5 minutes, for the pool page."""
        return _json(services.activity())

    @app.get("/status")
    async def status() -> Response:
        return _json(services.status())

    @app.get("/catalog")
    async def catalog() -> Response:
        """`?model=&node=&health=` filter, `?limit=&cursor=` page (`core.catalog_query`);
        the answer is written as it is built, in slices (`catalog_stream`)."""
        try:
            query = CatalogQuery.from_arguments(request.args.to_dict())
        except CatalogQueryError as exc:
            return _error(400, str(exc))
        return Response(catalog_chunks(services.catalog, query), content_type="application/json")

    @app.get("/catalog/summary")
    async def catalog_summary_() -> Response:
        """Providers counted by health, and how many models and Nodes: the pool page's
        headline for a fleet too large to list at once."""
        return _json(await catalog_summary(services.catalog))

    @app.get("/principals")
    async def principals() -> Response:
        """Each principal against its limits: in flight, queued, what is left of each
        limit, today's tokens (the pool page shows it)."""
        if services.principals is None:
            return _error(404, "this Edge does not report principals")
        return _json(services.principals())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(services.metrics(), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/usage")
    async def usage() -> Response:
        """`?since=&until=` (ISO 8601 or unix seconds) `&group_by=principal_ref,token_ref,model`
        (also `provider`, `node`, `usage_source`, `status`, `protocol`); at most `limit`
        groups (`DEFAULT_USAGE_LIMIT`), the next page with `after=` the report's `next`.
        The database sums; `totals` covers the whole window whatever the page."""
        try:
            since = parse_time(request.args.get("since"))
            until = parse_time(request.args.get("until"))
            group_by = [c for c in request.args.get("group_by", DEFAULT_GROUP_BY).split(",") if c]
            limit = parse_limit(request.args.get("limit"))
            report = await services.usage(
                since=since,
                until=until,
                group_by=group_by,
                limit=limit,
                after=request.args.get("after") or None,
            )
        except ValueError as exc:
            return _error(400, str(exc))
        except LedgerUnavailable as exc:  # a database that is down: say so, retry later
            response = _error(503, str(exc))
            response.headers["Retry-After"] = str(USAGE_RETRY_AFTER_S)
            return response
        return _json(report)

    @app.post("/refresh")
    async def refresh() -> Response:
        try:
            refresh_request = await decode_request(await _body_pieces())
        except (msgspec.DecodeError, RecursionError) as exc:
            # msgspec skips unknown fields recursively: a deep one is a RecursionError.
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            problem = f"invalid refresh request: {reason}"
            await services.refuse_refresh(problem)  # every attempt is audited (design §5)
            return _error(400, problem)
        result = await services.refresh(refresh_request)
        return _json_answer(await result.report_json(), REFRESH_STATUS[result.verdict])

    @app.post("/restart")
    async def restart() -> Response:
        """Zero-downtime restart (design §13): answers once the successor serves (200), or
        why it did not take over (500: this Edge serves on) or was not tried (409)."""
        if services.restart is None:
            return _error(409, "this Edge cannot restart itself")
        report = await services.restart()
        return _json(report, RESTART_STATUS[report.outcome])

    if services.model_command is not None:
        add_model_routes(app, services.catalog, services.model_command)

    @app.errorhandler(HTTPException)
    async def on_http_error(error: HTTPException) -> Response:
        return _error(error.code or 500, error.description or error.name)

    return app
