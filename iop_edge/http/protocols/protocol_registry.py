"""The caller protocols the Edge serves, found in one place (design §14): by a run
endpoint's path, by name, or, for a request outside the run endpoints, by whose client
sent it.

`PROTOCOLS` holds the built-in ones (`chat`, `messages`, `responses`); `register` adds
another (a `CallerProtocol` in its own module, with the Node's translator of the same
name), and nothing else needs to know it exists. A path or a name is served by one
protocol only: registering a second one for it is refused.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Final, NamedTuple

from iop_edge.http.protocols.caller_protocol import CallerProtocol
from iop_edge.http.protocols.chat import CHAT
from iop_edge.http.protocols.messages import MESSAGES
from iop_edge.http.protocols.responses import RESPONSES
from schemas import wire

__all__ = ["PROTOCOLS", "Protocols", "Route"]


class Route(NamedTuple):
    """What a run endpoint serves: its protocol, and the operation of its runs."""

    protocol: CallerProtocol
    operation: wire.Operation


class Protocols:
    """The registry of caller protocols (see the module docstring)."""

    def __init__(self, protocols: Iterable[CallerProtocol], default: CallerProtocol) -> None:
        self._by_name: dict[str, CallerProtocol] = {}
        self._routes: dict[str, Route] = {}
        self._default = default
        for protocol in protocols:
            self.register(protocol)

    def register(self, protocol: CallerProtocol) -> None:
        """Serve `protocol` from now on; `ValueError` when its name or one of its paths is
        another protocol's."""
        if protocol.name in self._by_name:
            raise ValueError(f"a caller protocol named {protocol.name!r} is registered already")
        taken = sorted(path for path in protocol.paths if path in self._routes)
        if taken:
            raise ValueError(f"{', '.join(taken)}: served by another caller protocol already")
        self._by_name[protocol.name] = protocol
        for path, operation in protocol.paths.items():
            self._routes[path] = Route(protocol, operation)

    def unregister(self, name: str) -> None:
        """Serve the protocol named `name` no more (a protocol a test registered)."""
        protocol = self._by_name.pop(name)
        for path in protocol.paths:
            del self._routes[path]

    def route(self, path: str) -> Route | None:
        """The protocol and operation of a run endpoint; None when `path` is none."""
        return self._routes.get(path)

    def paths(self) -> list[str]:
        """Every run endpoint's path."""
        return list(self._routes)

    def named(self, name: str) -> CallerProtocol:
        """The protocol of that name (`KeyError` when none is registered)."""
        return self._by_name[name]

    def of_request(self, path: str, header_names: Collection[str]) -> CallerProtocol:
        """The protocol whose shapes a request outside the run endpoints gets (an error, a
        model list): the first that claims it, else chat's (OpenAI's shapes)."""
        for protocol in self._by_name.values():
            if protocol.claims(path, header_names):
                return protocol
        return self._default


PROTOCOLS: Final = Protocols((CHAT, MESSAGES, RESPONSES), default=CHAT)
