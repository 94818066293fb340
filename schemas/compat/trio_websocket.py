"""trio-websocket: raising one connection's message size limit after the handshake, and
hearing when anything arrives on a connection.

The node listener must accept a first message (`hello`, a few hundred bytes) from anyone,
so it listens with a small message limit; an authenticated node may then send messages
up to the wire's limit (large non-stream responses). trio-websocket fixes the limit per
listener (`serve_websocket(max_message_size=...)`) and offers no public call to change it
per connection, so `lift_message_limit` sets the connection's private `_max_message_size`,
which trio-websocket 0.12 reads for every incoming message.

`MESSAGE_LIMIT_LIFTABLE` says whether the installed version is one known to work that
way (`tests/compat` proves it on a real connection). When it is not, the listener allows
the full limit from the first message on: slower to refuse abuse, equally correct.

A peer pings on its own schedule, and trio-websocket answers pings (and takes pongs)
inside its reader, so nothing public says a peer was just heard from. Whatever
arrives goes through the connection's wsproto `receive_data`, which trio-websocket 0.12
looks up on every read: `watch_arrivals` wraps it on one connection. When the installed
version is not one known to read there (`ARRIVALS_WATCHABLE`), nothing is watched and the
Edge pings every Node every beat, as it would without the hook.

The hook is the connection's own attribute and refers to whoever listens, who refers to
the connection: a cycle that only the cyclic collector would free. `unwatch_arrivals`
removes it when the listener is done with the connection, so the connection, and the
session around it, are freed by reference counting alone.

Both are used through `schemas.channel` (arrivals) and the Edge's node hub (the limit);
this module is the only place that names trio-websocket's private attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import version
from typing import Final

from trio_websocket import WebSocketConnection

__all__ = [
    "ARRIVALS_WATCHABLE",
    "MESSAGE_LIMIT_LIFTABLE",
    "lift_message_limit",
    "unwatch_arrivals",
    "watch_arrivals",
]

_KNOWN_MINOR_VERSIONS: Final = ("0.12.",)

MESSAGE_LIMIT_LIFTABLE: Final = version("trio-websocket").startswith(_KNOWN_MINOR_VERSIONS)
"""Whether this trio-websocket keeps the limit where `lift_message_limit` changes it."""

ARRIVALS_WATCHABLE: Final = MESSAGE_LIMIT_LIFTABLE
"""Whether this trio-websocket hands every read to `_wsproto.receive_data` (the same
versions)."""


def lift_message_limit(websocket: WebSocketConnection, limit: int) -> None:
    """Let `websocket` receive messages of up to `limit` bytes from now on (if liftable)."""
    if MESSAGE_LIMIT_LIFTABLE and hasattr(websocket, "_max_message_size"):
        websocket._max_message_size = limit


def watch_arrivals(websocket: WebSocketConnection, heard: Callable[[], None]) -> bool:
    """Call `heard()` whenever bytes arrive on `websocket` (a message, a ping, a pong, a
    close), before trio-websocket parses them. False when not watchable: nothing is
    called then."""
    wsproto = getattr(websocket, "_wsproto", None) if ARRIVALS_WATCHABLE else None
    receive_data = getattr(wsproto, "receive_data", None)
    if receive_data is None:
        return False

    def receive_and_tell(data: bytes | None) -> None:
        heard()
        receive_data(data)

    wsproto.receive_data = receive_and_tell  # type: ignore[union-attr]
    return True


def unwatch_arrivals(websocket: WebSocketConnection) -> None:
    """Stop calling what `watch_arrivals` installed on `websocket` (nothing when nothing
    was): wsproto's own `receive_data` is what a read calls again."""
    wsproto = getattr(websocket, "_wsproto", None)
    if wsproto is not None and "receive_data" in getattr(wsproto, "__dict__", {}):
        del wsproto.receive_data
