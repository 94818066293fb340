"""The Edge process's composition root: builds every part, wires them, serves them.

Nothing below this module knows the `Edge`: each part gets only what it needs, as an
object or a callable (the handlers an `AdminServices` or a snapshot getter, the
refresher a `RefreshTarget`, the hub a `NodeDirectory` and three callbacks). The layers
are `core` (pure) < `runtime` (Trio state and tasks) < `http` (the surfaces) < this file.

`Edge` holds the current immutable `Snapshot` (swapped in one step by refresh) and the
long-lived runtime parts that outlive snapshots. `Edge.serve` is a startable service: it
binds the OpenAI listener, the node websocket listener and the loopback-only admin
listener (each may be port 0), then reports their URLs via `task_status`.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from trio_websocket import serve_websocket

from iop_edge.core.config import ParsedConfig
from iop_edge.core.host import node_tls_context
from iop_edge.core.listen import parse_listen_address
from iop_edge.core.readiness import Readiness, readiness
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.admin import AdminServices, create_admin_app
from iop_edge.http.final_send import ShieldFinalSend
from iop_edge.http.openai_app import OpenAIApp
from iop_edge.http.runs import RunEndpoints
from iop_edge.runtime.access_log import AccessLog, RefusedRequest
from iop_edge.runtime.activity import Activity
from iop_edge.runtime.audit import AuditLog
from iop_edge.runtime.dispatch import Dispatcher
from iop_edge.runtime.hub import (
    HANDSHAKE_TIMEOUT_S,
    LISTENER_MAX_FRAME_BYTES,
    NodeDirectory,
    NodeHub,
)
from iop_edge.runtime.metering import Metering, RunRecord
from iop_edge.runtime.metrics import EdgeMetrics
from iop_edge.runtime.refresh import Refresher
from iop_edge.runtime.scheduler import Scheduler
from iop_edge.runtime.session import SessionClosed
from iop_edge.runtime.usage import UsageLedger
from schemas import wire
from schemas.config import DEFAULT_SHUTDOWN_GRACE_S, NodeConfig

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = DEFAULT_SHUTDOWN_GRACE_S
#: After the grace period, how long the cut exchanges have to write their last bytes (an
#: error event and `[DONE]`, or a 503) before Hypercorn cancels what is left.
CUT_WRITE_S = 2.0


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


class EdgeStartupError(Exception):
    """The Edge cannot start (e.g. a listener's port is taken)."""


class ListenerUnavailable(EdgeStartupError):
    """A listener could not bind its address (the port is taken, or not ours to take)."""

    def __init__(self, config_key: str, what: str, address: str, error: OSError) -> None:
        reason = error.strerror or str(error)
        super().__init__(f"cannot listen on {address} for the {what} ({config_key}): {reason}")
        self.config_key = config_key
        self.address = address
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Listeners:
    """Where to bind, when not where the config says (the demo's free ports).

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
    ) -> None:
        config = parsed.config
        self._snapshot = Snapshot.build(config, revision=1, config_sha256=parsed.sha256)
        self.config_path = config_path
        self._listeners = listeners or Listeners()
        self.started_unix = int(time.time())
        self.scheduler = Scheduler(self._snapshot)
        self.metrics = EdgeMetrics(self.scheduler.catalog)
        self.ledger = UsageLedger(Path(config.edge.state_dir) / "usage.sqlite3")
        self.metering = Metering(self.metrics, self.ledger)
        self.access_log = AccessLog()
        self.activity = Activity()
        self.hub = NodeHub(
            self._directory,
            on_connect=self.scheduler.node_connected,
            on_disconnect=self.scheduler.node_disconnected,
            on_status=self._on_status,
            heartbeat_s=heartbeat_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
        )
        self.dispatcher = Dispatcher(
            self.scheduler,
            self.hub,
            meter=self._run_finished,
            on_failover=self._count_failover,
            retries_before_first_byte=lambda: (
                self._snapshot.config.dispatch.retries_before_first_byte
            ),
        )
        self.refresher = Refresher(
            self, config_path=config_path, audit=AuditLog(Path(config.edge.state_dir))
        )
        self._shutdown = trio.Event()

    # --- RefreshTarget --------------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def swap_snapshot(self, snapshot: Snapshot) -> None:
        """Install a new snapshot in one step (no await): requests see old or new."""
        self._snapshot = snapshot
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
            return await session.request_refresh(revision, node_config)
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

    def _count_failover(self, model_id: str, provider_id: str) -> None:
        self.metrics.failovers.labels(model_id, provider_id).inc()

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
            status=self.refresher.status,
            catalog=self.scheduler.catalog,
            metrics=self.metrics.render,
            usage=self.ledger.aggregate,
            refresh=self.refresher.refresh,
            readiness=self.readiness,
            activity=self.activity.report,
            refuse_refresh=self.refresher.refuse_unreadable,
        )

    # --- observation ------------------------------------------------------------------

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

    def stop(self) -> None:
        """Begin a graceful stop: listeners close, in-flight requests get a grace period
        (`edge.shutdown_grace_s`); the runs still open then are cut (`_cut_at_deadline`)."""
        self._shutdown.set()

    async def _cut_at_deadline(self, grace_s: float) -> None:
        """Once stopping, give the runs `grace_s` to finish, then end the rest: each caller
        gets an error event and `[DONE]` (a stream) or a 503, each run its record."""
        await self._shutdown.wait()
        await trio.sleep(grace_s)  # the deadline; cancelled if the listeners drain first
        cut = self.dispatcher.cut_all("the Edge is shutting down")
        if cut:
            log.warning("grace period over: %d run(s) cut", cut)

    def _node_ssl_context(self) -> ssl.SSLContext | None:
        tls = self._snapshot.config.edge.tls
        if tls is None:
            return None
        try:
            return node_tls_context(tls)  # validation made the same call
        except ValueError as exc:  # the files changed since: say so, not a traceback
            raise EdgeStartupError(f"edge.tls: {exc}") from None

    async def serve(
        self, *, task_status: trio.TaskStatus[EdgeAddresses] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until `stop()` drains the listeners.

        Raises `ListenerUnavailable` (naming the address and its config key) when a
        listener cannot bind, e.g. because its port is taken."""
        config = self._snapshot.config
        listeners = self._listeners
        node_address = listeners.node or config.edge.listen
        openai_address = listeners.openai or config.openai.listen
        admin_address = listeners.admin or config.admin.listen
        async with trio.open_nursery() as nursery:
            await nursery.start(self.scheduler.run)
            await nursery.start(self.ledger.run)
            node_listen = parse_listen_address(node_address)
            ssl_context = self._node_ssl_context()
            with _naming_the_listener("edge.listen", "node websocket", node_address):
                ws_server = await nursery.start(
                    partial(
                        serve_websocket,
                        self.hub.handle,
                        node_listen.host,
                        node_listen.port,
                        ssl_context,
                        max_message_size=LISTENER_MAX_FRAME_BYTES,
                        receive_buffer_size=256 * 1024,
                        # An upgrade that does not arrive is an anonymous peer too (hub Rule 1).
                        connect_timeout=HANDSHAKE_TIMEOUT_S,
                    )
                )
            scheme = "wss" if ssl_context else "ws"
            node_url = f"{scheme}://{node_listen.url_host}:{ws_server.port}"
            log.info("node websocket listening on %s", node_url)

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
            async with trio.open_nursery() as stopping:
                stopping.start_soon(self._cut_at_deadline, grace_s)
                async with trio.open_nursery() as http:
                    with _naming_the_listener("openai.listen", "OpenAI API", openai_address):
                        openai_binds = await http.start(
                            partial(
                                hypercorn_serve,
                                openai_app,
                                hypercorn_config(openai_address, grace_s),
                                shutdown_trigger=self._shutdown.wait,
                            )
                        )
                    with _naming_the_listener("admin.listen", "admin API", admin_address):
                        admin_binds = await http.start(
                            partial(
                                hypercorn_serve,
                                ShieldFinalSend(create_admin_app(self._admin_services())),
                                hypercorn_config(admin_address, grace_s),
                                shutdown_trigger=self._shutdown.wait,
                            )
                        )
                    addresses = EdgeAddresses(
                        openai_url=openai_binds[0], node_url=node_url, admin_url=admin_binds[0]
                    )
                    log.info("OpenAI API listening on %s", addresses.openai_url)
                    log.info("admin API listening on %s", addresses.admin_url)
                    task_status.started(addresses)
                stopping.cancel_scope.cancel()  # the listeners drained before the deadline
            # The HTTP listeners drained (graceful stop): the ledger writes what it holds,
            # then the node side ends too.
            self.ledger.close()
            with trio.move_on_after(grace_s):
                await self.ledger.wait_stopped()
            self.hub.abort_all()
            nursery.cancel_scope.cancel()


@contextmanager
def _naming_the_listener(config_key: str, what: str, address: str) -> Iterator[None]:
    """Turn a bind failure (deep in Hypercorn's or trio-websocket's nurseries) into one
    `ListenerUnavailable` that names the address and the config key that sets it."""
    try:
        yield
    except* OSError as group:
        raise ListenerUnavailable(config_key, what, address, _first_os_error(group)) from None


def _first_os_error(error: BaseException) -> OSError:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, OSError)
    return error
