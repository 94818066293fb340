"""The live pool page, and the rules for browser requests to the admin API (`admin`
Rules 1-4): checked before every request, so a browser page may read the pool page and
the documents it polls, and nothing else."""

from __future__ import annotations

import logging
from importlib import resources
from typing import Final

from quart import Response, request
from quart_trio import QuartTrio

from iop_edge.core.configuration.listen import is_loopback_host_header
from iop_edge.http.admin_api.admin_answers import error_response

log = logging.getLogger(__name__)

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
    """Why the admin API refuses this request (None when it serves it); `admin` Rules 1-4."""
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


def add_page_routes(app: QuartTrio) -> None:
    """Refuse what browsers may not do (`browser_request_reason`), and serve the pool page."""
    page_files = {
        path: (_pool_page_file(name), content_type)
        for path, (name, content_type) in POOL_PAGE_FILES.items()
    }

    @app.before_request
    async def refuse_browsers() -> Response | None:
        reason = browser_request_reason(request.method, request.path, dict(request.headers.items()))
        if reason is not None:
            log.warning("admin API refused %s %s: %s", request.method, request.path, reason)
            return error_response(403, reason)
        return None

    @app.get("/")
    @app.get("/pool.js")
    @app.get("/pool.css")
    async def pool_page() -> Response:
        """The live pool page (read-only; it polls /catalog, /status, /activity,
        /principals)."""
        body, content_type = page_files[request.path]
        return Response(body, content_type=content_type, headers=_PAGE_HEADERS)
