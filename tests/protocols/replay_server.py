"""An HTTP server that answers every request with the bytes a test sets, for the SDKs.

The official `anthropic` and `openai` SDKs are the judges of the translators' output:
a test puts a translated body or event stream here and calls the SDK against it, so
anything the SDK cannot parse (or its stream accumulator refuses) fails the test. It
runs on 127.0.0.1 port 0 in a thread of its own (the SDK clients the tests use are the
synchronous ones), for the whole session, and is shut down and joined at its end.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Reply:
    body: bytes
    content_type: str = "application/json"
    status: int = 200


@dataclass
class ReplayServer:
    """Answers each request with `reply`; keeps the last request's path and body."""

    url: str
    reply: Reply = field(default_factory=lambda: Reply(b"{}"))
    last_path: str = ""
    last_body: bytes = b""

    def answer(
        self, body: bytes, content_type: str = "application/json", status: int = 200
    ) -> None:
        self.reply = Reply(body, content_type, status)

    def stream(self, events: bytes) -> None:
        self.answer(events, "text/event-stream")


@contextmanager
def replay_server() -> Iterator[ReplayServer]:
    state: list[ReplayServer] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass  # the test output stays the test's

        def do_POST(self) -> None:
            server = state[0]
            length = int(self.headers.get("content-length") or 0)
            server.last_path, server.last_body = self.path, self.rfile.read(length)
            reply = server.reply
            self.send_response(reply.status)
            self.send_header("content-type", reply.content_type)
            self.send_header("content-length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)

        do_GET = do_POST

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    state.append(ReplayServer(url=f"http://127.0.0.1:{httpd.server_address[1]}"))
    thread = threading.Thread(
        target=httpd.serve_forever, args=(0.05,), name="replay-server", daemon=True
    )
    thread.start()
    try:
        yield state[0]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
