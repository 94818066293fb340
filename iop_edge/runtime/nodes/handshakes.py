"""Who may wait in a node handshake: anonymous peers, bounded so they can never lock out a Node.

Between the websocket upgrade and a `hello` that checks out, a peer is anonymous: it
holds a connection, a task and a message buffer, and proves nothing. Refusing newcomers
when a fixed number of such peers wait (the first design) lets anyone who keeps that
number of idle upgrades open lock every Node out, token or no token. Instead:

Rules:
1. A handshake is bounded in time by its caller (the hub's handshake deadline), and the
   upgrade before it by the listener's connect timeout.
2. At most `per_source` handshakes wait per source (an IPv4 address, an IPv6 /64). A
   newcomer from a source at its cap evicts that source's oldest handshake: an address
   can only ever crowd out itself.
3. At most `total` handshakes wait at once. A newcomer when the table is full evicts the
   oldest handshake of all.
4. Nobody is ever refused: admission always succeeds, at the price of the longest
   waiting anonymous peer. A Node needs its slot for one round trip (upgrade answered,
   `hello` sent); an idle holder is always the oldest. To evict a Node mid-handshake, a
   peer must open `total` upgrades within that round trip from at least
   `total / per_source` addresses, and the Node's reconnect backoff simply tries again.
5. An evicted handshake's cancel scope is cancelled; its owner closes the connection.

This module holds no sockets: the hub admits a ticket, runs the handshake inside the
ticket's scope and releases it when the handshake ends, whatever the outcome.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Final

import trio

__all__ = [
    "MAX_PENDING_HANDSHAKES",
    "MAX_PENDING_HANDSHAKES_PER_SOURCE",
    "GateStatistics",
    "HandshakeGate",
    "HandshakeTicket",
    "source_key",
]

MAX_PENDING_HANDSHAKES: Final = 64
MAX_PENDING_HANDSHAKES_PER_SOURCE: Final = 4


def source_key(address: object) -> str:
    """The source a peer is counted under: its IPv4 address, or its IPv6 /64 (one host
    usually owns a whole /64). Anything that is not an IP (a Unix socket) is one source."""
    try:
        ip = ipaddress.ip_address(str(address))
    except ValueError:
        return str(address)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class HandshakeTicket:
    """One admitted handshake; run it inside `scope` (cancelled on eviction)."""

    __slots__ = ("evicted", "scope", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.scope = trio.CancelScope()
        self.evicted = False


@dataclass(frozen=True, slots=True)
class GateStatistics:
    pending: int
    sources: int
    evicted: int
    """Handshakes evicted since the gate was made (Rules 2 and 3)."""


class HandshakeGate:
    """The table of waiting handshakes (see the module docstring)."""

    def __init__(
        self,
        *,
        total: int = MAX_PENDING_HANDSHAKES,
        per_source: int = MAX_PENDING_HANDSHAKES_PER_SOURCE,
    ) -> None:
        if total < 1 or per_source < 1:
            raise ValueError("handshake limits must be >= 1")
        self._total = total
        self._per_source = per_source
        # Insertion order is admission order: the first entry is the oldest.
        self._pending: dict[HandshakeTicket, None] = {}
        self._by_source: dict[str, dict[HandshakeTicket, None]] = {}
        self._evicted = 0

    def admit(self, source: str) -> HandshakeTicket:
        """A ticket for a new handshake from `source`, evicting an older one if needed."""
        mine = self._by_source.get(source)
        if mine is not None and len(mine) >= self._per_source:
            self._evict(next(iter(mine)))  # Rule 2
        elif len(self._pending) >= self._total:
            self._evict(next(iter(self._pending)))  # Rule 3
        ticket = HandshakeTicket(source)
        self._pending[ticket] = None
        self._by_source.setdefault(source, {})[ticket] = None
        return ticket

    def release(self, ticket: HandshakeTicket) -> None:
        """The handshake ended (any outcome); releasing twice is harmless."""
        if ticket not in self._pending:
            return
        del self._pending[ticket]
        mine = self._by_source[ticket.source]
        del mine[ticket]
        if not mine:
            del self._by_source[ticket.source]

    def statistics(self) -> GateStatistics:
        return GateStatistics(
            pending=len(self._pending), sources=len(self._by_source), evicted=self._evicted
        )

    def _evict(self, ticket: HandshakeTicket) -> None:
        self.release(ticket)
        ticket.evicted = True
        ticket.scope.cancel()
        self._evicted += 1
