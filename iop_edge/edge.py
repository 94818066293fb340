"""The Edge process's composition root: builds every part, wires them, serves them.

Nothing below this module knows the `Edge`: each part gets only what it needs, as an
object or a callable (the handlers an `AdminServices` or a snapshot getter, the
refresher a `RefreshTarget`, the hub a `NodeDirectory` and three callbacks). The layers
are `core` (pure) < `runtime` (Trio state and tasks) < `http` (the surfaces) < this file.

`Edge` holds the current immutable `Snapshot` (swapped in one step by refresh) and the
long-lived runtime parts that outlive snapshots. `Edge.serve` is a startable service: it
binds the OpenAI listener, the node websocket listener and the loopback-only admin
listener (each may be port 0; or takes them over from the Edge it replaces, see
`runtime.handover`), then reports their URLs via `task_status`.

Stopping (`stop()`, SIGTERM) and handing over to a successor (`restart()`, SIGUSR2) end the
same way: accept nothing more (callers, admin, Nodes), send `goaway` to the Nodes (they
link again, to the successor if there is one, and keep this link for its runs), tell
each keep-alive caller to reconnect on its next request, wait until no request has been
in progress for `DRAIN_LINGER_S` (bounded by the grace period `edge.shutdown_grace_s`),
then cut the runs still open (each caller gets an error event and `[DONE]`, or a 503; each
run its record) and give those exchanges `CUT_WRITE_S` to write their last bytes, close
what is left, write the ledger, close the node links.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig

from iop_edge.core.config import ParsedConfig
from iop_edge.core.host import node_tls_context
from iop_edge.core.listen import parse_listen_address
from iop_edge.core.readiness import Readiness, readiness
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.admin import AdminServices, create_admin_app
from iop_edge.http.final_send import ShieldFinalSend
from iop_edge.http.openai_app import OpenAIApp
from iop_edge.http.runs import RunEndpoints
from iop_edge.http.server import HttpServer
from iop_edge.runtime.lifecycle.handover import Handover, HandoverFailed, Successor
from iop_edge.runtime.lifecycle.listeners import (
    CONFIG_KEYS,
    Listener,
    ListenerError,
    Role,
    adopt_listener,
    bind_listener,
)
from iop_edge.runtime.lifecycle.replicas import ReplicaRoster
from iop_edge.runtime.metering.access_log import AccessLog, RefusedRequest
from iop_edge.runtime.metering.activity import Activity
from iop_edge.runtime.metering.ledger import LedgerUnavailable, choose_ledger
from iop_edge.runtime.metering.metering import Metering, RunRecord
from iop_edge.runtime.metering.metrics import EdgeMetrics
from iop_edge.runtime.nodes.hub import (
    HANDSHAKE_TIMEOUT_S,
    LISTENER_MAX_FRAME_BYTES,
    NodeDirectory,
    NodeHub,
)
from iop_edge.runtime.nodes.node_server import NodeServer
from iop_edge.runtime.nodes.session import SessionClosed
from iop_edge.runtime.refresh.audit import AuditLog
from iop_edge.runtime.refresh.refresh import Refresher, RefreshResult
from iop_edge.runtime.runs.dispatch import Dispatcher
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas import wire
from schemas.config import DEFAULT_SHUTDOWN_GRACE_S, NodeConfig
from schemas.refresh import RefreshRequest, ReplicaStatus, StatusReport
from schemas.restart import RestartReport

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = DEFAULT_SHUTDOWN_GRACE_S
#: After the grace period, how long the cut exchanges have to write their last bytes (an
#: error event and `[DONE]`, or a 503) before what is left is closed.
CUT_WRITE_S = 2.0
#: While draining, how long no request may have been in progress before the remaining
#: keep-alive connections are closed: a client that just got a response sends its next
#: request within this, is answered with `Connection: close`, and reconnects elsewhere.
DRAIN_LINGER_S = 0.5
#: Bound on queueing `goaway` to every node (a node with a full outbox is slow).
GOAWAY_TIMEOUT_S = 2.0
#: A successor must be listening for Nodes within this (imports, config, ledger) ...
HANDOVER_START_TIMEOUT_S = 60.0
#: ... must have the old Edge's Nodes linked within this (else it goes on without) ...
HANDOVER_NODES_TIMEOUT_S = 15.0
#: ... and must say it is ready within this, or the restart fails and nothing changes.
HANDOVER_READY_TIMEOUT_S = HANDOVER_NODES_TIMEOUT_S + 30.0


def hypercorn_config(listen: str, grace_s: float = SHUTDOWN_GRACE_S) -> HypercornConfig:
    """How the Edge configures Hypercorn for a listener (the bench's floor uses it too)."""
    config = HypercornConfig()
    config.bind = [listen]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = grace_s + CUT_WRITE_S
    config.keep_alive_timeout = 75
    config.include_server_header = False
    return config


_edges_in_this_process = itertools.count(1)


def _instance_name() -> str:
    """`HOST/PID` (and `#N` for the Nth Edge of one process: tests, the demo)."""
    number = next(_edges_in_this_process)
    suffix = "" if number == 1 else f"#{number}"
    return f"{socket.gethostname()}/{os.getpid()}{suffix}"


class EdgeStartupError(Exception):
    """The Edge cannot start (e.g. a listener's port is taken)."""


class ListenerUnavailable(EdgeStartupError):
    """A listener could not bind its address; `config_key` is the setting that moves it."""

    def __init__(self, config_key: str, message: str) -> None:
        super().__init__(message)
        self.config_key = config_key


@dataclass(frozen=True, slots=True)
class Listeners:
    """Where to bind, when not where the config says: the demo's free ports, or each
    replica's own node and admin address on a shared host (`serve --node-listen`).

    Kept apart from the config so a refresh compares the config file with the config
    that runs, and does not report the listeners as changed."""

    node: str | None = None
    openai: str | None = None
    admin: str | None = None


@dataclass(frozen=True, slots=True)
class EdgeAddresses:
    openai_url: str
    node_url: str
    admin_url: str


class Edge:
    def __init__(
        self,
        parsed: ParsedConfig,
        *,
        config_path: Path | None = None,
        listeners: Listeners | None = None,
        heartbeat_s: float = 5.0,
        heartbeat_timeout_s: float = 15.0,
        successor_argv: Sequence[str] | None = None,
        handover: Handover | None = None,
    ) -> None:
        """`listeners` override the config's addresses for this process (the demo's free
        ports; each replica on a host needs its own node and admin address);
        `successor_argv` is how to start this
        Edge again (`restart()`; None: it cannot restart itself); `handover` is set when
        this process is the successor of a restarting Edge."""
        config = parsed.config
        revision = handover.revision if handover is not None else 1
        self._snapshot = Snapshot.build(config, revision=revision, config_sha256=parsed.sha256)
        self._config_time = time.time()
        """When the running snapshot was taken: a node serving several Edges runs the
        newest config (SPEC §3 "Several Edges")."""
        self.config_path = config_path
        self.started_unix = int(time.time())
        self.scheduler = Scheduler(self._snapshot)
        self.metrics = EdgeMetrics(self.scheduler.catalog)
        try:
            self._ledger_choice = choose_ledger(config.edge)
        except LedgerUnavailable as exc:
            raise EdgeStartupError(str(exc)) from None
        self._ledger_checked = False
        self.ledger = self._ledger_choice.ledger
        self.metering = Metering(self.metrics, self.ledger)
        self.access_log = AccessLog()
        self.activity = Activity()
        self.hub = NodeHub(
            self._directory,
            on_connect=self.scheduler.node_connected,
            on_disconnect=self.scheduler.node_disconnected,
            on_status=self._on_status,
            on_load=self._on_load,
            heartbeat_s=heartbeat_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
        )
        self.dispatcher = Dispatcher(
            self.scheduler,
            self.hub,
            meter=self._run_finished,
            on_failover=self._count_failover,
            on_busy_answer=self._count_busy_answer,
            retries_before_first_byte=lambda: (
                self._snapshot.config.dispatch.retries_before_first_byte
            ),
        )
        self.refresher = Refresher(
            self, config_path=config_path, audit=AuditLog(Path(config.edge.state_dir))
        )
        overrides = listeners or Listeners()
        self._listen: dict[Role, str] = {
            "openai": overrides.openai or config.openai.listen,
            "node": overrides.node or config.edge.listen,
            "admin": overrides.admin or config.admin.listen,
        }
        self._successor_argv = list(successor_argv) if successor_argv is not None else None
        self._handover = handover
        self._listeners: dict[Role, Listener] = {}
        self._node_server: NodeServer | None = None
        self._stop_requested = trio.Event()
        self._stop_reason = "stopping"
        self._restarting = False
        self._addresses: EdgeAddresses | None = None
        self._instance = _instance_name()
        self.roster = ReplicaRoster(self._ledger_choice.open_replica_store, self._describe)

    # --- RefreshTarget --------------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def swap_snapshot(self, snapshot: Snapshot) -> None:
        """Install a new snapshot in one step (no await): requests see old or new."""
        self._snapshot = snapshot
        self._config_time = time.time()
        self.scheduler.apply_snapshot(snapshot)

    def connected_nodes(self) -> frozenset[str]:
        return self.hub.connected_nodes()

    def applied_revisions(self) -> Mapping[str, int]:
        """The config revision each connected node last acknowledged."""
        return {session.node_id: session.applied_revision for session in self.hub.sessions()}

    async def push_node_config(
        self, node_id: str, revision: int, node_config: NodeConfig
    ) -> wire.RefreshAck | None:
        session = self.hub.session(node_id)
        if session is None:
            return None
        try:
            return await session.request_refresh(revision, node_config, self._config_time)
        except SessionClosed:
            return None

    # --- wiring -------------------------------------------------------------------------

    def _directory(self) -> NodeDirectory:
        snapshot = self._snapshot

        def token_hash(node_id: str) -> str | None:
            node = snapshot.nodes.get(node_id)
            return node.token_hash_sha256 if node else None

        return NodeDirectory(
            edge_id=snapshot.config.edge.id,
            revision=snapshot.revision,
            token_hash=token_hash,
            node_config=snapshot.node_config,
            config_time=self._config_time,
        )

    def _on_status(self, node_id: str, status: wire.Status) -> None:
        for provider in status.providers:
            if self._snapshot.provider_node.get(provider.id) != node_id:
                log.warning(
                    "node %s reported status for provider %s it does not own", node_id, provider.id
                )
                continue
            self.scheduler.provider_status(
                provider.id, provider.health, provider.models, provider.lifecycle, provider.detail
            )

    def _on_load(self, node_id: str, load: wire.Load) -> None:
        """What other Edges hold on this node's providers (SPEC §13)."""
        owner = self._snapshot.provider_node
        for provider in load.providers:
            if owner.get(provider.id) == node_id:
                self.scheduler.provider_load(
                    provider.id, provider.in_flight, provider.long_in_flight
                )

    def _count_failover(self, model_id: str, provider_id: str) -> None:
        self.metrics.failovers.labels(model_id, provider_id).inc()

    def _count_busy_answer(self, model_id: str, provider_id: str) -> None:
        self.metrics.busy_answers.labels(model_id, provider_id).inc()

    def _run_finished(self, record: RunRecord) -> None:
        """Every run's one record: metering, the access log, the pool page's activity."""
        self.metering.record(record)
        self.access_log.run_finished(record)
        self.activity.record(record.status)

    def _request_refused(self, request: RefusedRequest) -> None:
        self.access_log.refused(request)
        self.activity.record(request.status)

    def _admin_services(self) -> AdminServices:
        return AdminServices(
            revision=lambda: self._snapshot.revision,
            status=self.status,
            catalog=self.scheduler.catalog,
            metrics=self.metrics.render,
            usage=self.ledger.aggregate,
            refresh=self.refresh,
            readiness=self.readiness,
            activity=self.activity.report,
            refuse_refresh=self.refresher.refuse_unreadable,
            restart=self.restart,
        )

    # --- observation ------------------------------------------------------------------

    def status(self) -> StatusReport:
        """`GET /status`: the refresher's view, which process answers, and the replicas
        sharing the ledger (as of their last heartbeat)."""
        return msgspec.structs.replace(
            self.refresher.status(), pid=os.getpid(), replicas=self.roster.cached()
        )

    async def refresh(self, request: RefreshRequest) -> RefreshResult:
        """A config refresh (`Refresher`); its report also lists every replica sharing the
        ledger, read after the attempt, so the operator sees which run another config."""
        result = await self.refresher.refresh(request)
        if result.report.outcome in ("applied", "no_change"):
            replicas = await self.roster.publish()
        else:
            replicas = await self.roster.read()
        return RefreshResult(
            result.verdict, msgspec.structs.replace(result.report, replicas=replicas)
        )

    def _describe(self) -> ReplicaStatus:
        """This process, as its row in the replica roster says."""
        snapshot = self._snapshot
        addresses = self._addresses
        return ReplicaStatus(
            instance=self._instance,
            edge_id=snapshot.config.edge.id,
            host=socket.gethostname(),
            pid=os.getpid(),
            state="draining" if self._stop_requested.is_set() else "serving",
            revision=snapshot.revision,
            config_sha256=snapshot.config_sha256,
            pending_restart=list(self.refresher.pending_restart),
            openai_url=addresses.openai_url if addresses else "",
            node_url=addresses.node_url if addresses else "",
            admin_url=addresses.admin_url if addresses else "",
            started_at=float(self.started_unix),
            seen_at=time.time(),
            current=True,
        )

    def readiness(self) -> Readiness:
        """Which models could be served now (`GET /readyz`, `core.readiness`)."""
        return readiness(self.scheduler.catalog())

    def model_servable(self, model_id: str) -> bool:
        """True when some provider of the model can take runs now (`core.readiness`)."""
        return model_id in self.readiness().servable_models

    async def wait_pool_change(self) -> None:
        """Return at the next change of connections, health, slots or queues."""
        await self.scheduler.wait_changed()

    async def wait_model_servable(self, model_id: str) -> None:
        while not self.model_servable(model_id):
            await self.scheduler.wait_changed()

    # --- lifecycle ------------------------------------------------------------------

    def stop(self, reason: str = "stopping") -> None:
        """Begin a graceful stop (module docstring): `serve` returns once drained."""
        if not self._stop_requested.is_set():
            self._stop_reason = reason
            self._stop_requested.set()

    def _node_ssl_context(self) -> ssl.SSLContext | None:
        tls = self._snapshot.config.edge.tls
        if tls is None:
            return None
        try:
            return node_tls_context(tls)  # validation made the same call
        except ValueError as exc:  # the files changed since: say so, not a traceback
            raise EdgeStartupError(f"edge.tls: {exc}") from None

    def open_listeners(self) -> None:
        """Bind every listener (or take over the ones a restarting Edge handed us); raises
        `EdgeStartupError`. `serve` does it when not done before."""
        if not self._listeners:
            self._listeners = self._open_listeners()

    def _open_listeners(self) -> dict[Role, Listener]:
        listeners: dict[Role, Listener] = {}
        handover = self._handover
        try:
            for role in ("node", "openai", "admin"):
                configured = self._listen[role]
                fd = handover.take_listener(role, configured) if handover else None
                if fd is not None:
                    listeners[role] = adopt_listener(role, configured, fd)
                else:
                    address = parse_listen_address(configured)
                    try:
                        listeners[role] = bind_listener(role, configured, address)
                    except ListenerError as exc:
                        raise ListenerUnavailable(CONFIG_KEYS[role], str(exc)) from None
        except EdgeStartupError:
            for listener in listeners.values():
                listener.close()
            raise
        finally:
            if handover is not None:
                handover.close_unused()
        return listeners

    async def check_ledger(self) -> None:
        """Reach the ledger once (PostgreSQL: connect, set up the schema); raises
        `EdgeStartupError` saying why not. `serve` does it when not done before."""
        if self._ledger_checked:
            return
        try:
            await self._ledger_choice.check_reachable()
        except LedgerUnavailable as exc:
            raise EdgeStartupError(str(exc)) from None
        self._ledger_checked = True
        log.info("usage ledger: %s", self._ledger_choice.description)

    async def serve(
        self, *, task_status: trio.TaskStatus[EdgeAddresses] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await self.check_ledger()
        self.open_listeners()
        try:
            await self._serve(self._listeners, task_status)
        finally:
            for listener in self._listeners.values():
                listener.close()

    async def _serve(
        self, listeners: dict[Role, Listener], task_status: trio.TaskStatus[EdgeAddresses]
    ) -> None:
        config = self._snapshot.config
        async with trio.open_nursery() as nursery:
            await nursery.start(self.scheduler.run)
            await nursery.start(self.ledger.run)
            await nursery.start(self.hub.run_heartbeats)
            node_server = self._node_server = NodeServer(
                self.hub.handle,
                listeners["node"],
                self._node_ssl_context(),
                max_message_size=LISTENER_MAX_FRAME_BYTES,
                receive_buffer_size=256 * 1024,
                connect_timeout=HANDSHAKE_TIMEOUT_S,
            )
            node_url = await nursery.start(node_server.serve)
            log.info("node websocket listening on %s", node_url)
            if self._handover is not None:
                await self._take_over_nodes(self._handover)

            runs = RunEndpoints(
                lambda: self._snapshot,
                self.dispatcher,
                self.metering,
                on_refused=self._request_refused,
            )
            openai_app = OpenAIApp(
                runs,
                snapshot=lambda: self._snapshot,
                started_unix=self.started_unix,
                readiness=self.readiness,
            )
            grace_s = config.edge.shutdown_grace_s
            servers = [
                HttpServer(
                    openai_app,
                    hypercorn_config(self._listen["openai"], grace_s),
                    listeners["openai"].socket,
                    send_timeout_s=config.openai.send_timeout_s,
                ),
                HttpServer(
                    ShieldFinalSend(create_admin_app(self._admin_services())),
                    hypercorn_config(self._listen["admin"], grace_s),
                    listeners["admin"].socket,
                ),
            ]
            async with trio.open_nursery() as http:
                openai_url = await http.start(servers[0].serve)
                admin_url = await http.start(servers[1].serve)
                addresses = self._addresses = EdgeAddresses(
                    openai_url=openai_url, node_url=node_url, admin_url=admin_url
                )
                await nursery.start(self.roster.run)
                log.info("OpenAI API listening on %s", addresses.openai_url)
                log.info("admin API listening on %s", addresses.admin_url)
                task_status.started(addresses)
                if self._handover is not None:
                    await self._handover.ready()
                    self._handover = None
                await self._stop_requested.wait()
                await self._drain(servers, grace_s)
            # The HTTP listeners drained (graceful stop): the ledger writes what it holds,
            # then the node side ends too.
            self.ledger.close()
            with trio.move_on_after(grace_s):
                await self.ledger.wait_stopped()
            self.hub.abort_all()
            nursery.cancel_scope.cancel()

    async def _drain(self, servers: Sequence[HttpServer], grace_s: float) -> None:
        """Stop accepting, tell the Nodes, let callers finish, cut the rest (module
        docstring)."""
        log.info("%s: draining in-flight requests", self._stop_reason)
        assert self._node_server is not None
        self._node_server.stop_accepting()
        for server in servers:
            server.stop_accepting()
        with trio.move_on_after(GOAWAY_TIMEOUT_S):
            await self.hub.goaway_all(self._stop_reason)
        await self.roster.publish()  # the roster shows this replica draining
        with trio.move_on_after(grace_s) as grace:
            await self._wait_quiet(servers)
        if grace.cancelled_caught:
            left = sum(server.in_flight for server in servers)
            cut = self.dispatcher.cut_all("the Edge is shutting down")
            log.warning(
                "grace period over with %d request(s) still in progress: %d run(s) cut",
                left,
                cut,
            )
            with trio.move_on_after(CUT_WRITE_S):  # the cut exchanges write their ends
                await self._wait_quiet(servers)
        for server in servers:
            server.terminate()

    @staticmethod
    async def _wait_quiet(servers: Sequence[HttpServer]) -> None:
        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(server.wait_quiet, DRAIN_LINGER_S)

    async def _take_over_nodes(self, handover: Handover) -> None:
        """As a successor: tell the old Edge we take Nodes, then wait (bounded) until the
        Nodes it had linked here and reported their providers' health."""
        expected = set(await handover.listening())
        if not expected:
            return
        with trio.move_on_after(HANDOVER_NODES_TIMEOUT_S):
            while missing := expected - self._nodes_reporting():
                log.debug("restart: waiting for node(s) %s", ", ".join(sorted(missing)))
                await self.scheduler.wait_changed()
        missing = expected - self._nodes_reporting()
        if missing:
            log.warning(
                "restart: node(s) %s did not link within %gs; going on without them",
                ", ".join(sorted(missing)),
                HANDOVER_NODES_TIMEOUT_S,
            )
        else:
            log.info("restart: node(s) %s linked", ", ".join(sorted(expected)))

    def _nodes_reporting(self) -> set[str]:
        """Connected nodes whose every provider has reported a health."""
        waiting = {
            provider.node_id
            for provider in self.scheduler.catalog().providers
            if provider.health == "unknown"
        }
        return {node for node in self.hub.connected_nodes() if node not in waiting}

    async def restart(self) -> RestartReport:
        """Hand over to a new process of this Edge (zero-downtime restart, SPEC §13; see
        `runtime.handover`). Returns once the successor serves (then this Edge drains
        and `serve` returns) or the restart failed (this Edge serves on, unchanged)."""
        pid = os.getpid()
        if self._successor_argv is None:
            detail = (
                "this Edge was not started by `iop-edge serve`, so it cannot start itself again"
            )
            return RestartReport(outcome="refused", pid=pid, detail=detail)
        if self._restarting or self._stop_requested.is_set() or self._node_server is None:
            detail = "a restart or stop is already in progress"
            return RestartReport(outcome="refused", pid=pid, detail=detail)
        self._restarting = True
        revision = self._snapshot.revision + 1
        successor = Successor(
            self._successor_argv, list(self._listeners.values()), revision=revision
        )
        try:
            successor_pid = await self._hand_over(successor, self._node_server)
        except HandoverFailed as exc:
            log.error("restart failed, serving on: %s", exc)
            await trio.to_thread.run_sync(successor.abort)
            self._node_server.resume_accepting()
            return RestartReport(outcome="failed", pid=pid, detail=str(exc))
        finally:
            self._restarting = False
            with trio.move_on_after(1, shield=True):
                await successor.close()
        log.info(
            "restart: the successor (pid %d) serves; this Edge drains and exits", successor_pid
        )
        self.stop("restarting")
        return RestartReport(
            outcome="handed_over",
            pid=pid,
            successor_pid=successor_pid,
            revision=revision,
            detail="the successor serves; this process finishes its in-flight runs and exits",
        )

    async def _hand_over(self, successor: Successor, node_server: NodeServer) -> int:
        try:
            with trio.fail_after(HANDOVER_START_TIMEOUT_S):
                await successor.start()
                await successor.wait_listening()
        except trio.TooSlowError:
            raise HandoverFailed(
                f"the successor was not listening within {HANDOVER_START_TIMEOUT_S:g}s"
            ) from None
        node_server.stop_accepting()
        with trio.move_on_after(GOAWAY_TIMEOUT_S):
            await self.hub.goaway_all("restarting")
        try:
            with trio.fail_after(HANDOVER_READY_TIMEOUT_S):
                await successor.expect_nodes(sorted(self.hub.connected_nodes()))
                return await successor.wait_ready()
        except trio.TooSlowError:
            raise HandoverFailed(
                f"the successor was not ready within {HANDOVER_READY_TIMEOUT_S:g}s"
            ) from None
