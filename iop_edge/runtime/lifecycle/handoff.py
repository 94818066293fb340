"""What a restarting Edge hands its successor besides the listening sockets: its idle
client connections and its per-minute limit counters (design §13).

A keep-alive connection the old Edge closes while its client sends the next request on
it loses that request: the close and the request cross on the wire, and the client gets
a reset with no response. No moment to close an idle connection is safe. So the old
Edge does not close them: at the drain it passes each idle one, as it is, to the
successor (the socket's descriptor over a Unix socket, `SCM_RIGHTS`), and the successor
serves it from then on. Bytes a client sent meanwhile wait in the kernel for whichever
process reads the socket next: the successor. A connection is passed only when the old
Edge has read nothing of a next request (its parser holds no bytes, see
`connection.Connection.hand_off`); the others finish here and close after their
response, which says `Connection: close`.

The channel is a `SOCK_SEQPACKET` socket pair made at the restart (its far end
inherited by the successor, `HANDOVER_ENV`'s `handoff_fd`), one message each:

- `C<role>` with one descriptor: a client connection of the `openai` or `admin` port.
- `L<json>`: per principal, what the old Edge's per-minute buckets had used
  (`{"alice": [requests, tokens], ...}`, `PrincipalLimiter.windows`), sent once its
  drain began, so the successor's limits go on from there (`carry_over`), not from a
  fresh minute.

The old Edge's sends never wait (non-blocking; the successor reads as they come): a
send that fails closes that connection here, as before, and logs. The successor reads
until the old Edge closes its end (it exits) or the successor itself stops.
"""

from __future__ import annotations

import array
import json
import logging
import socket
from collections.abc import Callable, Mapping
from typing import Final, Protocol

import trio

__all__ = ["HandoffSender", "HasFileno", "Windows", "handoff_pair", "receive_handoff"]

log = logging.getLogger(__name__)

_CONNECTION: Final = b"C"
_LIMITS: Final = b"L"
#: The largest message (the counters of many principals are sent in several).
MAX_MESSAGE: Final = 60 * 1024
#: Room in the channel for the old Edge's sends (it never waits for the successor).
SEND_BUFFER: Final = 4 * 1024 * 1024
_FD_SPACE: Final = socket.CMSG_SPACE(array.array("i").itemsize)

Windows = Mapping[str, tuple[float, float]]


class HasFileno(Protocol):
    """A socket, stdlib or Trio's."""

    def fileno(self) -> int: ...


def handoff_pair() -> tuple[socket.socket, socket.socket]:
    """(the old Edge's end, the successor's end)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    except OSError:  # the system's cap applies
        pass
    ours.setblocking(False)
    return ours, theirs


class HandoffSender:
    """The old Edge's end of the channel (module docstring). `windows` says what the
    per-minute buckets used, read once the drain began (`send_windows`)."""

    def __init__(self, sock: socket.socket, windows: Callable[[], Windows]) -> None:
        self._socket = sock
        self._windows = windows
        self.connections = 0
        """Connections handed over."""
        self._broken = False

    def send_connection(self, role: str, connection: HasFileno) -> bool:
        """Hand `connection` (a client socket of the `role` port) over; never waits.
        False when it could not be sent (the caller closes it as before)."""
        if self._broken:
            return False
        fds = array.array("i", [connection.fileno()])
        try:
            self._socket.sendmsg(
                [_CONNECTION + role.encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
            )
        except OSError as exc:
            self._fail(exc)
            return False
        self.connections += 1
        return True

    def send_windows(self) -> None:
        """Send what the per-minute buckets used (module docstring); never waits."""
        windows = dict(self._windows())
        names = sorted(windows)
        while names and not self._broken:
            part: dict[str, tuple[float, float]] = {}
            size = 0
            while names and size < MAX_MESSAGE // 2:
                name = names.pop()
                part[name] = windows[name]
                size += len(name) + 48
            try:
                self._socket.send(_LIMITS + json.dumps(part).encode())
            except OSError as exc:
                self._fail(exc)

    def close(self) -> None:
        self._socket.close()

    def _fail(self, exc: OSError) -> None:
        if not self._broken:
            self._broken = True
            log.warning("restart: cannot hand connections to the successor (%s)", exc)


async def receive_handoff(
    sock: socket.socket,
    *,
    adopt: Callable[[str, socket.socket], None],
    carry_over: Callable[[Windows], None],
) -> None:
    """The successor's end: adopt each connection handed over, carry each window over,
    until the old Edge closes its end. The caller owns the task (and cancels it when it
    stops itself); `sock` is closed at the end."""
    channel = trio.socket.from_stdlib_socket(sock)
    with channel:
        while True:
            data, ancillary, _, _ = await channel.recvmsg(MAX_MESSAGE, _FD_SPACE)
            fds: list[int] = []
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                    fds.extend(received)
            if not data and not fds:
                return  # the old Edge closed its end
            if data[:1] == _CONNECTION and fds:
                role = data[1:].decode(errors="replace")
                for fd in fds:
                    adopt(role, socket.socket(fileno=fd))
                continue
            for fd in fds:  # not a connection message: nothing to adopt
                socket.close(fd)
            if data[:1] == _LIMITS:
                try:
                    carried = json.loads(data[1:])
                except ValueError:
                    log.warning("restart: the old Edge sent unreadable limit counters")
                    continue
                carry_over(_windows_of(carried))


def _windows_of(value: object) -> dict[str, tuple[float, float]]:
    """The well-formed entries of a carried `L` message."""
    windows: dict[str, tuple[float, float]] = {}
    if not isinstance(value, dict):
        return windows
    for name, entry in value.items():
        if (
            isinstance(name, str)
            and isinstance(entry, list)
            and len(entry) == 2
            and all(isinstance(x, int | float) and not isinstance(x, bool) for x in entry)
        ):
            windows[name] = (float(entry[0]), float(entry[1]))
    return windows
