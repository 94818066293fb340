"""The last message of a response is sent whole, even when the exchange is cancelled.

Hypercorn closes a connection that must not be kept open (`Connection: close`,
HTTP/1.0) from inside the ASGI `send` of the response's last body message: it ends the
stream, tells the app `http.disconnect`, and then closes the socket. Quart-Trio cancels
its request nursery on that very disconnect, so the close is cancelled half done and
the socket stays open until the caller gives up (found watching `/healthz` for 400 s).
The run endpoints avoid it by ignoring a disconnect once the response is complete; the
Quart-served routes get `shield_final_send`, which lets that one `send` finish under a
shield, bounded by `FINAL_SEND_S`.
"""

from __future__ import annotations

from typing import Final

import trio
from hypercorn.typing import (
    ASGIFramework,
    ASGIReceiveCallable,
    ASGISendCallable,
    ASGISendEvent,
    Scope,
)

__all__ = ["FINAL_SEND_S", "ShieldFinalSend", "shield_final_send"]

#: Bound on the shielded last send: the bytes go to the socket buffer, then a close.
FINAL_SEND_S: Final = 5.0


def shield_final_send(send: ASGISendCallable) -> ASGISendCallable:
    """`send`, with the last body message of a response sent under a bounded shield."""

    async def send_final_whole(message: ASGISendEvent) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            with trio.move_on_after(FINAL_SEND_S, shield=True):
                await send(message)
            return
        await send(message)

    return send_final_whole


class ShieldFinalSend:
    """An ASGI app whose HTTP responses end with a shielded last send (see above)."""

    def __init__(self, app: ASGIFramework) -> None:
        self._app = app

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http":
            send = shield_final_send(send)
        await self._app(scope, receive, send)
