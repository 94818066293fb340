"""trio-websocket: raising one connection's message size limit after the handshake.

The node listener must accept a first message (`hello`, a few hundred bytes) from anyone,
so it listens with a small message limit; an authenticated node may then send messages
up to the wire's limit (large non-stream responses). trio-websocket fixes the limit per
listener (`serve_websocket(max_message_size=...)`) and offers no public call to change it
per connection, so `lift_message_limit` sets the connection's private `_max_message_size`,
which trio-websocket 0.12 reads for every incoming message.

`MESSAGE_LIMIT_LIFTABLE` says whether the installed version is one known to work that
way (`tests/compat` proves it on a real connection). When it is not, the listener allows
the full limit from the first message on: slower to refuse abuse, equally correct.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Final

from trio_websocket import WebSocketConnection

__all__ = ["MESSAGE_LIMIT_LIFTABLE", "lift_message_limit"]

_KNOWN_MINOR_VERSIONS: Final = ("0.12.",)

MESSAGE_LIMIT_LIFTABLE: Final = version("trio-websocket").startswith(_KNOWN_MINOR_VERSIONS)
"""Whether this trio-websocket keeps the limit where `lift_message_limit` changes it."""


def lift_message_limit(websocket: WebSocketConnection, limit: int) -> None:
    """Let `websocket` receive messages of up to `limit` bytes from now on (if liftable)."""
    if MESSAGE_LIMIT_LIFTABLE and hasattr(websocket, "_max_message_size"):
        websocket._max_message_size = limit
