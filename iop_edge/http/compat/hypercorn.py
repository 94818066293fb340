"""Hypercorn: every internal the Edge's HTTP layer builds on, named in this one module.

Hypercorn's public API serves an app on sockets it binds itself (`hypercorn.trio.serve`)
and stops them in one step. The Edge needs more: listeners it owns and drains in steps
(`server`), writes without a task switch and a keep-alive timer of its own
(`connection`, `keep_alive`), strict request framing (`framing`). So it builds on
Hypercorn 0.18's own parts, the way `hypercorn.trio.run.worker_serve` does:

- `TCPServer` (`hypercorn.trio.tcp_server`), one connection's handler, used through
  `HypercornConnection`: its constructor, `run`, `protocol_send`, `stream`, `protocol`
  (a `ProtocolWrapper` whose `protocol` is the HTTP/1.1 or HTTP/2 protocol and which
  keeps the arguments it was built with), `send_lock` (the `trio.Lock` around each of
  its writes), `idle_task` (its keep-alive timeout, a `SingleTask`: `restart(task_group,
  action)` and `stop()`), `_read_data` (its reading loop) and `_initiate_server_close`.
- `H11Protocol` (`hypercorn.protocol.h11`), used through `Http11Protocol`: its
  constructor, `config`, `connection` (the `h11.Connection` it parses with),
  `_send_h11_event`, `_send_error_response` and `_check_protocol` (which switches a
  connection to HTTP/2).
- `TaskGroup.spawn_app` (`hypercorn.trio.task_group`): an app's ASGI `receive` is the
  `receive` of a bounded `trio.MemoryReceiveChannel` that the connection's protocol
  fills, so what it already holds can be taken without a wait (`queued_receiver`).
- `WorkerContext` (its `terminated` event), `Lifespan` (`handle_lifespan`,
  `wait_for_startup`, `wait_for_shutdown`), `wrap_app` and `repr_socket_addr`
  (`hypercorn.utils`), and the events `Closed`, `RawData` and `Event`.

`KNOWN_VERSIONS` are the releases these are known to exist in with these meanings;
`missing_capabilities()` lists what the installed Hypercorn lacks of them, and
`tests/compat/test_hypercorn.py` fails with that list (on the classes and on a real
connection handler) when an upgrade took something away. Where only the fast path is
missing (`send_lock`), connections step aside to Hypercorn's own writes
(`HypercornConnection.write_lock` is None).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from importlib.metadata import version
from typing import Any, Final

import h11
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext
from hypercorn.utils import repr_socket_addr, wrap_app

__all__ = [
    "HYPERCORN_VERSION",
    "KNOWN_VERSIONS",
    "Closed",
    "Event",
    "Http11Protocol",
    "HypercornConnection",
    "Lifespan",
    "RawData",
    "WorkerContext",
    "missing_capabilities",
    "queued_receiver",
    "repr_socket_addr",
    "wrap_app",
]

#: The Hypercorn releases whose internals this module is known to work with.
KNOWN_VERSIONS: Final = ("0.18.",)
HYPERCORN_VERSION: Final = version("hypercorn")


class HypercornConnection(TCPServer):
    """Hypercorn's connection handler with its private parts behind names: subclasses
    override the hooks `reading_begins` and `reading_ended` and call the rest."""

    async def _read_data(self) -> None:  # Hypercorn's reading loop, called from `run`
        self.reading_begins()
        try:
            await super()._read_data()
        finally:
            self.reading_ended()

    def reading_begins(self) -> None:
        """Hook: the connection's protocol is built and nothing was read yet."""

    def reading_ended(self) -> None:
        """Hook: the connection stopped reading (its client closed it, or we did)."""

    @property
    def write_lock(self) -> trio.Lock | None:
        """The lock Hypercorn holds around each of its writes (`send_lock`); None on a
        Hypercorn that keeps none, where nothing may write beside it."""
        lock = getattr(self, "send_lock", None)
        return lock if isinstance(lock, trio.Lock) else None

    def replace_idle_task(self, task: Any) -> None:
        """Time the keep-alive with `task` (a `restart(task_group, action)` / `stop()`
        object) instead of Hypercorn's `TrioSingleTask`."""
        self.idle_task = task

    def release_protocol(self) -> None:
        """Let go of the connection's protocol once `run` returned: Hypercorn builds it
        with the connection's `protocol_send`, a cycle that only the cyclic collector
        would free; without it the connection is freed by reference counting alone."""
        self.__dict__.pop("protocol", None)
        self.__dict__.pop("_task_group", None)

    async def close_from_server(self) -> None:
        """Close the connection as Hypercorn's keep-alive timeout does."""
        await self._initiate_server_close()

    def replace_http11_protocol(self, protocol_class: type[Http11Protocol]) -> None:
        """Serve this connection with `protocol_class`, built with the arguments Hypercorn
        built its HTTP/1.1 protocol with. Call it from `reading_begins` (nothing read
        yet); a connection Hypercorn serves with HTTP/2 keeps its protocol."""
        wrapper = self.protocol
        if type(wrapper.protocol) is H11Protocol:
            wrapper.protocol = protocol_class(
                wrapper.app,
                wrapper.config,
                wrapper.context,
                wrapper.task_group,
                wrapper.state,
                wrapper.ssl,
                wrapper.client,
                wrapper.server,
                wrapper.send,
            )


