"""Raw websocket peers for hostile tests: upgrades from a chosen source address that then
do exactly what the test says (nothing, garbage, a slow hello)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
from trio_websocket import WebSocketConnection, open_websocket_url
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Event, Request

from schemas import wire
from schemas.limits import MAX_FRAME_BYTES
from tests.e2e.stack import NODE_TOKEN

__all__ = ["OnMessage", "RawPeer", "hand_driven_node", "open_raw_peer"]


class RawPeer:
    """An upgraded websocket held at the wsproto level (so nothing answers for us)."""

    def __init__(self, stream: trio.SocketStream, ws: WSConnection) -> None:
        self.stream = stream
        self.ws = ws

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(self.ws.send(BytesMessage(data=data)))

    async def next_message(self, *, answer_close: bool = True) -> wire.EdgeToNode | None:
        """The next message from the Edge, or None once it closed the connection (its
        Close answered unless `answer_close` is False)."""
        buffer = bytearray()
        while True:
            for event in self._events():
                if isinstance(event, BytesMessage):
                    buffer += event.data
                    if event.message_finished:
                        return wire.decode_from_edge(bytes(buffer))
                elif isinstance(event, CloseConnection):
                    if answer_close:
                        await self._answer_close(event)
                    return None
            data = await self.stream.receive_some()
            if not data:
                return None
            self.ws.receive_data(data)

    async def wait_eof(self) -> None:
        """Read (and drop) bytes until the Edge closes (or resets) the TCP connection."""
        try:
            while await self.stream.receive_some():
                pass
        except trio.BrokenResourceError:
            pass

    async def wait_closed(self) -> None:
        """Read until the Edge closes the connection (messages are discarded)."""
        while await self.next_message() is not None:
            pass

    async def _answer_close(self, event: CloseConnection) -> None:
        """Complete the closing handshake, so the Edge's side ends at once."""
        try:
            await self.stream.send_all(self.ws.send(event.response()))
        except Exception:
            pass  # already gone, or the close was not a clean one

    def _events(self) -> list[Event]:
        try:
            return list(self.ws.events())
        except Exception:  # a broken frame from our side of the test: treat as closed
            return [CloseConnection(code=1006)]

    async def aclose(self) -> None:
        await self.stream.aclose()


async def open_raw_peer(url: str, source: str = "127.0.0.1") -> RawPeer:
    """Upgrade a TCP connection from `source` (any 127/8 address works on Linux)."""
    host, port = url.removeprefix("ws://").rsplit(":", 1)
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    await sock.bind((source, 0))
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    ws = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(ws.send(Request(host=host, target="/")))
    while True:
        data = await stream.receive_some()
        if not data:
            raise ConnectionError("the Edge closed the connection during the upgrade")
        ws.receive_data(data)
        if any(isinstance(event, AcceptConnection) for event in ws.events()):
            return RawPeer(stream, ws)


OnMessage = Callable[[WebSocketConnection, wire.EdgeToNode], Awaitable[None]]


async def hand_driven_node(
    url: str,
    on_message: OnMessage,
    *,
    status: wire.Status | None = None,
    task_status: trio.TaskStatus[WebSocketConnection],
) -> None:
    """An authenticated Node written by hand: handshake, report `sim-1` available (or
    `status`), then hand every message from the Edge to `on_message`."""
    async with open_websocket_url(url, max_message_size=MAX_FRAME_BYTES) as ws:
        hello = wire.Hello(protocol=wire.PROTOCOL_VERSION, node_id="node-1", token=NODE_TOKEN)
        await ws.send_message(wire.encode(hello))
        assert isinstance(wire.decode_from_edge(await ws.get_message()), wire.Welcome)
        available = wire.ProviderStatus(id="sim-1", health="available", models=["sim-small"])
        await ws.send_message(wire.encode(status or wire.Status(providers=[available])))
        task_status.started(ws)
        while True:
            await on_message(ws, wire.decode_from_edge(await ws.get_message()))
