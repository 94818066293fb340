"""Telling systemd how the Edge process is doing (the `sd_notify` protocol).

A `Type=notify` unit (`iop-edge example iop-edge.service`) gets `$NOTIFY_SOCKET`, a unix
datagram socket, and waits for the service to say `READY=1` before it counts as started.
The Edge says it once it serves: its listeners accept callers, Nodes and admin requests.

The message also carries `MAINPID=`, for a zero-downtime restart (`handover`): the
process that serves after it is the successor, not the one systemd started. Unless the
successor says it is the main process now, systemd takes the old process's exit for the
end of the service, and stops the unit, killing the successor with it. The unit needs
`NotifyAccess=all` for that: the successor speaks before it is the main process. When
stopping, the Edge says `STOPPING=1`, so `systemctl status` shows it draining.

Without `$NOTIFY_SOCKET` (not run by systemd, or another `Type=`) nothing is sent. The
protocol is a few bytes on a datagram socket, so it takes no library; a notification
that cannot be sent is logged and otherwise ignored: serving matters more than telling.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

__all__ = ["NOTIFY_SOCKET_ENV", "notify", "notify_serving", "notify_stopping"]

log = logging.getLogger(__name__)

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"


def notify(*assignments: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Send `assignments` (`"READY=1"`, ...) to systemd; True when a message was sent.

    The socket is local and the message a few bytes, so the send does not wait
    (`MSG_DONTWAIT`): a full socket buffer loses the notification rather than the
    caller's time."""
    address = environ.get(NOTIFY_SOCKET_ENV)
    if not address:
        return False
    if address.startswith("@"):  # Linux abstract namespace
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        log.warning("%s=%s: not a unix socket path; not notifying", NOTIFY_SOCKET_ENV, address)
        return False
    message = "\n".join(assignments).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, socket.MSG_DONTWAIT, address)
    except OSError as exc:
        log.warning("cannot notify the service manager at %s: %s", address, exc)
        return False
    return True


def notify_serving(environ: Mapping[str, str] = os.environ) -> bool:
    """The Edge serves, and this process is the one to supervise (module docstring)."""
    return notify("READY=1", f"MAINPID={os.getpid()}", environ=environ)


def notify_stopping(environ: Mapping[str, str] = os.environ) -> bool:
    return notify("STOPPING=1", environ=environ)
