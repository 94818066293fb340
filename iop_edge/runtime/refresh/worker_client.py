"""The Edge's side of the refresh worker (`refresh.worker`): start it, ask it, restart it.

Rules:
1. The worker is started on first use, as `python -m iop_edge.procedures.refresh_worker`
   (`refresh.worker` with the ledger's check) with this interpreter, and lives on
   between refreshes (it keeps the running config and the last proof: `worker`, Rule 1).
2. A worker that exits, answers what is not a frame, speaks another protocol version, or
   is cancelled mid-request (its caller's deadline: a hang) is killed and forgotten, and
   the request raises `WorkerFailed` saying which; the next request starts a new one
   (so does a request that finds its worker ended while idle). The running config is
   the Edge's, so nothing of it is lost.
3. It is told the base config only when it does not hold that revision
   (`worker_protocol`, Rule 2).
4. `aclose` stops it, bounded: its input closes and it ends; one that does not is killed.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any, Final

import msgspec
import trio

from iop_edge.runtime.refresh.worker_protocol import (
    HEADER_BYTES,
    PIECE_ITEMS,
    PLAN_LISTS,
    VERSION,
    Failed,
    Hello,
    Invalid,
    Plan,
    Prepare,
    Prepared,
    Reply,
    frame,
)
from schemas.config import EdgeConfig
from schemas.refresh import Change

__all__ = ["WORKER_MODULE", "RefreshWorker", "WorkerFailed"]

#: The module the worker runs: named, not imported (it sits above the runtime).
WORKER_MODULE: Final = "iop_edge.procedures.refresh_worker"
#: How long a stopping worker gets to end before it is killed (Rule 4).
STOP_GRACE_S: Final = 5.0
#: Characters of an inline candidate in one frame (`worker_protocol`, Rule 4).
TEXT_PIECE_CHARS: Final = 256 * 1024
#: Base Nodes encoded and written at a time.
NODES_AT_ONCE: Final = 256
#: Read from the worker's stdout at a time.
_CHUNK: Final = 1 << 20

_DECODE_REPLY: Final = msgspec.msgpack.Decoder(Reply)
_DECODE_CHANGES: Final = msgspec.msgpack.Decoder(list[Change])
_DECODE_NAMES: Final = msgspec.msgpack.Decoder(list[str])
#: Decode the pieces of a plan's long lists, in `PLAN_LISTS` order.
_DECODE_PLAN_LISTS: Final[tuple[Callable[[bytes], list[Any]], ...]] = (
    _DECODE_CHANGES.decode,
    _DECODE_NAMES.decode,
    _DECODE_NAMES.decode,
)
_ENCODER: Final = msgspec.msgpack.Encoder()


class WorkerFailed(Exception):
    """The worker did not answer a request (Rule 2); the message says why."""


class _Running:
    """One started worker and what it holds."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.buffer = bytearray()
        self.holds: set[int] = set()


