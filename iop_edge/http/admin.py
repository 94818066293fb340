"""The loopback-only admin API: health, status, catalog, metrics, config refresh, restart.

SPEC §5.1: the listener itself must be a loopback address (checked at startup), and every
request is refused when it carries `Origin` or any `Sec-Fetch-*` header or a `Host` that
is not a loopback name. A browser page therefore cannot drive it (CSRF, DNS rebinding).
Mutations are POST only.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Protocol

import msgspec
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from iop_edge.core.listen import is_loopback_host_header
from iop_edge.runtime.refresh import RefreshResult
from iop_edge.runtime.usage import UsageReport
from schemas.catalog import Catalog
from schemas.refresh import RefreshRequest, RefreshVerdict, StatusReport
from schemas.restart import RestartOutcome, RestartReport

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
_MAX_REFRESH_BODY = 16 * 1024 * 1024


def _json(payload: object, status: int = 200) -> Response:
    return Response(_encode(payload), status=status, content_type="application/json")


def _error(status: int, message: str) -> Response:
    return _json({"error": {"message": message, "status": status}}, status)


DEFAULT_GROUP_BY = "principal_ref,token_ref,model"


def parse_time(value: str | None) -> float | None:
    """Unix seconds or an ISO 8601 timestamp (naive = UTC)."""
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"'{value}' is neither unix seconds nor an ISO 8601 time") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def browser_request_reason(headers: dict[str, str]) -> str | None:
    """Why a request looks like it came from a browser page (None when it does not)."""
    lowered = {name.lower(): value for name, value in headers.items()}
    if "origin" in lowered:
        return "requests with an Origin header are refused"
    if any(name.startswith("sec-fetch-") for name in lowered):
        return "requests with Sec-Fetch-* headers are refused"
    host = lowered.get("host", "")
    if not is_loopback_host_header(host):
        return f"Host '{host}' is not a loopback name"
    return None


#: What each refresh verdict is answered with.
REFRESH_STATUS: Final[dict[RefreshVerdict, int]] = {
    "accepted": 200,
    "invalid": 400,
    "conflict": 409,
}


#: What each restart outcome is answered with.
RESTART_STATUS: Final[dict[RestartOutcome, int]] = {
    "handed_over": 200,
    "failed": 500,
    "refused": 409,
}


class UsageQuery(Protocol):
    def __call__(
        self, *, since: float | None, until: float | None, group_by: Sequence[str]
    ) -> Awaitable[UsageReport]: ...


@dataclass(frozen=True, slots=True)
class AdminServices:
    """What the admin API reads and drives; the composition root wires each one."""

    revision: Callable[[], int]
    status: Callable[[], StatusReport]
    catalog: Callable[[], Catalog]
    metrics: Callable[[], bytes]
    usage: UsageQuery
    refresh: Callable[[RefreshRequest], Awaitable[RefreshResult]]
    restart: Callable[[], Awaitable[RestartReport]] | None = None


def create_admin_app(services: AdminServices) -> QuartTrio:
    app = QuartTrio("iop_edge.http.admin")
    app.config.update(RESPONSE_TIMEOUT=None, MAX_CONTENT_LENGTH=_MAX_REFRESH_BODY)

    @app.before_request
    async def refuse_browsers() -> Response | None:
        reason = browser_request_reason(dict(request.headers.items()))
        if reason is not None:
            log.warning("admin API refused %s %s: %s", request.method, request.path, reason)
            return _error(403, reason)
        return None

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"status": "ok", "revision": services.revision()})

    @app.get("/status")
    async def status() -> Response:
        return _json(services.status())

    @app.get("/catalog")
    async def catalog() -> Response:
        return _json(services.catalog())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(services.metrics(), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/usage")
    async def usage() -> Response:
        """`?since=&until=` (ISO 8601 or unix seconds) `&group_by=principal_ref,token_ref,model`."""
        try:
            since = parse_time(request.args.get("since"))
            until = parse_time(request.args.get("until"))
            group_by = [c for c in request.args.get("group_by", DEFAULT_GROUP_BY).split(",") if c]
            report = await services.usage(since=since, until=until, group_by=group_by)
        except ValueError as exc:
            return _error(400, str(exc))
        return _json(report)

    @app.post("/refresh")
    async def refresh() -> Response:
        raw = await request.get_data(cache=False)
        assert isinstance(raw, bytes)
        try:
            refresh_request = msgspec.json.decode(raw or b"{}", type=RefreshRequest)
        except msgspec.DecodeError as exc:
            return _error(400, f"invalid refresh request: {exc}")
        result = await services.refresh(refresh_request)
        return _json(result.report, REFRESH_STATUS[result.verdict])

    @app.post("/restart")
    async def restart() -> Response:
        """Zero-downtime restart (SPEC §13): answers once the successor serves (200), or
        why it did not take over (500: this Edge serves on) or was not tried (409)."""
        if services.restart is None:
            return _error(409, "this Edge cannot restart itself")
        report = await services.restart()
        return _json(report, RESTART_STATUS[report.outcome])

    @app.errorhandler(HTTPException)
    async def on_http_error(error: HTTPException) -> Response:
        return _error(error.code or 500, error.description or error.name)

    return app
