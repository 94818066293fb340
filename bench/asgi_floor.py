"""The floor under the Edge: its HTTP server answering by itself (`Hypercorn floor` in the table).

A plain ASGI function under Hypercorn, configured exactly as the Edge configures its
OpenAI listener, answers the benchmark's chat request with the fake upstream's own bytes:
the same completion, or the same stream events, one ASGI body message each (as a
gateway relaying a stream sends them). No routing, no Node, no upstream call. What is
left is Hypercorn and Trio serving one request, so its added latency and CPU are the
least any gateway built on the Edge's HTTP server can add: the part of IOP's numbers
that no work in IOP itself can remove.

    python -m bench.asgi_floor [--port 0]

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
from iop_edge.edge import hypercorn_config

READY_PREFIX: Final = "bench-asgi-floor listening on "
_CHAT_PATH: Final = "/v1/chat/completions"
_COMPLETION: Final = completion_body()
_EVENTS: Final = tuple(b"data: " + event + b"\n\n" for event in stream_events(include_usage=False))
_DONE: Final = b"data: [DONE]\n\n"
_JSON_HEADERS: Final = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(_COMPLETION)).encode()),
]
_SSE_HEADERS: Final = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def app(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
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


async def _serve_process(host: str, port: int) -> None:
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, hypercorn_config(f"{host}:{port}"))
        print(READY_PREFIX + binds[0], flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.asgi_floor",
        description="Hypercorn answering the benchmark's request by itself.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        trio.run(_serve_process, args.host, args.port)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
