"""Web pages and an open caller API (design §7): what a browser may not make an Edge do.

An open caller API (no `openai.principal_tokens`) authenticates nobody, so any web page
that a user of a machine reaching it visits could drive it through the user's browser.
Two rules close that, checked before anything else about a request to an open API (an
HTTP request or a WebSocket upgrade), each answered 403:

1. An `Origin` that is not the API's own (`http://` or `https://` + `Host`) is refused
   (`cross_origin`). Only browsers send `Origin`, and IOP serves no cross-origin page: it
   answers no CORS preflight, so no such page could read an HTTP reply, but a simple
   POST would still run, and a WebSocket's replies would be read (browsers apply no
   same-origin rule to WebSockets).
2. On a loopback listener (`openai.listen` a loopback address), a `Host` that is not a
   loopback name is refused (`untrusted_host`): only a page whose domain was rebound to
   this machine's address (DNS rebinding) sends one, and its `Origin` matches its
   `Host`, so Rule 1 lets it by. The Host check is for loopback listeners only: a caller
   API other machines reach (a wildcard address included, whichever address a
   connection came in on) is reached by names the Edge cannot know, and an open one is
   warned about at start (`core.configuration.exposure`).

With principal tokens neither applies: a page cannot present a token it does not hold
(credentials travel in headers a page sets itself; IOP reads no cookies).
"""

from __future__ import annotations

from functools import lru_cache

from iop_edge.core.configuration.listen import is_loopback_host_header, parse_listen_address
from iop_edge.http.errors import ApiError

__all__ = ["browser_refusal"]


# Asked of every request to an open API, of a value or two that seldom change (the
# listener's configured address, the Host callers use): each answer is kept, a few
# hundred at most.
@lru_cache(maxsize=16)
def _loopback_listen(listen: str) -> bool:
    try:
        return parse_listen_address(listen).is_loopback
    except ValueError:  # a validated config's address parses
        return False


_loopback_host = lru_cache(maxsize=256)(is_loopback_host_header)


def browser_refusal(*, host: str | None, origin: str | None, listen: str) -> ApiError | None:
    """Why an open caller API refuses this request (the module's rules), or None.
    `host`, `origin`: the headers, None when absent (no browser leaves out `Host`);
    `listen`: the caller listener's configured address (`openai.listen`), not the
    address a connection came in on, which a wildcard listener's are too."""
    if origin is not None and origin not in (f"http://{host}", f"https://{host}"):
        return ApiError(
            403,
            f"Origin {origin!r} is refused: this caller API is open (no "
            "openai.principal_tokens), and it serves no page of another origin",
            type="permission_error",
            code="cross_origin",
        )
    if host is not None and _loopback_listen(listen) and not _loopback_host(host):
        return ApiError(
            403,
            f"Host {host!r} is refused: this open caller API listens on a loopback address, "
            "so it answers only loopback names (localhost, 127.0.0.1, [::1])",
            type="permission_error",
            code="untrusted_host",
        )
    return None
