"""Lightweight Nodes: many Node connections from one process, for the many-Nodes scenario.

A real Node builds an adapter per provider, probes its upstreams and runs requests; one
process per Node would make a thousand of them cost more than the Edge they are meant to
load. A light Node speaks only what a connected, healthy, idle Node says on the runtime
wire (`schemas.wire`), so the Edge does exactly the work it does for real Nodes:

- `hello` with its id and token; after `welcome`, one `status` with every provider of its
  `node_config` `available` (serving the models configured for it);
- for every `refresh`: `refresh_ack{ok}` for its revision, then a `status` for the new
  providers (a real Node's health monitor reports after a refresh too);
- a `run` (the scenario routes none) gets `run_failed{internal}`: there is no upstream;
- every `heartbeat_s` the Edge announced in `welcome`, at the node's instant of the
  shared grid (`schemas.heartbeat`), a ping to the Edge, as a real Node's keepalive
  sends (`iop_node.uplink.link`); the Edge's pings are answered by
  trio-websocket itself, as for a real Node.

At most `handshakes` connections are in their handshake at once: the Edge refuses more
than 16 unauthenticated peers at a time (HTTP 503), as it should.

    python -m bench.light_nodes --edge ws://HOST:PORT --nodes-file FILE [--handshakes 4]
                                [--niceness N]

`--niceness N` adds `N` to the process's scheduling niceness (`os.nice`) before it
connects: the light Nodes stand in for a fleet on machines of its own, and on the one
machine the scenario shares, the operating system then gives a busy core to the Edge
(and the callers' Node) first, as a fleet's own machines would leave it to them.

`FILE` holds `{"node id": "token", ...}` as JSON: tokens never go on a command line. The
process prints `light-nodes ready: N nodes` once every Node was welcomed and sent its
status, and serves until stopped (SIGTERM/SIGINT). A Node the Edge rejects ends the
process with `light-nodes failed: ...`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Final

import trio
from trio_websocket import (
    ConnectionClosed,
    HandshakeError,
    WebSocketConnection,
    connect_websocket_url,
)

from iop_edge.runtime.nodes.handshakes import MAX_PENDING_HANDSHAKES_PER_SOURCE
from schemas import wire
from schemas.config import NodeConfig
from schemas.heartbeat import seconds_to_next_ping

READY_PREFIX: Final = "light-nodes ready: "
FAILED_PREFIX: Final = "light-nodes failed: "
#: All light Nodes dial from one address: at most the Edge's per-source bound of pending
#: handshakes at once, so none is evicted by its siblings.
DEFAULT_HANDSHAKES: Final = MAX_PENDING_HANDSHAKES_PER_SOURCE
_HANDSHAKE_TIMEOUT_S: Final = 30.0
#: A handshake the Edge answers "try again later" (1013) is tried again, after a pause
#: that grows by this much each time, this many times in all.
_HANDSHAKE_PAUSE_S: Final = 0.05
_HANDSHAKE_ATTEMPTS: Final = 5
_TRY_AGAIN_LATER: Final = 1013
_MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024


class LightNodeRejected(Exception):
    """The Edge did not welcome a light Node: the scenario's config or tokens are wrong."""


@dataclass
class FleetProgress:
    """Shared by every light Node of one process: how many the Edge has welcomed."""

    welcomed: int = 0


def status_of(config: NodeConfig) -> wire.Status:
    """What a healthy, idle Node reports: every provider available with its models."""
    return wire.Status(
        providers=[
            wire.ProviderStatus(id=p.id, health="available", models=list(p.models))
            for p in config.providers
        ]
    )


async def _handshake(
    nursery: trio.Nursery, edge_url: str, node_id: str, token: str
) -> tuple[WebSocketConnection, wire.Welcome]:
    """Hello and welcome; again, after a pause, while the Edge says to try again later
    (its bound of pending handshakes per source is shared with the scenario's real Node,
    which dials from the same host)."""
    for attempt in range(1, _HANDSHAKE_ATTEMPTS + 1):
        try:
            return await _handshake_once(nursery, edge_url, node_id, token)
        except ConnectionClosed as closed:
            later = closed.reason is not None and closed.reason.code == _TRY_AGAIN_LATER
            if not later or attempt == _HANDSHAKE_ATTEMPTS:
                raise
        await trio.sleep(_HANDSHAKE_PAUSE_S * attempt)
    raise AssertionError("unreachable")


async def _handshake_once(
    nursery: trio.Nursery, edge_url: str, node_id: str, token: str
) -> tuple[WebSocketConnection, wire.Welcome]:
    ws = await connect_websocket_url(nursery, edge_url, max_message_size=_MAX_MESSAGE_BYTES)
    hello = wire.Hello(
        protocol=wire.PROTOCOL_VERSION, node_id=node_id, token=token, agent_version="light"
    )
    await ws.send_message(wire.encode(hello))
    try:
        message = wire.decode_from_edge(await ws.get_message())
    except wire.WireError as exc:
        raise LightNodeRejected(f"node {node_id}: the Edge's answer to hello: {exc}") from None
    if isinstance(message, wire.Reject):
        raise LightNodeRejected(f"node {node_id}: {message.code}: {message.reason}")
    if not isinstance(message, wire.Welcome):
        raise LightNodeRejected(f"node {node_id}: expected welcome, got {type(message).__name__}")
    return ws, message


