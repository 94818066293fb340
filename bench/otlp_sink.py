"""An OTLP/HTTP traces receiver that keeps nothing: where the tracing bench's spans go.

`python -m bench.otlp_sink` listens on 127.0.0.1 (a free port), prints
`otlp sink listening on URL` once accepting, and answers every `POST /v1/traces` with
an empty `ExportTraceServiceResponse` (an empty protobuf message is zero bytes) after
reading the body: the exporter's whole cost (encoding, the HTTP request) is paid by the
process that exports, as against a real collector, and the sink's own CPU is outside
what the bench measures (its own process). It counts requests and bytes, and says so
when stopped.
"""

from __future__ import annotations

import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Final

READY_PREFIX: Final = "otlp sink listening on "


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects
    requests = 0
    bytes = 0
    _lock = threading.Lock()

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        with self._lock:
            type(self).requests += 1
            type(self).bytes += len(body)
        status = 200 if self.path == "/v1/traces" else 404
        self.send_response(status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: one line per export would be the sink's main cost."""


def main() -> int:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    server.daemon_threads = True
    host, port = server.server_address[:2]
    print(f"{READY_PREFIX}http://{host!s}:{port}", flush=True)

    def stop(signum: int, frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve_forever()
    print(f"otlp sink: {_Sink.requests} exports, {_Sink.bytes} bytes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
