"""The providers this Node hosts, shared by every Edge link (design §3 "Several Edges", §13).

A Node holds one link per Edge it serves (replicas; an old and a new Edge process during
a restart) but has one set of providers: one adapter registry (with the retiring ones),
one health monitor, one count of run slots. `ProviderHost` owns them; each link's session
attaches as a `LinkPort` and routes what its Edge sends through the host.

Rules:
1. Config. Every Edge sends the Node its providers (`welcome`, `refresh`) with the time
   it took that config (`config_time`). The Node runs the newest config it was sent
   (ties: the one received last): an older one is not applied, so a replica that was
   not refreshed yet cannot undo another replica's refresh by reconnecting. A config
   equal to the running one keeps the live registry, its adapters and their connections
   (replicas of one config share one registry; a restarted Edge changes nothing).
2. Runs. A run takes its provider's slot on arrival (`slots`), or is answered `busy` at
   once (`retryable`, `capacity`) followed by a fresh `load` (its Edge counts the
   provider full until it hears one). Its
   events go back on the link it came from, and only there. Run ids are scoped by link:
   two Edges may use the same id, and a `cancel` only reaches runs of its own link.
3. A cancelled run gives its slot back when the `cancel` arrives: the Edge released the
   slot when it sent the cancel and may send its next run on it right behind.
4. Links end. When a link's connection ends, its runs are cancelled at once (their Edge
   fails them itself) and their slots come free; the other links hear it.
5. Health. One monitor probes the live registry's adapters; every change goes to every
   link, and a link that attaches later gets the latest statuses at once.
6. Stop. `aclose()` reports every provider draining on every link, refuses new runs
   (`node_stopping`, retryable), and lets active runs finish within the drain timeout.
7. Models. A link's `model_command` runs on the live registry's adapter through one
   `ModelControl` for all links (one command per provider at a time; an equal one joins
   it), is followed by a probe of that provider (every link hears the new states), and
   is answered on the link it came from. `pin` and `unpin` (`FEATURE_PINS`) keep a model
   from idle unloads while the link lasts (a pin loads it first); every link's statuses
   say which models are pinned (`ModelState.pinned`), and a change of pins is sent to
   every link at once, so every Edge's placement keeps any Edge's pin.
8. Idle. The running config's idle rules are kept by one `IdleKeeper` (`idle_clock`),
   which sees every link's runs and every probe's states; before a run that would make
   a full runtime with a pinned model load another, it unloads an unpinned idle one.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from functools import partial

import trio

from iop_node.adapters.base import Adapter
from iop_node.health import DEFAULT_PROBE_TIMEOUT_S, HealthMonitor
from iop_node.idle_keeper import IdleKeeper
from iop_node.registry import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_RETIRING,
    AdapterFactory,
    AdapterRegistry,
    RegistryBuildError,
    RegistryManager,
    create_adapter,
)
from iop_node.runs.model_control import ModelControl
from iop_node.runs.runner import Send
from iop_node.runs.slots import Busy, ProviderSlots, SlotHold, SlotStatistics
from schemas.config import NodeConfig
from schemas.wire import (
    FailureCode,
    Load,
    ModelCommand,
    ModelCommandDone,
    ProviderLoad,
    ProviderStatus,
    Run,
    RunFailed,
    Status,
)

__all__ = ["HostStatistics", "LinkPort", "ProviderHost"]

log = logging.getLogger(__name__)

#: Why an older config is not applied (Rule 1); what that Edge's `refresh_ack` says.
NEWER_CONFIG_RUNNING = (
    "this node runs a newer config, sent by another Edge; refresh this Edge to the current config"
)


@dataclass(eq=False)
class LinkPort:
    """One Edge link as the host sees it: where its runs' events and statuses go."""

    serial: int
    send: Send
    label: str
    runs: dict[str, SlotHold | None] = field(default_factory=dict)
    """Active runs of this link by run id, with the slot each holds (None: uncounted)."""
    first_status: trio.Event = field(default_factory=trio.Event)
    """Set once this link was sent the providers' status."""
    reported: dict[str, tuple[int, int]] = field(default_factory=dict)
    """The others' load this link's Edge last heard, providers with runs only (an Edge
    starts from zero for every provider)."""
    reported_under_pressure: bool = False
    """Some provider was under pressure (`slots` Rule 6) when this link last heard."""
    _idle: trio.Event = field(default_factory=trio.Event)

    @property
    def active_runs(self) -> int:
        return len(self.runs)

    async def wait_idle(self) -> None:
        """Return once no run of this link is active."""
        while self.runs:
            await self._idle.wait()

    def _forget(self, run_id: str) -> None:
        self.runs.pop(run_id, None)
        if not self.runs:
            self._idle.set()
            self._idle = trio.Event()