class Http11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol with its private parts behind names: subclasses
    override `send_error_response` and call `send_h11_event`."""

    async def _send_error_response(self, status_code: int) -> None:  # called by Hypercorn
        await self.send_error_response(status_code)

    async def _check_protocol(self, event: h11.Request) -> None:  # called by Hypercorn
        await self.check_protocol(event)

    async def check_protocol(self, request: h11.Request) -> None:
        """Switch to HTTP/2 where `request` asks for it (Hypercorn's own, unless
        overridden)."""
        await super()._check_protocol(request)

    async def send_error_response(self, status_code: int) -> None:
        """Answer a request h11 refused (Hypercorn's own answer unless overridden)."""
        await super()._send_error_response(status_code)

    async def send_h11_event(self, event: h11.Response | h11.Data | h11.EndOfMessage) -> None:
        """Send one event of a response through the connection's h11 state machine."""
        await self._send_h11_event(event)


def queued_receiver(receive: Callable[..., Any]) -> Callable[[], Any] | None:
    """What takes the next ASGI message `receive` holds without waiting (raising
    `trio.WouldBlock` when none is there yet): the `receive_nowait` of the memory channel
    whose `receive` Hypercorn gave the app. None for any other `receive` (another server,
    a test's), which only the awaited path reads."""
    channel = getattr(receive, "__self__", None)
    if isinstance(channel, trio.MemoryReceiveChannel) and receive == channel.receive:
        return channel.receive_nowait
    return None


#: (owner, name, parameters after `self`) of every method reached above.
_METHODS: Final[tuple[tuple[type, str, tuple[str, ...]], ...]] = (
    (TCPServer, "run", ()),
    (TCPServer, "protocol_send", ("event",)),
    (TCPServer, "_read_data", ()),
    (TCPServer, "_initiate_server_close", ()),
    (H11Protocol, "_send_h11_event", ("event",)),
    (H11Protocol, "_send_error_response", ("status_code",)),
    (H11Protocol, "_check_protocol", ("event",)),
    (TrioSingleTask, "restart", ("task_group", "action")),
    (TrioSingleTask, "stop", ()),
    (Lifespan, "handle_lifespan", ("task_status",)),
    (Lifespan, "wait_for_startup", ()),
    (Lifespan, "wait_for_shutdown", ()),
)
#: Constructor parameters after `self`, as `HypercornConnection` and `Http11Protocol`
#: are built.
_CONSTRUCTORS: Final[tuple[tuple[type, tuple[str, ...]], ...]] = (
    (TCPServer, ("app", "config", "context", "state", "stream")),
    (
        H11Protocol,
        (
            "app",
            "config",
            "context",
            "task_group",
            "connection_state",
            "ssl",
            "client",
            "server",
            "send",
        ),
    ),
)


def missing_capabilities() -> list[str]:
    """What this module uses and the installed Hypercorn's classes lack, one line each
    (empty when everything is there). The attributes a connection handler sets when it
    is built (`send_lock`, `idle_task`, `protocol`) are checked on a real one by
    `tests/compat/test_hypercorn.py`."""
    missing: list[str] = []
    if not HYPERCORN_VERSION.startswith(KNOWN_VERSIONS):
        missing.append(f"Hypercorn {HYPERCORN_VERSION} is not one of {', '.join(KNOWN_VERSIONS)}x")
    for owner, name, parameters in _METHODS:
        method = getattr(owner, name, None)
        if not callable(method):
            missing.append(f"{owner.__name__}.{name}() is gone")
        elif _parameters(method)[: len(parameters)] != parameters:
            missing.append(f"{owner.__name__}.{name}() no longer takes {', '.join(parameters)}")
    for owner, parameters in _CONSTRUCTORS:
        if tuple(inspect.signature(owner).parameters) != parameters:
            missing.append(f"{owner.__name__}() no longer takes ({', '.join(parameters)})")
    return missing


def _parameters(function: Any) -> tuple[str, ...]:
    """The names of `function`'s parameters after `self`."""
    names = tuple(inspect.signature(function).parameters)
    return names[1:] if names[:1] == ("self",) else names
