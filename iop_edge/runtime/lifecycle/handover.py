"""Zero-downtime restart: an Edge process hands its sockets and Nodes to its successor.

`iop-edge restart` (or SIGUSR2 on `iop-edge serve`) makes the running Edge start a new
process of itself: the same command line, so the config file is read afresh and
restart-required changes (listeners, tokens, nodes, adapters) take effect. The two talk
over a socket pair the successor inherits, one JSON object per line:

    old                                      new (the successor)
    spawn with the listening sockets ──────▶ loads the config, opens the ledger,
                                              accepts Nodes on the inherited socket
                         ◀──────────────────  {"event": "listening"} (and, when its
                                              config moved the Node listener, where:
                                              `nodes_moved`)
    refuses a successor that moved the Node
    listener away from linked Nodes (they
    dial the old address); else stops
    accepting Nodes, sends `goaway`
    to each; {"expect_nodes": [...]}  ──────▶ waits until those Nodes linked and
                                              reported status (bounded), then accepts
                                              callers and admin requests
                         ◀──────────────────  {"event": "ready", "pid": ...}
    stops accepting callers; hands its idle
    keep-alive connections and its per-
    minute counters over (`handoff`) ───────▶ serves those connections, counts on
                                              from those counters
    finishes its in-flight runs within the
    grace period (each response closes its
    connection), closes its node links, exits

The sockets are the very same (inherited file descriptions, see `listeners`), so no
connection waiting to be accepted is lost and nobody ever sees a closed port. Until
`ready`, nothing of the old Edge has changed for callers; if the successor fails before
it (an invalid config, a port it cannot bind, a crash; it says why in
`{"event": "failed"}` when it can), the old Edge kills it, accepts Nodes again and goes
on as if nothing happened. The successor continues the revision numbers (old + 1).

`Successor` is the old process's side, `Handover` the new one's (found in the
environment variable `HANDOVER_ENV`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from iop_edge.runtime.lifecycle.handoff import handoff_pair
from iop_edge.runtime.lifecycle.listeners import Listener, Role

__all__ = ["HANDOVER_ENV", "Handover", "HandoverFailed", "Successor"]

log = logging.getLogger(__name__)

HANDOVER_ENV = "IOP_EDGE_HANDOVER"
_MAX_LINE = 64 * 1024


class HandoverFailed(Exception):
    """The successor did not take over; the message says why."""


class _Lines:
    """JSON lines over a stream socket (one side of the control channel)."""

    def __init__(self, sock: socket.socket) -> None:
        self._stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self._buffer = b""

    async def send(self, message: Mapping[str, Any]) -> None:
        await self._stream.send_all(json.dumps(message).encode() + b"\n")

    async def receive(self) -> dict[str, Any] | None:
        """The next message, or None at end of stream."""
        while b"\n" not in self._buffer:
            if len(self._buffer) > _MAX_LINE:
                raise HandoverFailed("the control channel sent an overlong line")
            data = await self._stream.receive_some(_MAX_LINE)
            if not data:
                return None
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            raise HandoverFailed(f"bad control message {line[:80]!r}") from None
        if not isinstance(message, dict):
            raise HandoverFailed(f"bad control message {line[:80]!r}")
        return message

    async def aclose(self) -> None:
        await self._stream.aclose()


# --- the old process's side -------------------------------------------------------------


class Successor:
    """The process that is to take over from this Edge (see the module docstring)."""

    def __init__(
        self,
        argv: Sequence[str],
        listeners: Sequence[Listener],
        *,
        revision: int,
        predecessor: str = "",
    ) -> None:
        """`predecessor`: this Edge's row in the replica roster, which the successor
        counts gone once it serves (`Handover.predecessor`)."""
        self._argv = list(argv)
        self._listeners = list(listeners)
        self._revision = revision
        self._predecessor = predecessor
        self._process: subprocess.Popen[bytes] | None = None
        self._control: _Lines | None = None
        self.handoff: socket.socket | None = None
        """Our end of the handoff channel (`handoff`), once started."""

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def start(self) -> None:
        ours, theirs = socket.socketpair()
        handoff, their_handoff = handoff_pair()
        spec = {
            "control_fd": theirs.fileno(),
            "handoff_fd": their_handoff.fileno(),
            "revision": self._revision,
            "predecessor": self._predecessor,
            "listeners": {
                listener.role: {"fd": listener.socket.fileno(), "listen": listener.configured}
                for listener in self._listeners
            },
        }
        env = {**os.environ, HANDOVER_ENV: json.dumps(spec)}
        fds = (
            theirs.fileno(),
            their_handoff.fileno(),
            *(listener.socket.fileno() for listener in self._listeners),
        )
        try:
            self._process = await trio.to_thread.run_sync(
                lambda: subprocess.Popen(
                    self._argv,
                    env=env,
                    pass_fds=fds,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        except OSError as exc:
            ours.close()
            handoff.close()
            raise HandoverFailed(f"cannot start {self._argv[0]}: {exc.strerror or exc}") from None
        finally:
            theirs.close()
            their_handoff.close()
        self._control = _Lines(ours)
        self.handoff = handoff
        log.info("restart: started the successor (pid %d)", self._process.pid)

    async def wait_listening(self) -> tuple[str, str] | None:
        """Wait until the successor accepts Nodes; where its config moved the Node
        listener from and to, when it did (None: it accepts them where this Edge did)."""
        message = await self._expect("listening")
        moved = message.get("nodes_moved")
        if isinstance(moved, list) and len(moved) == 2:
            return str(moved[0]), str(moved[1])
        return None

    async def expect_nodes(self, node_ids: Sequence[str]) -> None:
        assert self._control is not None
        try:
            await self._control.send({"expect_nodes": list(node_ids)})
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise HandoverFailed(self._exit_reason("before it was told which nodes")) from None

    async def wait_ready(self) -> int:
        message = await self._expect("ready")
        pid = message.get("pid")
        return int(pid) if isinstance(pid, int) else (self.pid or 0)

    async def close(self) -> None:
        """Done with the control channel (the successor lives on)."""
        if self._control is not None:
            await self._control.aclose()
            self._control = None

    def abort(self) -> None:
        """The handover failed: make sure the successor is gone (and reaped)."""
        if self.handoff is not None:
            self.handoff.close()
            self.handoff = None
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("restart: the successor (pid %d) did not exit", process.pid)

    async def _expect(self, event: str) -> dict[str, Any]:
        assert self._control is not None
        message = await self._control.receive()
        if message is None:
            raise HandoverFailed(self._exit_reason(f"before it was {event}"))
        if message.get("event") == "failed":
            raise HandoverFailed(f"the successor failed: {message.get('error', 'no reason given')}")
        if message.get("event") != event:
            raise HandoverFailed(f"the successor said {message!r}, expected {event!r}")
        return message

    def _exit_reason(self, when: str) -> str:
        process = self._process
        status = None if process is None else process.poll()
        if status is None:
            return f"the successor closed its control channel {when}"
        return f"the successor exited with status {status} {when} (see its log)"


# --- the new process's side -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InheritedListener:
    fd: int
    configured: str


class Handover:
    """This process is a successor: what it inherited and how it reports (module docs)."""

    def __init__(
        self,
        control_fd: int,
        revision: int,
        listeners: Mapping[Role, InheritedListener],
        handoff_fd: int | None = None,
        predecessor: str = "",
    ) -> None:
        self.revision = revision
        self.listeners = dict(listeners)
        self.predecessor = predecessor
        """The old Edge's row in the replica roster ("" when it did not say): it takes
        no new request once this process is ready."""
        self._control_fd = control_fd
        self._handoff_fd = handoff_fd
        self._control: _Lines | None = None
        self._nodes_moved: tuple[str, str] | None = None
        """The Node listener's address before and in this config, when they differ."""

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> Handover | None:
        """The handover this process was started for, if any; the variable is removed
        so that a restart of *this* process builds its own."""
        env: MutableMapping[str, str] = os.environ if environ is None else environ
        raw = env.pop(HANDOVER_ENV, None)
        if raw is None:
            return None
        try:
            spec = json.loads(raw)
            listeners: dict[Role, InheritedListener] = {}
            for role in ("openai", "node", "admin"):
                entry = spec["listeners"].get(role)
                if entry is not None:
                    listeners[role] = InheritedListener(int(entry["fd"]), str(entry["listen"]))
            handoff = spec.get("handoff_fd")
            return cls(
                int(spec["control_fd"]),
                int(spec["revision"]),
                listeners,
                None if handoff is None else int(handoff),
                str(spec.get("predecessor") or ""),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HandoverFailed(f"{HANDOVER_ENV} is malformed: {exc!r}") from None

    def take_listener(self, role: Role, configured: str) -> int | None:
        """The inherited socket for `role` when our config still says `configured`
        (else None: the caller binds afresh, and the inherited one is closed)."""
        inherited = self.listeners.pop(role, None)
        if inherited is None:
            return None
        if inherited.configured != configured:
            os.close(inherited.fd)
            if role == "node":
                self._nodes_moved = (inherited.configured, configured)
            return None
        return inherited.fd

    def take_handoff(self) -> socket.socket | None:
        """The successor's end of the handoff channel (`handoff`), once; None when the
        old Edge made none."""
        fd, self._handoff_fd = self._handoff_fd, None
        return None if fd is None else socket.socket(fileno=fd)

    def close_unused(self) -> None:
        for inherited in self.listeners.values():
            os.close(inherited.fd)
        self.listeners.clear()

    def _lines(self) -> _Lines:
        if self._control is None:
            self._control = _Lines(socket.socket(fileno=self._control_fd))
        return self._control

    async def listening(self) -> list[str]:
        """Tell the old Edge we accept Nodes; return the nodes it asks us to wait for."""
        lines = self._lines()
        listening: dict[str, Any] = {"event": "listening"}
        if self._nodes_moved is not None:
            listening["nodes_moved"] = list(self._nodes_moved)
        await lines.send(listening)
        message = await lines.receive()
        if message is None:
            raise HandoverFailed("the old Edge went away during the handover")
        nodes = message.get("expect_nodes", [])
        return [str(node) for node in nodes] if isinstance(nodes, list) else []

    async def ready(self) -> None:
        lines = self._lines()
        await lines.send({"event": "ready", "pid": os.getpid()})
        await lines.aclose()
        self._control = None

    def failed(self, error: str) -> None:
        """Best effort, synchronous (the process is about to exit): say why."""
        try:
            with socket.socket(fileno=os.dup(self._control_fd)) as sock:
                sock.setblocking(True)
                sock.sendall(json.dumps({"event": "failed", "error": error}).encode() + b"\n")
        except OSError:
            pass
