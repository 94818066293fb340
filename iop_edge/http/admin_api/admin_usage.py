"""The admin API's `GET /usage` (design §7): the ledger's records in a window, grouped and
paged, with the time and page parameters it accepts."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Final

from quart import Response, request
from quart_trio import QuartTrio

from iop_edge.http.admin_api.admin_answers import error_response, json_response
from iop_edge.http.admin_api.admin_services import AdminServices
from iop_edge.runtime.metering.usage_ledger.usage_store import LedgerUnavailable

DEFAULT_GROUP_BY = "principal_ref,token_ref,model"
#: `Retry-After` of a `/usage` the ledger's database cannot answer now.
USAGE_RETRY_AFTER_S: Final = 5


#: The unix seconds a time may be: from the epoch to the year 9999 (what a calendar, a
#: report and `datetime` can show).
_LATEST_S: Final = 253_402_300_799.0


def parse_time(name: str, value: str | None) -> float | None:
    """Argument `name`: unix seconds or an ISO 8601 timestamp (naive = UTC), between 1970
    and 9999; a `ValueError` naming it otherwise."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise ValueError(f"{name}: '{value}' is not a point in time")
        if not 0 <= seconds <= _LATEST_S:
            raise ValueError(
                f"{name}: '{value}' is outside 1970-01-01 to 9999-12-31 (unix seconds 0 to "
                f"{_LATEST_S:.0f})"
            )
        return seconds
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{name}: '{value}' is neither unix seconds nor an ISO 8601 time"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    seconds = parsed.timestamp()
    if not 0 <= seconds <= _LATEST_S:
        raise ValueError(f"{name}: '{value}' is outside 1970-01-01 to 9999-12-31 (UTC)")
    return seconds


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


#: The arguments `GET /usage` takes; any other is a 400, as `/catalog` answers.
USAGE_ARGUMENTS: Final = ("since", "until", "group_by", "limit", "after")


def add_usage_routes(app: QuartTrio, services: AdminServices) -> None:
    """Serve `GET /usage`."""

    @app.get("/usage")
    async def usage() -> Response:
        """`?since=&until=` (ISO 8601 or unix seconds) `&group_by=principal_ref,token_ref,model`
        (also `provider`, `node`, `usage_source`, `status`, `protocol`); at most `limit`
        groups (`DEFAULT_USAGE_LIMIT`), the next page with `after=` the report's `next`.
        The database sums; `totals` covers the whole window whatever the page."""
        try:
            unknown = sorted(set(request.args) - set(USAGE_ARGUMENTS))
            if unknown:
                raise ValueError(
                    f"{', '.join(unknown)}: not a usage argument; use " + ", ".join(USAGE_ARGUMENTS)
                )
            since = parse_time("since", request.args.get("since"))
            until = parse_time("until", request.args.get("until"))
            if since is not None and until is not None and since > until:
                raise ValueError("since: later than until (the window would be empty)")
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
            return error_response(400, str(exc))
        except LedgerUnavailable as exc:  # a database that is down: say so, retry later
            response = error_response(503, str(exc))
            response.headers["Retry-After"] = str(USAGE_RETRY_AFTER_S)
            return response
        return json_response(report)
