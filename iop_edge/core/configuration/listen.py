"""Listen addresses: the one parser of `HOST:PORT` and the loopback rules built on it.

Config validation parses every `*.listen` with `parse_listen_address` (so a bad address
fails `check-config`, not `serve`), the Edge binds what it parsed, and the admin API's
Host check uses the same notion of loopback as the listener rule (design §5.1).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Final

__all__ = ["ListenAddress", "is_loopback", "is_loopback_host_header", "parse_listen_address"]


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A parsed `HOST:PORT`; `host` carries no brackets (`::1`, not `[::1]`)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.url_host}:{self.port}"

    @property
    def url_host(self) -> str:
        """The host as it appears in a URL: an IPv6 address in brackets."""
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def is_loopback(self) -> bool:
        return is_loopback(self.host)

    def clashes_with(self, other: ListenAddress) -> bool:
        """Whether binding both would fail: one port (not 0, "any free"), the same host
        or a wildcard on either side."""
        wildcards = ("0.0.0.0", "::")
        return self.port == other.port != 0 and (
            self.host == other.host or self.host in wildcards or other.host in wildcards
        )


_PORT_TEXT: Final = re.compile(r"[0-9]{1,5}")
_HOST_LABEL: Final = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME: Final = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*")
_DOTTED_NUMBERS: Final = re.compile(r"[0-9.]+")


def parse_listen_address(text: str) -> ListenAddress:
    """Split `HOST:PORT` (an IPv6 host in brackets: `[::1]:8080`). Port 0 means "any free".

    Raises `ValueError` with a message that says what is wrong and what is expected.
    """
    host, colon, port_text = text.rpartition(":")
    if not colon or not host:
        raise ValueError("must be HOST:PORT, like 127.0.0.1:7700 or [::1]:7700")
    if not _PORT_TEXT.fullmatch(port_text) or int(port_text) > 65535:
        raise ValueError("port must be a number from 0 to 65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"'{host}' in brackets is not an IPv6 address") from None
    elif ":" in host or "[" in host or "]" in host:
        raise ValueError("an IPv6 host must be in brackets, like [::1]:7700")
    elif _DOTTED_NUMBERS.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"'{host}' is not an IPv4 address") from None
    elif not _HOST_NAME.fullmatch(host):
        raise ValueError(f"'{host}' is not a valid host name or IP address")
    return ListenAddress(host=host, port=int(port_text))


def is_loopback(host: str) -> bool:
    """Whether `host` (no brackets) names this machine only: `localhost` or a loopback IP."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_host_header(value: str) -> bool:
    """Whether an HTTP `Host` header value (`name`, `name:port`, `[v6]:port`) is loopback."""
    if value.startswith("["):
        host = value[1 : value.find("]")]
    else:
        host = value.rsplit(":", 1)[0] if value.count(":") == 1 else value
    return is_loopback(host)