async def _serve(ws: WebSocketConnection) -> None:
    """Answer the Edge until the connection ends."""
    try:
        while True:
            try:
                message = wire.decode_from_edge(await ws.get_message())
            except wire.WireError:
                continue  # a message this minimal Node does not know: not its business
            match message:
                case wire.Refresh():
                    ack = wire.RefreshAck(revision=message.revision, ok=True)
                    await ws.send_message(wire.encode(ack))
                    await ws.send_message(wire.encode(status_of(message.node_config)))
                case wire.Run():
                    failed = wire.RunFailed(
                        run_id=message.run_id,
                        code=wire.FailureCode.INTERNAL,
                        message="a light Node has no upstream",
                    )
                    await ws.send_message(wire.encode(wire.RunEvents(ends=[failed])))
                case _:
                    pass  # cancel, a late welcome: nothing to do
    except ConnectionClosed:
        return


async def light_node(
    edge_url: str,
    node_id: str,
    token: str,
    handshakes: trio.CapacityLimiter,
    progress: FleetProgress,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One light Node: handshake (within `handshakes`), report status, serve until closed."""
    async with trio.open_nursery() as connection:
        async with handshakes:
            with trio.fail_after(_HANDSHAKE_TIMEOUT_S):
                ws, welcome = await _handshake(connection, edge_url, node_id, token)
                await ws.send_message(wire.encode(status_of(welcome.node_config)))
        progress.welcomed += 1
        task_status.started()
        connection.start_soon(_keepalive, ws, node_id, welcome.heartbeat_s)
        await _serve(ws)
        connection.cancel_scope.cancel()


async def _keepalive(ws: WebSocketConnection, node_id: str, interval_s: float) -> None:
    """Ping the Edge every `interval_s` at the node's instant of the shared grid, as a
    real Node does (its answer is not checked: a light Node that lost its Edge ends with
    the connection)."""
    try:
        while True:
            await trio.sleep(seconds_to_next_ping(node_id, interval_s, time.time()))
            await ws.ping()
    except ConnectionClosed:
        return


async def run_light_nodes(
    edge_url: str,
    credentials: Mapping[str, str],
    *,
    handshakes: int = DEFAULT_HANDSHAKES,
    task_status: trio.TaskStatus[FleetProgress] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Connect one light Node per `credentials` entry (node id -> token) and serve them.

    Startable: reports started (with the shared progress) once every Node is welcomed
    and has sent its status."""
    progress = FleetProgress()
    limiter = trio.CapacityLimiter(handshakes)
    async with trio.open_nursery() as nodes:
        async with trio.open_nursery() as connecting:
            for node_id, token in credentials.items():
                connecting.start_soon(
                    partial(nodes.start, light_node, edge_url, node_id, token, limiter, progress)
                )
        task_status.started(progress)


# --- process entry point ------------------------------------------------------------------------


async def _serve_process(edge_url: str, credentials: Mapping[str, str], handshakes: int) -> None:
    async with trio.open_nursery() as nursery:
        progress = await nursery.start(
            partial(run_light_nodes, edge_url, credentials, handshakes=handshakes)
        )
        # Thousands of connections are this process's heap: kept out of the collector's
        # sight (as the Edge keeps its own), a refresh's acks do not bring collections
        # that walk them all, and the light Nodes' pauses are not the Edge's pushes'.
        gc.collect()
        gc.freeze()
        print(f"{READY_PREFIX}{progress.welcomed} nodes", flush=True)


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.light_nodes",
        description="Many lightweight Nodes on one Edge (the many-Nodes bench scenario).",
    )
    parser.add_argument("--edge", required=True, help="the Edge's node URL, ws://HOST:PORT")
    parser.add_argument(
        "--nodes-file", required=True, type=Path, help='JSON {"node id": "token", ...}'
    )
    parser.add_argument("--handshakes", type=int, default=DEFAULT_HANDSHAKES)
    parser.add_argument(
        "--niceness", type=int, default=0, help="added to the process's niceness (os.nice)"
    )
    args = parser.parse_args(argv)
    if args.niceness < 0:
        parser.error("--niceness must be >= 0 (a light Node never outranks the Edge)")
    credentials = json.loads(args.nodes_file.read_text(encoding="utf-8"))
    if not isinstance(credentials, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in credentials.items()
    ):
        parser.error(f"{args.nodes_file}: expected a JSON object of node id -> token")
    if args.niceness:
        os.nice(args.niceness)
    failure: BaseException | None = None
    try:
        try:
            trio.run(_serve_process, args.edge, credentials, args.handshakes)
        except* (LightNodeRejected, HandshakeError, OSError, trio.TooSlowError) as group:
            failure = _first_leaf(group)
    except KeyboardInterrupt:
        return 130
    if failure is not None:
        print(f"{FAILED_PREFIX}{type(failure).__name__}: {failure}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
