"""A recording HTTP/1.1 server for tests that must see requests exactly as they arrived.

A few lines of h11 on 127.0.0.1:0 that record each request as it arrived on the wire
(request target as sent, every header line in order) and answer with whatever the test
wants, so a test sees what `tests/adapters/fake_upstream.py` normalises away
(absolute-form targets, duplicate headers) and can answer what it never would (a
gzip-encoded body, a forward proxy's reply).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h11
import pytest
import trio

Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, Headers, bytes]

_PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


@dataclass(frozen=True, slots=True)
class Seen:
    """One request exactly as it arrived: target as sent, every header line in order."""

    method: bytes
    target: bytes
    headers: Headers
    body: bytes

    def values(self, name: bytes) -> list[bytes]:
        return [value for key, value in self.headers if key == name.lower()]

    def names(self) -> list[bytes]:
        return sorted(key for key, _ in self.headers)


@dataclass
class RecordingServer:
    """HTTP/1.1 on 127.0.0.1:0 (keep-alive) answering each request with `answer(seen)`."""

    answer: Callable[[Seen], Answer]
    seen: list[Seen] = field(init=False, default_factory=list)
    connections: int = field(init=False, default=0)
    url: str = field(init=False, default="")

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        task_status.started(self.url)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
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
                    body = b""
                    while isinstance(event := await next_event(), h11.Data):
                        body += event.data
                    seen = Seen(head.method, head.target, list(head.headers), body)
                    self.seen.append(seen)
                    status, headers, content = self.answer(seen)
                    headers = [*headers, (b"content-length", b"%d" % len(content))]
                    await send(h11.Response(status_code=status, headers=headers))
                    await send(h11.Data(data=content))
                    await send(h11.EndOfMessage())
                    conn.start_next_cycle()
            except (h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass


def clear_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every proxy setting from the environment, in either case."""
    for name in _PROXY_ENV:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    monkeypatch.delenv("REQUEST_METHOD", raising=False)  # urllib ignores HTTP_PROXY under CGI
