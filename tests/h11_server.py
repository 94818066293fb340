"""Plain HTTP/1.1 servers for tests: a few lines of h11 on Trio, on a real socket on
127.0.0.1 at a port the kernel picks, so a test controls every byte of the answer and
sees every request as it arrived."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import h11
import trio

__all__ = ["Respond", "Send", "listen_local", "serve_connection"]

#: Sends one h11 event (a `Response`, `Data`, `EndOfMessage`) on the connection.
Send = Callable[[Any], Awaitable[None]]
#: Answers one request (its body read whole) by sending the response's events.
Respond = Callable[[h11.Request, bytes, Send], Awaitable[None]]


async def listen_local() -> tuple[list[trio.SocketListener], str]:
    """Listeners on 127.0.0.1 port 0, and the root URL (`http://127.0.0.1:PORT`) they
    answer at; serve them with `trio.serve_listeners`."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    return listeners, f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def serve_connection(stream: trio.SocketStream, respond: Respond) -> None:
    """Answer one keep-alive connection's requests in order with `respond`, until the
    client goes away or an answer leaves the connection unfit for another request."""
    conn = h11.Connection(h11.SERVER)

    async def next_event() -> Any:
        while (event := conn.next_event()) is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        return event

    async def send(event: Any) -> None:
        await stream.send_all(conn.send(event) or b"")

    async with stream:
        try:
            while isinstance(head := await next_event(), h11.Request):
                body = bytearray()
                while isinstance(event := await next_event(), h11.Data):
                    body += event.data
                await respond(head, bytes(body), send)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away, or spoke no HTTP: nothing to answer