@dataclass(frozen=True, slots=True)
class HostStatistics:
    links: dict[int, str]
    """Attached links: serial -> label (the Edge address)."""
    runs: dict[int, int]
    """Active runs per link."""
    run_ids: dict[int, list[str]]
    """The ids of those runs, per link."""
    slots: SlotStatistics
    config_time: float
    revision: int | None


class ProviderHost:
    """The Node's providers, shared by its Edge links (see the module rules)."""

    def __init__(
        self,
        nursery: trio.Nursery,
        node_id: str,
        *,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        max_retiring: int = DEFAULT_MAX_RETIRING,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
        factory: AdapterFactory = create_adapter,
    ) -> None:
        self.node_id = node_id
        self._nursery = nursery
        self._probe_timeout_s = probe_timeout_s
        self._registries = RegistryManager(
            nursery, drain_timeout_s=drain_timeout_s, max_retiring=max_retiring, factory=factory
        )
        self._slots = ProviderSlots()
        self._links: dict[int, LinkPort] = {}
        self._serials = itertools.count(1)
        self._config_time = -math.inf
        self._statuses: list[ProviderStatus] | None = None
        self._health_scope: trio.CancelScope | None = None
        self._monitor: HealthMonitor | None = None
        self._models = ModelControl()
        self._idle = IdleKeeper(self._models, self._adapter, self._probe_now)
        nursery.start_soon(self._idle.run, name="idle unloads")
        self._apply_lock = trio.Lock()
        self._stopping = False
        self._drained = trio.Event()
        self._changed = trio.lowlevel.ParkingLot()  # `wait_changed`'s observers

    # --- links -------------------------------------------------------------------------

    def attach(self, send: Send, label: str) -> LinkPort:
        port = LinkPort(serial=next(self._serials), send=send, label=label)
        self._links[port.serial] = port
        self._slots.add_link(port.serial)
        self._notify_changed()
        return port

    def detach(self, port: LinkPort) -> None:
        """The link's connection ended: cancel its runs, free their slots (Rule 4)."""
        if self._links.pop(port.serial, None) is None:
            return
        if port.runs:
            log.info("edge link %s closed: cancelling its %d run(s)", port.label, len(port.runs))
        for run_id, hold in list(port.runs.items()):
            if hold is not None:
                hold.release()
            self._registries.cancel_run(
                _key(port, run_id), FailureCode.CANCELLED, "the edge's link closed"
            )
            port._forget(run_id)
        self._slots.remove_link(port.serial)
        if self._idle.drop_link(port.serial):
            self._nursery.start_soon(self._pins_changed, name="pins changed")
        self._notify_changed()

    def _notify_changed(self) -> None:
        if self._changed:  # wake the observers waiting now (nothing to do for none)
            self._changed.unpark_all()

    async def wait_changed(self) -> None:
        """Return at the next link attached or detached, or run started or ended (for
        observers and tests, instead of polling `statistics()`)."""
        await self._changed.park()

    # --- config ------------------------------------------------------------------------

    async def apply(
        self, port: LinkPort, revision: int, config: NodeConfig, config_time: float
    ) -> str | None:
        """Make `config` (sent by `port`'s Edge) the running one if it is the newest
        (Rule 1); None when it is live, else why not (nothing changed then)."""
        async with self._apply_lock:
            if config.node_id != self.node_id:
                return f"config is for node {config.node_id!r}, this node is {self.node_id!r}"
            if self._stopping:
                return "the node is stopping"
            current = self._registries.current
            older = config_time < self._config_time
            if current is not None and current.config != config and older:
                log.warning(
                    "edge link %s sent an older config (revision %s) than the one "
                    "running; keeping the newer one",
                    port.label,
                    revision,
                )
                await self._send_statuses(port)
                return NEWER_CONFIG_RUNNING
            try:
                registry = await self._registries.apply(revision, config)
            except RegistryBuildError as exc:
                return str(exc)
            self._config_time = max(self._config_time, config_time)
            self._idle.configure(config.idle)
            if registry is not current:
                self._slots.configure(config.providers)
                self._watch_health(registry)
            else:
                await self._send_statuses(port)
            return None

    async def apply_welcome(
        self, port: LinkPort, revision: int, config: NodeConfig, config_time: float
    ) -> None:
        """Apply a `welcome`'s config. When it cannot be built and nothing runs yet, the
        Node stays up with no providers (runs fail as `unknown_provider`), tells this
        Edge why, and waits for a refresh to fix it."""
        error = await self.apply(port, revision, config, config_time)
        if error is None or error is NEWER_CONFIG_RUNNING:
            return  # live, or another Edge's newer config is (this one heard its status)
        if self._registries.current is None and not self._stopping:
            await self._registries.apply(revision, NodeConfig(node_id=self.node_id))
            self._slots.configure(())
        log.error("cannot build providers from config revision %s: %s", revision, error)
        detail = f"node could not build its providers: {error}"
        await self._deliver(
            port,
            [
                ProviderStatus(id=provider.id, health="unavailable", detail=detail)
                for provider in config.providers
            ],
        )

    # --- runs --------------------------------------------------------------------------

    async def start_run(self, port: LinkPort, run: Run) -> None:
        """Route a run of `port`'s Edge (Rule 2)."""
        key = _key(port, run.run_id)
        hold: SlotHold | None = None
        if self._registries.accepting and not self._registries.has_run(key):
            try:
                hold = self._slots.hold(port.serial, run.provider_id, long=run.long)
            except Busy as exc:
                await port.send(
                    RunFailed(
                        run_id=run.run_id,
                        code=FailureCode.BUSY,
                        message=str(exc),
                        retryable=True,
                        capacity=True,
                    )
                )
                await self.report_load(port, force=True)
                return
            port.runs[run.run_id] = hold
        model = (run.provider_id, run.target)
        victim = self._idle.started(model)
        before = None if victim is None else partial(self._idle.make_room, victim)

        def ended() -> None:
            self._idle.ended(model)
            if port.runs.get(run.run_id, False) is hold:
                port._forget(run.run_id)
            if hold is not None:
                hold.release()
            if self._monitor is not None:
                self._monitor.runs_ended(run.provider_id)
            self._notify_changed()

        def not_started() -> None:
            if victim is not None:
                self._idle.spared((run.provider_id, victim))
            if hold is not None:
                ended()
            else:
                self._idle.ended(model)

        try:
            started = await self._registries.start_run(
                run, send=port.send, key=key, on_end=ended, before=before
            )
        except BaseException:  # its refusal's send was cut: it did not start either
            not_started()
            raise
        if started:
            self._notify_changed()
        else:
            not_started()

    def cancel_run(self, port: LinkPort, run_id: str) -> bool:
        """The Edge cancelled a run: its slot is free now (Rule 3), the run stops."""
        hold = port.runs.get(run_id)
        if hold is not None:
            hold.release()
        return self._registries.cancel_run(_key(port, run_id))

    # --- models on demand ---------------------------------------------------------------

    def model_command(self, port: LinkPort, command: ModelCommand) -> None:
        """`port`'s Edge asked for a load or unload (Rule 7). It runs in the host's
        nursery: a load takes seconds to minutes, and the link keeps reading meanwhile."""
        self._nursery.start_soon(
            self._model_command, port, command, name=f"model {command.action} {command.model}"
        )

    async def _model_command(self, port: LinkPort, command: ModelCommand) -> None:
        adapter = self._adapter(command.provider_id)
        action = command.action
        model = (command.provider_id, command.model)
        if adapter is None:
            error: str | None = f"this node has no provider {command.provider_id!r}"
        elif action == "unpin":
            if self._idle.unpin(model, port.serial):
                await self._pins_changed()
            error = None
        else:
            if action == "pin" and self._idle.pin(model, port.serial):
                await self._pins_changed()
            error = await self._models.run(
                adapter,
                "unload" if action == "unload" else "load",
                command.model,
                after=partial(self._probe_now, adapter),
            )
        if error is None:
            log.info("provider %s: %s %s done", command.provider_id, command.action, command.model)
        else:
            log.warning(
                "provider %s: %s of %s failed: %s",
                command.provider_id,
                command.action,
                command.model,
                error,
            )
        await port.send(
            ModelCommandDone(command_id=command.command_id, ok=error is None, error=error)
        )

    def _adapter(self, provider_id: str) -> Adapter | None:
        current = self._registries.current
        return None if current is None else current.adapters.get(provider_id)

    async def _probe_now(self, adapter: Adapter) -> None:
        monitor = self._monitor
        if monitor is not None:
            await monitor.probe_now(adapter.provider.id)

    # --- what each link hears ----------------------------------------------------------

    def others(self, port: LinkPort) -> list[ProviderLoad]:
        return self._slots.others(port.serial)

    async def report_load(self, port: LinkPort, *, force: bool = False) -> None:
        """Send `port`'s Edge what the other links hold, if that changed since it last
        heard (or anyway: `force`, right after a `busy`, since that Edge now counts the
        provider full until it hears)."""
        loads = self._slots.others(port.serial)
        current = {
            load.id: (load.in_flight, load.long_in_flight)
            for load in loads
            if load.in_flight or load.long_in_flight
        }
        if force or current != port.reported:
            port.reported = current
            port.reported_under_pressure = self._slots.under_pressure()
            await port.send(Load(providers=loads))

    def load_pressing(self, port: LinkPort) -> bool:
        """Whether `port`'s Edge must hear changes promptly: some provider is under
        pressure now, or was when it last heard (so a drain back to calm is prompt too)."""
        return port.reported_under_pressure or self._slots.under_pressure()

    async def wait_load_pressing(self) -> None:
        await self._slots.wait_pressure()

    def load_version(self, port: LinkPort) -> int:
        return self._slots.version(port.serial)

    async def wait_load_changed(self, port: LinkPort, version: int) -> None:
        await self._slots.wait_changed(port.serial, version)

    # --- health ------------------------------------------------------------------------

    def _watch_health(self, registry: AdapterRegistry) -> None:
        """Monitor `registry`'s adapters, and stop monitoring the previous registry's."""
        if self._health_scope is not None:
            self._health_scope.cancel()
        scope = self._health_scope = trio.CancelScope()
        monitor = self._monitor = HealthMonitor(
            registry.adapters,
            self._broadcast,
            probe_timeout_s=self._probe_timeout_s,
            activity=registry.activity,
        )

        async def monitor_health() -> None:
            with scope:
                await monitor.run()

        self._nursery.start_soon(monitor_health, name=f"health of revision {registry.revision}")

    def probe(self, provider_ids: list[str]) -> None:
        """An Edge asks for these providers to be probed now (`health`: at most once a
        second each; the answer is a `status` naming them, to every link)."""
        if self._monitor is not None and not self._stopping:
            self._monitor.demand(provider_ids)

    async def _broadcast(self, statuses: list[ProviderStatus], probed: list[str]) -> None:
        """A health change, or a probe on demand done: every link hears it (Rule 5)."""
        self._statuses = statuses
        self._idle.observe(statuses, {} if self._monitor is None else self._monitor.probed_at)
        await self._deliver_all(probed)

    async def _pins_changed(self) -> None:
        """Rule 7: every link hears the pins as they are now, with the last statuses."""
        await self._deliver_all()

    async def _deliver_all(self, probed: list[str] | None = None) -> None:
        """Every link hears the last statuses, their pins marked once for all (Rules 5, 7)."""
        if self._statuses is None:
            return
        statuses = self._idle.mark_pins(self._statuses)
        for port in list(self._links.values()):
            await self._deliver(port, statuses, probed)

    async def _send_statuses(self, port: LinkPort) -> None:
        """Tell a link that attached to a running registry what the last probes found."""
        if self._statuses is not None:
            await self._deliver(port, self._idle.mark_pins(self._statuses))

    async def _deliver(
        self, port: LinkPort, statuses: list[ProviderStatus], probed: list[str] | None = None
    ) -> None:
        """`statuses` to `port`, their pins already marked (`IdleKeeper.mark_pins`)."""
        await port.send(Status(providers=statuses, probed=probed or []))
        port.first_status.set()

    # --- stop --------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop gracefully (Rule 6); returns once every run ended and adapters closed."""
        if self._stopping:
            await self._drained.wait()
            return
        self._stopping = True
        if self._health_scope is not None:
            self._health_scope.cancel()
        current = self._registries.current
        if current is not None:
            log.info("stopping: draining %d active run(s)", current.active_runs)
            self._statuses = [
                ProviderStatus(
                    id=provider_id,
                    health="draining",
                    detail="node is shutting down: finishing its runs, taking no new ones",
                )
                for provider_id in current.adapters
            ]
            await self._deliver_all()
        await self._registries.aclose()
        self._drained.set()

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def wait_drained(self) -> None:
        await self._drained.wait()

    # --- observation -------------------------------------------------------------------

    @property
    def current(self) -> AdapterRegistry | None:
        return self._registries.current

    def statistics(self) -> HostStatistics:
        current = self._registries.current
        return HostStatistics(
            links={serial: port.label for serial, port in self._links.items()},
            runs={serial: port.active_runs for serial, port in self._links.items()},
            run_ids={serial: sorted(port.runs) for serial, port in self._links.items()},
            slots=self._slots.statistics(),
            config_time=self._config_time,
            revision=None if current is None else current.revision,
        )


def _key(port: LinkPort, run_id: str) -> str:
    return f"{port.serial}/{run_id}"
