"""The Edge process's composition root: builds every part, wires them, serves them.

Nothing below this module knows the `Edge`: each part gets only what it needs, as an
object or a callable (the handlers an `AdminServices` or a snapshot getter, the
refresher a `RefreshTarget`, the hub a `NodeDirectory` and three callbacks). The layers
are `core` (pure) < `runtime` (Trio state and tasks) < `http` (the surfaces) < this file.

`Edge` holds the current immutable `Snapshot` (swapped in one step by refresh) and the
long-lived runtime parts that outlive snapshots. `Edge.serve` is a startable service: it
binds the OpenAI listener, the node websocket listener and the loopback-only admin
listener (each may be port 0; or takes them over from the Edge it replaces, see
`runtime.lifecycle.handover`), builds the servers on them, and runs them with the
`procedures.serve` procedure, which reports their URLs via `task_status`.

This module wires; the procedures run elsewhere, each in the module named after it
(`iop_edge.procedures`): serving, draining (how a stop, `stop()` or SIGTERM, ends),
restarting (`restart()`, SIGUSR2: handing over to a successor) and a successor's taking
over of the Nodes.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Final

import msgspec
import trio

from iop_edge import __version__
from iop_edge.core.configuration.config import ParsedConfig
from iop_edge.core.configuration.listen import parse_listen_address
from iop_edge.core.peer_text import logged
from iop_edge.core.routing.readiness import Readiness, readiness_of
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.admin_api.admin import create_admin_app
from iop_edge.http.admin_api.admin_services import AdminServices
from iop_edge.http.final_send import ShieldFinalSend
from iop_edge.http.openai_app import OpenAIApp
from iop_edge.http.protocols.responses import ResponsesSurface
from iop_edge.http.runs import RunEndpoints
from iop_edge.http.server import HttpServer, hypercorn_config
from iop_edge.procedures.drain import CUT_WRITE_S
from iop_edge.procedures.restart import Restarter
from iop_edge.procedures.serve import EdgeAddresses, EdgeParts, StopRequest, serve
from iop_edge.runtime.lifecycle.admin_credential import (
    ADMIN_TOKEN_FILE,
    AdminCredentialUnusable,
    load_or_create,
)
from iop_edge.runtime.lifecycle.handoff import HandoffSender
from iop_edge.runtime.lifecycle.handover import Handover
from iop_edge.runtime.lifecycle.heap_keeper import HeapKeeper
from iop_edge.runtime.lifecycle.host_checks import node_tls_context
from iop_edge.runtime.lifecycle.listeners import (
    Listener,
    ListenerError,
    Listeners,
    Role,
    adopt_listener,
    bind_listener,
    first_clash,
)
from iop_edge.runtime.lifecycle.port_claim import CallerPortClaim, PortShared, own_identity
from iop_edge.runtime.lifecycle.replicas import ReplicaRoster
from iop_edge.runtime.metering.access_log import AccessLog, RefusedRequest
from iop_edge.runtime.metering.activity import Activity, ActivityReport
from iop_edge.runtime.metering.books import RunBooks
from iop_edge.runtime.metering.ledger import LedgerUnavailable, choose_ledger
from iop_edge.runtime.metering.metering import Metering, RunRecord
from iop_edge.runtime.metering.metrics import EdgeMetrics
from iop_edge.runtime.metering.response_store import ResponseStore
from iop_edge.runtime.metering.tracing import edge_tracing
from iop_edge.runtime.metering.usage_ledger.shared_budgets import SharedBudgets
from iop_edge.runtime.metering.usage_ledger.usage_store import UsageReport
from iop_edge.runtime.models.commands import ModelCommands
from iop_edge.runtime.models.keeper import ModelKeeper
from iop_edge.runtime.nodes.heartbeat import fleet_interval
from iop_edge.runtime.nodes.hub import (
    HANDSHAKE_TIMEOUT_S,
    LISTENER_MAX_FRAME_BYTES,
    NodeDirectory,
    NodeHub,
)
from iop_edge.runtime.nodes.node_server import NodeServer
from iop_edge.runtime.nodes.session import NodeSession
from iop_edge.runtime.refresh.audit import AuditLog
from iop_edge.runtime.refresh.push import AckListener
from iop_edge.runtime.refresh.refresh import Refresher, RefreshResult
from iop_edge.runtime.runs.dispatch import Dispatcher
from iop_edge.runtime.runs.limits import LedgerTotals, PrincipalLimiter
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas import wire
from schemas.channel import RECEIVE_BUFFER_BYTES
from schemas.config import DEFAULT_SHUTDOWN_GRACE_S, NodeConfig
from schemas.principals import PrincipalsReport
from schemas.refresh import RefreshRequest, ReplicaStatus, StatusReport
from schemas.restart import RestartReport
from schemas.runtime.telemetry import TelemetryError, provider_name

log = logging.getLogger(__name__)

#: How many providers a Node claims but does not own one log line names.
_STRANGERS_LOGGED: Final = 5

__all__ = [
    "SHUTDOWN_GRACE_S",
    "Edge",
    "EdgeAddresses",
    "EdgeStartupError",
    "ListenerUnavailable",
    "Listeners",
]

SHUTDOWN_GRACE_S = DEFAULT_SHUTDOWN_GRACE_S


def _not_the_node_port(port: str, node_url: str) -> str:
    """What a websocket upgrade on one of the Edge's HTTP ports is told."""
    return (
        f"This is the IOP Edge's {port}, not its node listener: Nodes connect to "
        f"edge.listen, {node_url}"
    )


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
        newest config (design §3 "Several Edges")."""
        self.config_path = config_path
        self.started_unix = int(time.time())
        self.scheduler = Scheduler(self._snapshot)
        self.limiter = PrincipalLimiter(lambda: self._snapshot.policies)
        self.metrics = EdgeMetrics(
            self.scheduler.catalog, self._principal_load, provider_name=self._provider_name
        )
        try:
            self._ledger_choice = choose_ledger(config.edge)
        except LedgerUnavailable as exc:
            raise EdgeStartupError(str(exc)) from None
        self._ledger_checked = False
        self.ledger = self._ledger_choice.ledger
        self.metering = Metering(self.metrics, self.ledger, self.scheduler.cache_shares)
        self.metrics.watch_ledger(self.ledger.statistics)
        self.responses = ResponseStore(self._ledger_choice.responses, config.edge.responses)
        self.metrics.watch_responses(self.responses.statistics)
        self.activity = Activity(queue_depth=self.scheduler.queue_depths)
        self.books = RunBooks(self.metering, AccessLog(), self.activity)
        """Ended requests' metrics, access lines and activity, entered in batches."""
        self.heap = HeapKeeper()
        """Keeps the fleet's sessions out of the collector's sight (`lifecycle.heap`)."""
        self.metrics.watch_heap(self.heap.statistics)
        self.hub = NodeHub(
            self._directory,
            on_connect=self._node_connected,
            on_disconnect=self._node_disconnected,
            on_status=self._on_status,
            on_load=self._on_load,
            on_ack=self._on_ack,
            on_ended=self._session_ended,
            # An idle fleet's pings cost the Edge in proportion to their rate: a large
            # fleet pings less often (`heartbeat.fleet_interval`).
            heartbeat_s=fleet_interval(heartbeat_s, len(config.nodes)),
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
            limits=self.limiter,
        )
        self.refresher = Refresher(
            self,
            config_path=config_path,
            audit=AuditLog(Path(config.edge.state_dir)),
            running_text=parsed.text,
            hold=self.heap.held,
            blocked=self._refresh_blocked,
        )
        self.model_commands = ModelCommands(
            snapshot=lambda: self._snapshot,
            providers=self.scheduler.catalog_providers,
            session_of=self.hub.session,
            state_dir=Path(config.edge.state_dir),
        )
        self.model_keeper = ModelKeeper(
            snapshot=lambda: self._snapshot,
            providers=self.scheduler.catalog_providers,
            session_of=self.hub.session,
            commands=self.model_commands,
            pin_models=self.scheduler.pin_models,
        )
        overrides = listeners or Listeners()
        self._listen: dict[Role, str] = {
            "openai": overrides.openai or config.openai.listen,
            "node": overrides.node or config.edge.listen,
            "admin": overrides.admin or config.admin.listen,
        }
        self._listen_from = overrides.sources()
        """Where each listener's address comes from: a config key, or a flag that moved it."""
        self._handover = handover
        self._listeners: dict[Role, Listener] = {}
        self._inherited: set[Role] = set()
        """The listeners a restarting Edge handed over (not bound here)."""
        self._port_claim: CallerPortClaim | None = None
        self._http_servers: tuple[HttpServer, ...] = ()
        self._node_server: NodeServer | None = None
        self._admin_token = ""
        """The admin credential, read as the Edge starts (`load_admin_credential`)."""
        self._admin_token_path = Path(ADMIN_TOKEN_FILE)
        self._stop = StopRequest()
        self._restarter = Restarter(
            successor_argv,
            goaway_all=self.hub.goaway_all,
            connected_nodes=self.hub.connected_nodes,
            windows=self.limiter.windows,
            refreshing=lambda: self.refresher.statistics().busy,
        )
        self._addresses: EdgeAddresses | None = None
        self._instance = _instance_name()
        try:
            self.tracing = edge_tracing(
                config.edge.telemetry,
                os.environ,
                instance_id=self._instance,
                version=__version__,
                provider_name=self._provider_name,
            )
        except TelemetryError as exc:
            raise EdgeStartupError(str(exc)) from None
        """The Edge's OpenTelemetry traces; None when off (`metering.tracing`)."""
        if self.tracing is not None:
            log.info("traces: exported to %s", self.tracing.endpoint)
        self.roster = ReplicaRoster(
            self._ledger_choice.open_replica_store, self._describe, on_read=self._replicas_seen
        )
        open_budgets = self._ledger_choice.open_budgets
        self.budgets = None if open_budgets is None else SharedBudgets(open_budgets(self._instance))
        """Daily budgets reserved in the ledger replicas share (limits Rule 7)."""
        self.limiter.shared_budgets = self.budgets

    # --- RefreshTarget --------------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def swap_snapshot(self, snapshot: Snapshot) -> None:
        """Install a new snapshot in one step (no await): requests see old or new."""
        self._snapshot = snapshot
        self._config_time = time.time()
        self.scheduler.apply_snapshot(snapshot)
        self.model_keeper.look()

    def connected_nodes(self) -> frozenset[str]:
        return self.hub.connected_nodes()

    def applied_revisions(self) -> Mapping[str, int]:
        """The config revision each connected node last acknowledged."""
        return {session.node_id: session.applied_revision for session in self.hub.sessions()}

    async def push_node_config(
        self, node_id: str, revision: int, node_config: NodeConfig, answer: AckListener
    ) -> None:
        session = self.hub.session(node_id)
        if session is None:
            answer(None)
            return
        await session.push_refresh(revision, node_config, self._config_time, answer)

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

    def _node_connected(self, node_id: str) -> None:
        self.scheduler.node_connected(node_id)
        session = self.hub.session(node_id)
        if session is not None:  # it runs the config its welcome carried
            self.scheduler.config_applied(node_id, session.applied_revision)
        self.heap.node_connected()
        self.model_keeper.look()

    def _node_disconnected(self, node_id: str) -> None:
        self.scheduler.node_disconnected(node_id)
        self.heap.node_disconnected()
        self.model_keeper.look()

    def _session_ended(self, session: NodeSession) -> None:
        self.heap.session_ended(session, f"node {session.node_id}")

    def _on_ack(self, node_id: str, ack: wire.RefreshAck) -> None:
        if ack.ok:
            self.scheduler.config_applied(node_id, ack.revision)
        else:
            self.scheduler.config_refused(node_id, ack.revision)

    def _on_status(self, node_id: str, status: wire.Status) -> None:
        owner = self._snapshot.provider_node
        strangers: list[str] = []
        with self.scheduler.reports():  # the Node's providers, then the waiters once
            for provider in status.providers:
                if owner.get(provider.id) != node_id:
                    strangers.append(provider.id)
                    continue
                self.scheduler.provider_status(
                    provider.id,
                    provider.health,
                    provider.models,
                    provider.lifecycle,
                    provider.detail,
                    protocols=provider.protocols,
                    model_states=provider.model_states,
                    max_loaded=provider.max_loaded,
                )
        if status.probed:  # the probes it answers, of its own providers only
            self.dispatcher.revival.answered(p for p in status.probed if owner.get(p) == node_id)
        self.model_keeper.reported(provider.id for provider in status.providers)
        if strangers:  # one line a report, however many it names
            log.warning(
                "node %s reported status for %d provider(s) it does not own: %s",
                node_id,
                len(strangers),
                ", ".join(logged(provider_id) for provider_id in strangers[:_STRANGERS_LOGGED]),
            )

    def _on_load(self, node_id: str, load: wire.Load) -> None:
        """What other Edges hold on this node's providers (design §13)."""
        owner = self._snapshot.provider_node
        for provider in load.providers:
            if owner.get(provider.id) == node_id:
                self.scheduler.provider_load(
                    provider.id, provider.in_flight, provider.long_in_flight
                )

    def _count_failover(self, model_id: str, provider_id: str, reason: str) -> None:
        self.metrics.failovers.labels(model_id, provider_id, reason).inc()

    def _provider_name(self, provider_id: str) -> str:
        """`gen_ai.provider.name` of a provider of the running config (metrics, traces)."""
        provider = self._snapshot.providers.get(provider_id)
        return provider_name(provider) if provider is not None else provider_id

    def _count_busy_answer(self, model_id: str, provider_id: str) -> None:
        self.metrics.busy_answers.labels(model_id, provider_id).inc()

    def _run_finished(self, record: RunRecord) -> None:
        """Every run's one record: billed now (before its caller's last byte), and kept
        for the books (metrics, the access log, the pool page's activity)."""
        self.metering.bill(record)
        self.books.add(record)

    def metrics_text(self) -> bytes:
        """`GET /metrics`: every finished run counted (books Rule 3)."""
        self.books.settle()
        return self.metrics.render()

    def _activity_report(self) -> ActivityReport:
        self.books.settle()
        return self.activity.report()

    def _request_refused(self, request: RefusedRequest) -> None:
        self.books.refused(request)

    def _admin_services(self) -> AdminServices:
        return AdminServices(
            revision=lambda: self._snapshot.revision,
            status=self.status,
            catalog=self.scheduler,
            metrics=self.metrics_text,
            usage=self.usage,
            principals=self.principals,
            refresh=self.refresh,
            readiness=self.readiness,
            activity=self._activity_report,
            refuse_refresh=self.refresher.refuse_unreadable,
            restart=self.restart,
            model_command=partial(self.model_keeper.command, source="admin API"),
            admin_token=self._admin_token,
            admin_token_path=str(self._admin_token_path),
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
            state="draining" if self._stop.requested else "serving",
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
        """Which models could be served now, and whether runs can be metered (`GET
        /readyz`, `core.routing.readiness`)."""
        models = self.scheduler.snapshot.models
        state = readiness_of(
            {model_id: model.providers for model_id, model in models.items()},
            self.scheduler.catalog_provider,
        )
        unmetered = self.metering.refusal()
        return state if unmetered is None else state.unready(unmetered)

    def model_servable(self, model_id: str) -> bool:
        """True when some provider of the model can take runs now (`core.routing.readiness`)."""
        return model_id in self.readiness().servable_models

    async def wait_pool_change(self) -> None:
        """Return at the next change of connections, health, slots or queues."""
        await self.scheduler.wait_changed()

    async def wait_model_servable(self, model_id: str) -> None:
        while not self.model_servable(model_id):
            await self.scheduler.wait_changed()

    # --- lifecycle ------------------------------------------------------------------

    def stop(self, reason: str = "stopping", handoff: HandoffSender | None = None) -> None:
        """Begin a graceful stop (`procedures.drain`): `serve` returns once drained. A
        restart's `handoff` takes the idle connections and per-minute counters."""
        self._stop.request(reason, handoff)

    def stop_now(self, reason: str) -> int:
        """Cut every run still open as the Edge's (`shutting_down`); returns how many.
        The process ends soon after: `answered` says when their callers have been told."""
        return self.dispatcher.cut_all(reason)

    async def answered(self) -> None:
        """Return once no caller or admin request is in progress: each one cut by
        `stop_now` has written its 503, or its error event and `[DONE]`. The caller
        bounds the wait (a stalled caller's write, a long poll)."""
        for server in self._http_servers:
            await server.wait_quiet(0)

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
            clash = first_clash(self._listen, self._listen_from)
            if clash is not None:
                raise EdgeStartupError(clash)
            for role in ("node", "openai", "admin"):
                configured = self._listen[role]
                fd = handover.take_listener(role, configured) if handover else None
                if fd is not None:
                    listeners[role] = adopt_listener(role, configured, fd)
                    self._inherited.add(role)
                else:
                    address = parse_listen_address(configured)
                    try:
                        listeners[role] = bind_listener(role, configured, address)
                    except ListenerError as exc:
                        raise ListenerUnavailable(self._listen_from[role], str(exc)) from None
        except EdgeStartupError:
            for listener in listeners.values():
                listener.close()
            raise
        finally:
            if handover is not None:
                handover.close_unused()
        return listeners

    async def claim_caller_port(self) -> None:
        """Claim the caller port by name (`runtime.lifecycle.port_claim`): only a replica
        of the same config, or this Edge's restart successor, may share it. Raises
        `EdgeStartupError` naming the other Edge. `serve` does it when not done before."""
        if self._port_claim is not None:
            return
        config_file = "" if self.config_path is None else str(self.config_path.resolve())
        identity = own_identity(self._instance, self._snapshot.config_sha256, config_file)
        claim = partial(
            CallerPortClaim.claim,
            self._listeners["openai"].socket,
            identity,
            inherited="openai" in self._inherited,
        )
        try:
            # In a thread: the claim's holder may be an Edge of this very process.
            self._port_claim = await trio.to_thread.run_sync(claim)
        except PortShared as exc:
            raise EdgeStartupError(str(exc)) from None

    async def _hold_caller_port(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Answer who holds the caller port's claim, or take it over when its holder
        exits, for this Edge's life (a service of `procedures.serve`)."""
        assert self._port_claim is not None
        task_status.started()
        await self._port_claim.serve()

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
        """Serve until stopped and drained (`procedures.serve`); startable (reports the
        addresses once every listener accepts)."""
        await self.check_ledger()
        await self.load_admin_credential()
        self.open_listeners()
        try:
            await self.claim_caller_port()
            parts = self._build(self._listeners)
            self._http_servers = (parts.openai, parts.admin)
            await serve(
                parts,
                stop=self._stop,
                grace_s=self._snapshot.config.edge.shutdown_grace_s,
                handover=self._handover,
                on_listening=self._listening,
                task_status=task_status,
            )
        finally:
            if self._port_claim is not None:
                self._port_claim.close()
            for listener in self._listeners.values():
                listener.close()
            if self.tracing is not None:
                await self.tracing.aclose()  # the last spans leave (bounded)

    async def load_admin_credential(self) -> None:
        """The credential every admin change presents (`lifecycle.admin_credential`),
        made at the first start; raises `EdgeStartupError`."""
        state_dir = Path(await trio.Path(self._snapshot.config.edge.state_dir).absolute())
        try:
            self._admin_token = await trio.to_thread.run_sync(load_or_create, state_dir)
        except AdminCredentialUnusable as exc:
            raise EdgeStartupError(f"the admin credential: {exc}") from None
        self._admin_token_path = state_dir / ADMIN_TOKEN_FILE
        log.info(
            "admin credential: %s (a change through the admin API presents it; the "
            "iop-edge commands read it, or take --admin-token-file)",
            self._admin_token_path,
        )

    def _build(self, listeners: Mapping[Role, Listener]) -> EdgeParts:
        """The servers on `listeners`, wired to the long-lived parts."""
        config = self._snapshot.config
        node_server = self._node_server = NodeServer(
            self.hub.handle,
            listeners["node"],
            self._node_ssl_context(),
            max_message_size=LISTENER_MAX_FRAME_BYTES,
            receive_buffer_size=RECEIVE_BUFFER_BYTES,
            connect_timeout=HANDSHAKE_TIMEOUT_S,
        )
        responses = ResponsesSurface(self.responses)
        runs = RunEndpoints(
            lambda: self._snapshot,
            self.dispatcher,
            self.metering,
            responses,
            on_refused=self._request_refused,
            tracing=self.tracing,
        )
        openai_app = OpenAIApp(
            runs,
            snapshot=lambda: self._snapshot,
            started_unix=self.started_unix,
            readiness=self.readiness,
            responses=responses,
        )
        grace_s = config.edge.shutdown_grace_s
        return EdgeParts(
            services=(
                self._hold_caller_port,
                self.scheduler.run,
                self.ledger.run,
                self.books.run,  # enters ended requests in batches while it runs
                # Today's budgets are read before anything is served (limits Rule 3).
                partial(self.limiter.run, LedgerTotals(self.ledger), shared=self._ledger_shared),
                *(() if self.budgets is None else (self.budgets.run,)),
                self.responses.run,
                self.hub.run_heartbeats,
                self.refresher.catch_up.run,
                self.refresher.run,  # owns the refresh worker process
                self.heap.run,
                self.model_keeper.run,
            ),
            scheduler=self.scheduler,
            ledger=self.ledger,
            hub=self.hub,
            dispatcher=self.dispatcher,
            roster=self.roster,
            node_server=node_server,
            openai=HttpServer(
                openai_app,
                hypercorn_config(self._listen["openai"], grace_s + CUT_WRITE_S),
                listeners["openai"].socket,
                send_timeout_s=config.openai.send_timeout_s,
                websocket_refusal=_not_the_node_port("caller port (OpenAI API)", node_server.url),
                caller_port=True,
                max_request_bytes=config.openai.max_request_bytes,
            ),
            admin=HttpServer(
                ShieldFinalSend(create_admin_app(self._admin_services())),
                hypercorn_config(self._listen["admin"], grace_s + CUT_WRITE_S),
                listeners["admin"].socket,
                websocket_refusal=_not_the_node_port("admin port", node_server.url),
                role="admin",
            ),
            carry_over=self.limiter.carry_over,
        )

    def _replicas_seen(self, replicas: list[ReplicaStatus]) -> None:
        """Per-minute and concurrency limits are split between the replicas serving."""
        serving = sum(replica.state == "serving" for replica in replicas) or 1
        self.limiter.replicas = serving
        self.scheduler.set_replicas(serving)

    def _principal_load(self) -> list[tuple[str, int, int]]:
        return [
            (principal, load.in_flight, load.queued)
            for principal, load in sorted(self.scheduler.principal_load().items())
        ]

    def _ledger_shared(self) -> bool:
        """Whether other Edges write to this ledger (their usage counts toward budgets)."""
        return self.limiter.replicas > 1 or self.ledger.store.shared

    def principals(self) -> PrincipalsReport:
        """`GET /principals`: each principal against its limits, now."""
        return self.limiter.report(self.scheduler.principal_load())

    async def usage(
        self,
        *,
        since: float | None,
        until: float | None,
        group_by: Sequence[str],
        limit: int | None = None,
        after: str | None = None,
    ) -> UsageReport:
        """`GET /usage`: the ledger's report (a page of it), and each principal against
        its limits."""
        report = await self.ledger.aggregate(
            since=since, until=until, group_by=group_by, limit=limit, after=after
        )
        return msgspec.structs.replace(report, principals=self.principals())

    def _listening(self, addresses: EdgeAddresses) -> None:
        """Every listener accepts: the replica roster describes this process with them."""
        self._addresses = addresses

    def _refresh_blocked(self) -> str | None:
        """Why a config refresh may not run now (`Refresher`), or None."""
        if self._restarter.in_progress:
            return "a restart is in progress (its new Edge has read the config file)"
        if self._stop.requested:
            return "this Edge is stopping"
        return None

    async def restart(self) -> RestartReport:
        """Hand over to a new process of this Edge (zero-downtime restart, design §13;
        `procedures.restart`). Returns once the successor serves (then this Edge drains
        and `serve` returns) or the restart failed (this Edge serves on, unchanged)."""
        return await self._restarter.restart(
            node_server=self._node_server,
            listeners=list(self._listeners.values()),
            revision=self._snapshot.revision + 1,
            instance=self._instance,
            stopping=self._stop.requested,
            stop=self.stop,
        )