class RefreshWorker:
    """The refresh worker process of one Edge (module docstring)."""

    def __init__(self, command: list[str] | None = None) -> None:
        """`command` runs the worker (tests give a broken one); by default this Python's
        `-m iop_edge.procedures.refresh_worker`."""
        self._command = command or [sys.executable, "-m", WORKER_MODULE]
        self._running: _Running | None = None
        self._lock = trio.Lock()
        """One request at a time (`worker_protocol`, Rule 1)."""
        self.starts = 0
        """Workers started so far: a restart after a failure shows here."""

    async def prepare(
        self, request: Prepare, base: EdgeConfig, *, config_yaml: str | None = None
    ) -> Prepared | Invalid:
        """Send `request` (with `base` when the worker does not hold its revision, and an
        inline candidate `config_yaml`) and wait for the answer. Raises `WorkerFailed`
        (Rule 2); the caller bounds the wait with a cancel scope, and a cancelled request
        stops the worker."""
        async with self._lock:
            return await self._prepare(request, base, config_yaml)

    async def _prepare(
        self, request: Prepare, base: EdgeConfig, config_yaml: str | None
    ) -> Prepared | Invalid:
        running = self._running
        if running is not None and running.process.poll() is not None:
            await self._stop(running, kill=True)  # it ended while idle: start another
            running = None
        done = False
        try:
            if running is None:
                running = await self._start()
            send_base = request.base_revision not in running.holds
            if send_base:
                rest = _ENCODER.encode(msgspec.structs.replace(base, nodes=[]))
                request = msgspec.structs.replace(
                    request, base_config=rest, base_nodes=len(base.nodes)
                )
            if config_yaml is not None:
                pieces = -(-len(config_yaml) // TEXT_PIECE_CHARS)
                request = msgspec.structs.replace(request, text_pieces=pieces)
            stdin = running.process.stdin
            assert stdin is not None
            try:
                await stdin.send_all(frame(_ENCODER.encode(request)))
                if send_base:
                    await _send_nodes(stdin, base)
                if config_yaml is not None:
                    await _send_text(stdin, config_yaml)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                code = running.process.poll()
                raise WorkerFailed(
                    f"the refresh worker stopped reading (exit code {code})"
                ) from exc
            reply = await _receive(running)
            if isinstance(reply, Failed):
                raise WorkerFailed(f"the refresh worker failed: {reply.message}")
            if isinstance(reply, Hello):
                raise WorkerFailed("the refresh worker said hello twice")
            if isinstance(reply, Prepared):
                plan = await _receive_plan(running, reply.plan)
                reply = msgspec.structs.replace(reply, plan=plan)
            if isinstance(reply, Prepared) and reply.built is not None:
                nodes = await _receive_nodes(running, len(reply.built.changed))
                built = msgspec.structs.replace(reply.built, nodes=nodes)
                reply = msgspec.structs.replace(reply, built=built)
            running.holds = {request.base_revision}
            if isinstance(reply, Prepared) and reply.built is not None:
                running.holds.add(request.base_revision + 1)
            done = True
            return reply
        finally:
            if not done and running is not None:
                await self._stop(running, kill=True)

    @property
    def process(self) -> trio.Process | None:
        """The running worker's process, if one runs (for diagnostics and tests)."""
        return None if self._running is None else self._running.process

    async def _start(self) -> _Running:
        process = await trio.lowlevel.open_process(
            self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        running = self._running = _Running(process)
        self.starts += 1
        started = False
        try:
            hello = await _receive(running)
            if not isinstance(hello, Hello) or hello.version != VERSION:
                got = hello.version if isinstance(hello, Hello) else type(hello).__name__
                raise WorkerFailed(
                    f"the refresh worker speaks protocol {got}, this Edge {VERSION}: "
                    "is the install half upgraded?"
                )
            started = True
            return running
        finally:
            if not started:
                await self._stop(running, kill=True)

    async def aclose(self) -> None:
        """Stop the worker, if one runs (Rule 4)."""
        if self._running is not None:
            await self._stop(self._running, kill=False)

    async def _stop(self, running: _Running, *, kill: bool) -> None:
        if self._running is running:
            self._running = None
        process = running.process
        with trio.move_on_after(STOP_GRACE_S, shield=True) as scope:
            if kill:
                process.kill()
            elif process.stdin is not None:
                await process.stdin.aclose()
            await process.wait()
        if scope.cancelled_caught:
            process.kill()
            with trio.move_on_after(STOP_GRACE_S, shield=True):
                await process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with trio.move_on_after(STOP_GRACE_S, shield=True):
                    await stream.aclose()


async def _send_nodes(stdin: trio.abc.SendStream, base: EdgeConfig) -> None:
    """The base's Nodes, a frame each, `NODES_AT_ONCE` to a write (`worker_protocol`,
    Rule 2)."""
    nodes = base.nodes
    for start in range(0, len(nodes), NODES_AT_ONCE):
        batch = b"".join(
            frame(_ENCODER.encode(node)) for node in nodes[start : start + NODES_AT_ONCE]
        )
        await stdin.send_all(batch)


async def _send_text(stdin: trio.abc.SendStream, text: str) -> None:
    """An inline candidate, `TEXT_PIECE_CHARS` characters to a frame (Rule 4)."""
    for start in range(0, len(text), TEXT_PIECE_CHARS):
        await stdin.send_all(frame(text[start : start + TEXT_PIECE_CHARS].encode("utf-8")))


async def _receive(running: _Running) -> Reply:
    """The worker's next message (Rule 2 for what is not one)."""
    size = int.from_bytes(await _take(running, HEADER_BYTES), "big")
    payload = await _take(running, size)
    try:
        return _DECODE_REPLY.decode(payload)
    except msgspec.DecodeError as exc:
        raise WorkerFailed(f"the refresh worker answered what is not a reply: {exc}") from exc


async def _receive_plan(running: _Running, plan: Plan) -> Plan:
    """`plan` with its long lists, whose pieces follow the reply (`worker_protocol`, Rule
    5), decoded a piece a step."""
    if len(plan.lengths) != len(PLAN_LISTS):
        raise WorkerFailed("the refresh worker answered a plan without its lists' lengths")
    lists: list[list[Any]] = []
    for length, decode in zip(plan.lengths, _DECODE_PLAN_LISTS, strict=True):
        items: list[Any] = []
        for _ in range(0, length, PIECE_ITEMS):
            await trio.lowlevel.checkpoint()
            size = int.from_bytes(await _take(running, HEADER_BYTES), "big")
            try:
                items += decode(await _take(running, size))
            except msgspec.DecodeError as exc:
                raise WorkerFailed(f"the refresh worker answered a broken plan: {exc}") from exc
        lists.append(items)
    await trio.lowlevel.checkpoint()
    return plan.joined(lists)


async def _receive_nodes(running: _Running, count: int) -> list[bytes]:
    """The `count` frames of changed Nodes that follow a built reply (`worker_protocol`,
    Rule 3), with a checkpoint every `NODES_AT_ONCE` of them: what arrived already is
    read without waiting, and a fleet's would otherwise be one step."""
    nodes: list[bytes] = []
    for index in range(count):
        if index % NODES_AT_ONCE == NODES_AT_ONCE - 1:
            await trio.lowlevel.checkpoint()
        size = int.from_bytes(await _take(running, HEADER_BYTES), "big")
        nodes.append(await _take(running, size))
    return nodes


async def _take(running: _Running, size: int) -> bytes:
    stdout = running.process.stdout
    assert stdout is not None
    buffer = running.buffer
    while len(buffer) < size:
        try:
            chunk = await stdout.receive_some(_CHUNK)
        except trio.BrokenResourceError:
            chunk = b""
        if not chunk:
            code = await running.process.wait()
            raise WorkerFailed(f"the refresh worker exited (code {code}) without answering")
        buffer += chunk
    taken = bytes(buffer[:size])
    del buffer[:size]
    return taken
