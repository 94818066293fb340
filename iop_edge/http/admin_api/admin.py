"""The loopback-only admin API: health, status, catalog, metrics, config refresh, restart,
and the live pool page; one module per route group (`admin_page`: the page and the browser
rules below; `admin_state`: the live state's reads; `admin_usage`; `admin_control`:
refresh and restart; `admin_models`), all given the `AdminServices` (`admin_services`).

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

Mutations are POST only, and each presents the admin credential (`Authorization: Bearer`,
`lifecycle.admin_credential`): every user of the machine reaches the listener, but only
one who may read the Edge's `state_dir` may change the Edge. Reads need none.
"""

from __future__ import annotations

import logging

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from iop_edge.http.admin_api.admin_answers import error_response
from iop_edge.http.admin_api.admin_control import add_control_routes
from iop_edge.http.admin_api.admin_models import add_model_routes
from iop_edge.http.admin_api.admin_page import add_page_routes
from iop_edge.http.admin_api.admin_services import AdminServices
from iop_edge.http.admin_api.admin_state import add_state_routes
from iop_edge.http.admin_api.admin_usage import add_usage_routes
from iop_edge.runtime.lifecycle import admin_credential

log = logging.getLogger(__name__)

__all__ = ["create_admin_app"]

#: The largest body the admin API reads: a `POST /refresh` candidate's (`config_yaml`).
_MAX_REFRESH_BODY = 16 * 1024 * 1024


def create_admin_app(services: AdminServices) -> QuartTrio:
    """The admin app: one function per route group adds its routes (the browser rules
    first, so they run before every request)."""
    app = QuartTrio("iop_edge.http.admin_api.admin")
    app.config.update(RESPONSE_TIMEOUT=None, MAX_CONTENT_LENGTH=_MAX_REFRESH_BODY)
    add_page_routes(app)

    @app.before_request
    async def require_credential() -> Response | None:
        if request.method != "POST" or admin_credential.matches(
            request.headers.get("authorization"), services.admin_token
        ):
            return None
        log.warning("admin API refused %s %s: no admin credential", request.method, request.path)
        return error_response(
            401,
            f"{request.method} {request.path} changes the Edge: it needs the admin credential, "
            f"`Authorization: Bearer` with the token in {services.admin_token_path} (the "
            "iop-edge commands read it themselves, as a user who may read that file)",
        )

    add_state_routes(app, services)
    add_usage_routes(app, services)
    add_control_routes(app, services)
    if services.model_command is not None:
        add_model_routes(app, services.catalog, services.model_command)

    @app.errorhandler(HTTPException)
    async def on_http_error(error: HTTPException) -> Response:
        if error.code == 413:
            return error_response(
                413,
                f"The request body is over the admin API's {_MAX_REFRESH_BODY >> 20} MiB: for "
                "a larger config, write it over the Edge's config file and refresh without a "
                "candidate (`iop-edge refresh --apply`, or SIGHUP)",
            )
        return error_response(error.code or 500, error.description or error.name)

    return app
