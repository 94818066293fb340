"""A recording HTTP/1.1 server for tests that must see requests exactly as they arrived.

h11 on 127.0.0.1:0 (`tests.h11_server`) recording each request as it arrived on the
wire (request target as sent, every header line in order) and answering with whatever
the test wants, so a test sees what `tests/adapters/fake_upstream.py` normalises away
(absolute-form targets, duplicate headers) and can answer what it never would (a
gzip-encoded body, a forward proxy's reply).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import h11
import pytest
import trio

from tests.h11_server import Send, listen_local, serve_connection

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
        listeners, self.url = await listen_local()
        task_status.started(self.url)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        await serve_connection(stream, self._respond)

    async def _respond(self, head: h11.Request, body: bytes, send: Send) -> None:
        seen = Seen(head.method, head.target, list(head.headers), body)
        self.seen.append(seen)
        status, headers, content = self.answer(seen)
        headers = [*headers, (b"content-length", b"%d" % len(content))]
        await send(h11.Response(status_code=status, headers=headers))
        await send(h11.Data(data=content))
        await send(h11.EndOfMessage())


def clear_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every proxy setting from the environment, in either case."""
    for name in _PROXY_ENV:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    monkeypatch.delenv("REQUEST_METHOD", raising=False)  # urllib ignores HTTP_PROXY under CGI
