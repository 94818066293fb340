"""The admin API's mutations of the running Edge: `POST /refresh` (design §5) and
`POST /restart` (design §13), each answered with its report."""

from __future__ import annotations

import math
from typing import Final

import msgspec
import trio
from quart import Response, current_app, request
from quart_trio import QuartTrio
from werkzeug.exceptions import RequestEntityTooLarge, RequestTimeout

from iop_edge.http.admin_api.admin_answers import encoded_response, error_response, json_response
from iop_edge.http.admin_api.admin_services import AdminServices
from iop_edge.runtime.refresh.refresh_request import decode_request
from schemas.refresh import RefreshVerdict
from schemas.restart import RestartOutcome


async def _body_pieces() -> list[bytes]:
    """The current request's body in the pieces it arrived in, within the request's body
    timeout (`RequestTimeout` past it, as Quart's `get_data`) and the app's
    `MAX_CONTENT_LENGTH` (`RequestEntityTooLarge` past it, however the body is framed:
    Quart checks a chunked one only against what it holds unread). A fleet's refresh
    candidate is megabytes: gathered here into one growing buffer, then copied out, it
    would cost the event loop a few steps of 10 ms or more each; its pieces are joined
    by `decode_request`, off the loop."""
    timeout = math.inf if request.body_timeout is None else request.body_timeout
    limit = current_app.config["MAX_CONTENT_LENGTH"] or math.inf
    pieces: list[bytes] = []
    size = 0
    with trio.move_on_after(timeout) as waited:
        async for piece in request.body:
            size += len(piece)
            if size > limit:
                raise RequestEntityTooLarge()
            pieces.append(piece)
        return pieces
    assert waited.cancelled_caught
    raise RequestTimeout()


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


def add_control_routes(app: QuartTrio, services: AdminServices) -> None:
    """Serve `POST /refresh` and `POST /restart`."""

    @app.post("/refresh")
    async def refresh() -> Response:
        try:
            refresh_request = await decode_request(await _body_pieces())
        except (msgspec.DecodeError, RecursionError) as exc:
            # msgspec skips unknown fields recursively: a deep one is a RecursionError.
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            problem = f"invalid refresh request: {reason}"
            await services.refuse_refresh(problem)  # every attempt is audited (design §5)
            return error_response(400, problem)
        result = await services.refresh(refresh_request)
        return encoded_response(await result.report_json(), REFRESH_STATUS[result.verdict])

    @app.post("/restart")
    async def restart() -> Response:
        """Zero-downtime restart (design §13): answers once the successor serves (200), or
        why it did not take over (500: this Edge serves on) or was not tried (409)."""
        if services.restart is None:
            return error_response(409, "this Edge cannot restart itself")
        report = await services.restart()
        return json_response(report, RESTART_STATUS[report.outcome])
