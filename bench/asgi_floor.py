"""The floors under the Edge: an HTTP server answering by itself, two ways.

A plain ASGI function answers the benchmark's chat request with the fake upstream's own
bytes: the same completion, or the same stream events, one ASGI body message each (as a
gateway relaying a stream sends them). No routing, no Node, no upstream call. It is
served by one of:

- `--server hypercorn` (`Hypercorn` in the tables): stock `hypercorn.trio.serve`,
  configured as the Edge configures its OpenAI listener. The floor the c=1 latency goals
  are stated against.
- `--server edge` (`Edge HTTP`): exactly as the Edge serves that listener,
  `iop_edge.http.server.HttpServer` on a socket bound the same way, so with the Edge's
  own connection handler (`iop_edge.http.connection`, which writes responses without
  Hypercorn's per-piece task switches). What is left is the Edge's HTTP server and Trio
  serving one request: the least any gateway built on that server can add, the part of
  IOP's numbers that no work in IOP itself can remove.

    python -m bench.asgi_floor [--server edge|hypercorn] [--port 0]

prints `bench-asgi-floor listening on http://127.0.0.1:PORT` once accepting, then serves
until stopped (SIGINT/SIGTERM).
"""

from __future__ import annotations

import argparse
import sys
from typing import Final

import trio
from hypercorn.trio import serve
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

from bench.upstream import asks_for_stream, completion_body, stream_events
from iop_edge.core.configuration.listen import parse_listen_address
from iop_edge.http.server import HttpServer, hypercorn_config
from iop_edge.runtime.lifecycle.listeners import bind_listener

READY_PREFIX: Final = "bench-asgi-floor listening on "
SERVERS: Final = ("edge", "hypercorn")
_CHAT_PATH: Final = "/v1/chat/completions"
_COMPLETION: Final = completion_body()
_EVENTS: Final = tuple(b"data: " + event + b"\n\n" for event in stream_events(include_usage=False))
_DONE: Final = b"data: [DONE]\n\n"
_JSON_HEADERS: Final = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(_COMPLETION)).encode()),
]
_SSE_HEADERS: Final = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def serve_lifespan(receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    """The ASGI lifespan of an app with nothing to start or stop."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def app(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")  # type: ignore[operator]
        if not message.get("more_body", False):
            break
    if scope["method"] != "POST" or scope["path"] != _CHAT_PATH:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if not asks_for_stream(body):
        await send({"type": "http.response.start", "status": 200, "headers": _JSON_HEADERS})
        await send({"type": "http.response.body", "body": _COMPLETION, "more_body": False})
        return
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    for event in _EVENTS:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": _DONE, "more_body": False})


async def _serve_process(server: str, host: str, port: int) -> None:
    listen = f"{host}:{port}"
    async with trio.open_nursery() as nursery:
        if server == "hypercorn":
            url = (await nursery.start(serve, app, hypercorn_config(listen)))[0]
        else:
            sock = bind_listener("openai", listen, parse_listen_address(listen)).socket
            url = await nursery.start(HttpServer(app, hypercorn_config(listen), sock).serve)
        print(READY_PREFIX + url, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.asgi_floor",
        description="An HTTP server answering the benchmark's request by itself.",
    )
    parser.add_argument("--server", choices=SERVERS, default="edge")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        trio.run(_serve_process, args.server, args.host, args.port)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
