"""ASGI pieces shared by the tests that serve a plain app with the Edge's HTTP server."""

from __future__ import annotations

from typing import Any


async def complete_lifespan(receive: Any, send: Any) -> None:
    """Answer a lifespan scope: complete startup and shutdown, return after shutdown."""
    while True:
        message = await receive()
        kind = message["type"].rsplit(".", 1)[-1]
        await send({"type": f"lifespan.{kind}.complete"})
        if kind == "shutdown":
            return
