"""The Edge's listening sockets: bound here, or inherited from the Edge process it replaces.

The Edge binds its sockets itself (Hypercorn and trio-websocket get them ready-made)
because of what a zero-downtime restart needs (design §13):

- The successor process inherits the very same listening sockets (same file
  descriptions, passed at `exec`): the port stays the same, port 0 included, and a
  connection waiting in the accept queue is never lost. Two *different* sockets sharing
  a port with `SO_REUSEPORT` would each have their own queue, and closing the old one
  drops what is queued in it.
- The OpenAI listener also sets `SO_REUSEPORT`: several Edge processes on one host
  (replicas as workers) share the caller port and the kernel spreads connections
  across them; a restart whose new config moves a listener binds the new address fresh.
- The node and admin listeners do not share: every replica needs its own (Nodes must
  link to each replica; an operator talks to one replica), so a second Edge on the
  same node or admin address fails to start, saying so, instead of silently taking
  half of the Nodes.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from iop_edge.core.configuration.listen import ListenAddress, parse_listen_address

__all__ = [
    "Listener",
    "ListenerError",
    "Listeners",
    "Role",
    "adopt_listener",
    "bind_listener",
    "first_clash",
]

Role = Literal["openai", "node", "admin"]

#: Where each listener's address lives in the config, for error messages.
CONFIG_KEYS: dict[Role, str] = {
    "openai": "openai.listen",
    "node": "edge.listen",
    "admin": "admin.listen",
}
#: The flag that moves each listener away from its config key (`Listeners`).
OVERRIDE_FLAGS: Final[dict[Role, str]] = {
    "node": "--node-listen",
    "admin": "--admin-listen",
    "openai": "--ephemeral-ports",
}


@dataclass(frozen=True, slots=True)
class Listeners:
    """Where to bind, when not where the config says: the demo's free ports, or each
    replica's own node and admin address on a shared host (`serve --node-listen`).

    Kept apart from the config so a refresh compares the config file with the config
    that runs, and does not report the listeners as changed."""

    node: str | None = None
    openai: str | None = None
    admin: str | None = None

    def sources(self) -> dict[Role, str]:
        """Where each listener's address comes from: its flag when moved, else its key."""
        return {
            role: OVERRIDE_FLAGS[role] if getattr(self, role) else CONFIG_KEYS[role]
            for role in CONFIG_KEYS
        }


def first_clash(listen: Mapping[Role, str], sources: Mapping[Role, str]) -> str | None:
    """Two listeners on one port: the config's rule (`config_rules`) again, for the
    addresses a flag moved (`serve --node-listen`); what is wrong, naming both, or None."""
    addresses = [(role, parse_listen_address(text)) for role, text in listen.items()]
    for index, (role, address) in enumerate(addresses):
        for other, taken in addresses[:index]:
            if address.clashes_with(taken):
                return (
                    f"{sources[role]} {listen[role]} is also {sources[other]} "
                    f"({listen[other]}): each listener needs its own port"
                )
    return None


class ListenerError(Exception):
    """A listener could not be bound; the message names the config key and the address."""


@dataclass(eq=False)
class Listener:
    """One listening socket and the configured address it was opened for."""

    role: Role
    configured: str
    """The `HOST:PORT` text it was opened for (a successor inherits it only when its own
    config says the same)."""
    socket: socket.socket

    @property
    def port(self) -> int:
        return int(self.socket.getsockname()[1])

    def close(self) -> None:
        self.socket.close()


def bind_listener(
    role: Role, configured: str, address: ListenAddress, *, backlog: int = socket.SOMAXCONN
) -> Listener:
    """Bind and listen on `address` (`SO_REUSEPORT` for the OpenAI listener only)."""
    try:
        infos = socket.getaddrinfo(
            address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ListenerError(
            f"{CONFIG_KEYS[role]} {address}: cannot resolve {address.host!r}: {exc.strerror}"
        ) from None
    family, kind, proto, _, sockaddr = min(infos, key=lambda info: info[0] != socket.AF_INET)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if role == "openai" and hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ListenerError(_bind_problem(role, address, exc)) from None
    sock.setblocking(False)
    return Listener(role=role, configured=configured, socket=sock)


def adopt_listener(role: Role, configured: str, fd: int) -> Listener:
    """Take over a listening socket inherited as file descriptor `fd`."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    return Listener(role=role, configured=configured, socket=sock)


def _bind_problem(role: Role, address: ListenAddress, exc: OSError) -> str:
    key = CONFIG_KEYS[role]
    if exc.errno == errno.EADDRINUSE:
        hint = {
            "openai": "another process holds it without SO_REUSEPORT",
            "node": "another Edge (or program) listens there; give each replica its own "
            "node address (`iop-edge serve --node-listen HOST:PORT`)",
            "admin": "another Edge (or program) listens there; give each replica its own "
            "admin address (`iop-edge serve --admin-listen HOST:PORT`)",
        }[role]
        return f"{key} {address}: the port is in use ({hint})"
    return f"{key} {address}: {exc.strerror or exc}"
