"""The Node's adapter registries: build, swap, drain (design §5 step 7).

An `AdapterRegistry` maps provider ids to adapter instances built from one `NodeConfig`,
and owns the runs started on it: each registry has its own nursery, so "stop this
registry" has a precise meaning (wait for *its* runs, then close *its* adapters) and
never touches runs of another generation.

A refresh goes through `RegistryManager.apply`:

1. Build the new registry completely first. If any adapter fails to construct, the
   partial registry is closed, the old one stays current, and the caller acks
   `ok: false` with the error.
2. Swap it in with no await in between: every run that arrives afterwards goes to the
   new registry; runs already started stay on the old one.
3. Retire the old registry: it accepts no new runs, waits for its active runs to finish
   for at most `drain_timeout_s`, then cancels the stragglers, each answered with
   `run_failed{code: registry_retired}`, and finally closes its adapters.
4. Retiring registries are bounded: at most `max_retiring` drain at once. A refresh
   beyond that cuts the *oldest* draining registry short at once (its stragglers are
   cancelled as in 3) rather than waiting. Waiting would stall the refresh behind a slow
   run while the Edge waits for the ack; cutting short keeps refresh latency and memory
   bounded, and only hits runs that have already outlived several config generations.

Adapter modules are imported lazily by module path: a Node only imports what its
config names, and an optional dependency of one adapter never breaks the others.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Literal, cast

import trio

from iop_node import heap
from iop_node.adapters.base import Adapter
from iop_node.runs.activity import ProviderActivity
from iop_node.runs.runner import RunHandle, Send, execute_run
from schemas.config import NodeConfig, ProviderConfig
from schemas.wire import FailureCode, Run, RunFailed

if TYPE_CHECKING:  # the adapters' modules are imported on first use
    from iop_node.adapters.cli import AllowedCommands

log = logging.getLogger(__name__)

AdapterFactory = Callable[[ProviderConfig], Adapter]
BeforeRun = Callable[[Run, Adapter], Awaitable[None]]
"""What a run's task awaits before its adapter runs it."""

DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_MAX_RETIRING = 4
#: Closing adapters is cleanup: bounded, so a stuck upstream cannot hold a shutdown.
ADAPTER_CLOSE_TIMEOUT_S = 5.0

_ADAPTER_CLASSES: Mapping[str, tuple[str, str]] = {
    "sim": ("iop_node.adapters.sim.adapter", "SimAdapter"),
    "vllm": ("iop_node.adapters.openai_compat", "OpenAICompatAdapter"),
    "sglang": ("iop_node.adapters.openai_compat", "OpenAICompatAdapter"),
    "lemonade": ("iop_node.adapters.openai_compat", "OpenAICompatAdapter"),
    "openai_api": ("iop_node.adapters.openai_compat", "OpenAICompatAdapter"),
    "ollama": ("iop_node.adapters.ollama", "OllamaAdapter"),
    "lmstudio": ("iop_node.adapters.lmstudio", "LmStudioAdapter"),
    "cli": ("iop_node.adapters.cli", "CliAdapter"),
}


class RegistryBuildError(Exception):
    """A `NodeConfig` could not be turned into a registry; the message names the provider."""


def create_adapter(
    provider: ProviderConfig, *, allowed_commands: AllowedCommands = frozenset()
) -> Adapter:
    """Construct the adapter for `provider.type`, importing its module on first use.
    `allowed_commands`: the command lines a `cli` provider may run
    (`iop_node.adapters.cli`)."""
    try:
        module_name, class_name = _ADAPTER_CLASSES[provider.type]
    except KeyError:
        raise RegistryBuildError(f"no adapter for provider type {provider.type!r}") from None
    adapter_class = getattr(importlib.import_module(module_name), class_name)
    if provider.type == "cli":
        return cast(Adapter, adapter_class(provider, allowed_commands))
    return cast(Adapter, adapter_class(provider))


RegistryState = Literal["built", "live", "retiring", "closed"]


@dataclass(frozen=True, slots=True)
class RegistryStatistics:
    """One registry at one instant (for tests and diagnostics)."""

    state: RegistryState
    active_runs: int


@dataclass(frozen=True, slots=True)
class ManagerStatistics:
    """The registries of one session at one instant (for tests and diagnostics)."""

    retiring: tuple[AdapterRegistry, ...]
    """Registries still draining or closing, oldest first."""


class AdapterRegistry:
    """One generation of adapters and the runs started on them."""

    def __init__(
        self,
        revision: int,
        config: NodeConfig,
        adapters: Mapping[str, Adapter],
        activity: ProviderActivity | None = None,
    ):
        self.revision = revision
        self.config = config
        self.adapters: Mapping[str, Adapter] = dict(adapters)
        self.activity = activity if activity is not None else ProviderActivity()
        """Where this registry's runs show their signs of life (shared across registries)."""
        self._state: RegistryState = "built"
        self._runs: dict[str, RunHandle] = {}
        self._nursery: trio.Nursery | None = None
        self._retire_requested = trio.Event()
        self._retire_reason = (FailureCode.REGISTRY_RETIRED, "", True)
        self._drained = trio.Event()
        self._drain_scope = trio.CancelScope()
        self._closed = trio.Event()

    @classmethod
    async def build(
        cls,
        revision: int,
        config: NodeConfig,
        factory: AdapterFactory = create_adapter,
        activity: ProviderActivity | None = None,
    ) -> AdapterRegistry:
        """Construct every adapter of `config`, or none: on failure the adapters built so far
        are closed and `RegistryBuildError` names the provider that failed."""
        adapters: dict[str, Adapter] = {}
        try:
            for provider in config.providers:
                if provider.id in adapters:
                    raise RegistryBuildError(f"provider {provider.id!r} is configured twice")
                try:
                    adapters[provider.id] = factory(provider)
                except RegistryBuildError:
                    raise
                except Exception as exc:
                    raise RegistryBuildError(
                        f"provider {provider.id!r} ({provider.type}): {type(exc).__name__}: {exc}"
                    ) from exc
        except BaseException:
            with trio.move_on_after(ADAPTER_CLOSE_TIMEOUT_S, shield=True):
                await _aclose_all(adapters.values())
            raise
        return cls(revision, config, adapters, activity)

    # --- inspection --------------------------------------------------------------------

    def statistics(self) -> RegistryStatistics:
        return RegistryStatistics(state=self._state, active_runs=len(self._runs))

    @property
    def active_runs(self) -> int:
        return len(self._runs)

    @property
    def cut(self) -> bool:
        """Whether the drain was cut short (the runs left are being cancelled)."""
        return self._drain_scope.cancel_called

    def adapter(self, provider_id: str) -> Adapter | None:
        return self.adapters.get(provider_id)

    def has_run(self, key: str) -> bool:
        return key in self._runs

    # --- runs --------------------------------------------------------------------------

    def start_run(
        self,
        run: Run,
        send: Send,
        *,
        key: str | None = None,
        on_end: Callable[[], None] | None = None,
        before: BeforeRun | None = None,
    ) -> RunHandle:
        """Start `run` in this registry's nursery; its handle is registered at once, so a
        `cancel` that arrives right behind the run finds it.

        `key` names the run here (default: its id; a Node serving several Edges scopes
        ids by link); `on_end` is called once when the run's task ends, however; `before`
        is awaited in the run's task before the adapter runs it."""
        if self._state != "live" or self._nursery is None:
            raise RuntimeError(f"registry revision {self.revision} is {self._state}")
        key = run.run_id if key is None else key
        handle = RunHandle(run.run_id)
        self._runs[key] = handle
        self._nursery.start_soon(
            partial(self._run, run, key, handle, send, on_end, before=before),
            name=f"run {run.run_id}",
        )
        return handle

    def cancel_run(self, key: str, code: FailureCode, message: str) -> bool:
        handle = self._runs.get(key)
        if handle is None:
            return False
        handle.cancel(code, message)
        return True

    async def _run(
        self,
        run: Run,
        key: str,
        handle: RunHandle,
        send: Send,
        on_end: Callable[[], None] | None,
        *,
        before: BeforeRun | None = None,
    ) -> None:
        adapter = self.adapter(run.provider_id)
        if adapter is not None:
            handle.activity = self.activity.start(adapter.provider, stream=run.stream)
        try:
            if before is not None and adapter is not None:
                await before(run, adapter)
            await execute_run(run, adapter, handle, send)
        finally:
            if handle.activity is not None:
                self.activity.finish(run.provider_id, handle.activity)
            del self._runs[key]
            if on_end is not None:
                on_end()
            if self._state == "retiring" and not self._runs:
                self._drained.set()

    # --- lifecycle ---------------------------------------------------------------------

    async def serve(
        self,
        *,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Own this registry's runs: live (startable) until `retire()`, then drain for at
        most `drain_timeout_s`, cancel the stragglers, and close the adapters.

        Cancelled from outside (the session ended), the runs stop without an answer and
        the adapters are still closed."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._state = "live"
                task_status.started()
                await self._retire_requested.wait()
                self._state = "retiring"
                if not self._runs:
                    self._drained.set()
                with self._drain_scope, trio.move_on_after(drain_timeout_s):
                    await self._drained.wait()
                code, message, retryable = self._retire_reason
                if self._runs:
                    log.warning(
                        "registry revision %s: cancelling %d run(s) still active after the drain",
                        self.revision,
                        len(self._runs),
                    )
                for handle in list(self._runs.values()):
                    handle.cancel(code, message, retryable=retryable)
        finally:
            self._state = "closed"
            self._nursery = None
            with trio.move_on_after(ADAPTER_CLOSE_TIMEOUT_S, shield=True):
                await _aclose_all(self.adapters.values())
            self._closed.set()

    def retire(
        self,
        code: FailureCode = FailureCode.REGISTRY_RETIRED,
        message: str | None = None,
        *,
        retryable: bool = True,
    ) -> None:
        """Accept no new runs; drain the active ones (see `serve`). Runs still active when
        the drain ends are answered with `code`/`message`."""
        if self._retire_requested.is_set():
            return
        if message is None:
            message = (
                f"the node's provider registry (revision {self.revision}) was replaced by a "
                "config refresh and retired before this run finished"
            )
        self._retire_reason = (code, message, retryable)
        if self._state == "live":
            self._state = "retiring"
        self._retire_requested.set()

    def cut_short(self) -> None:
        """Skip the rest of the drain: cancel the active runs now (after `retire`)."""
        self._drain_scope.cancel()

    async def wait_closed(self) -> None:
        await self._closed.wait()


class RegistryManager:
    """The current registry plus the retiring ones, shared by the Node's Edge links.

    `nursery` hosts every registry's `serve` task: it must outlive the manager's use.
    `send` queues a message for the Edge when a run does not bring its own.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        send: Send | None = None,
        *,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        max_retiring: int = DEFAULT_MAX_RETIRING,
        factory: AdapterFactory = create_adapter,
        activity: ProviderActivity | None = None,
    ) -> None:
        if max_retiring < 1:
            raise ValueError("max_retiring must be at least 1")
        self._nursery = nursery
        self._send = send
        self._drain_timeout_s = drain_timeout_s
        self._max_retiring = max_retiring
        self._factory = factory
        self.activity = activity if activity is not None else ProviderActivity()
        """The runs in flight per provider, across every registry of the session."""
        self._current: AdapterRegistry | None = None
        self._retiring: list[AdapterRegistry] = []
        self._closing = False
        self._all_closed = trio.Event()

    @property
    def current(self) -> AdapterRegistry | None:
        return self._current

    def statistics(self) -> ManagerStatistics:
        return ManagerStatistics(retiring=tuple(self._retiring))

    async def apply(self, revision: int, config: NodeConfig) -> AdapterRegistry:
        """Build a registry for `config`, make it current, retire the previous one.

        Raises `RegistryBuildError` (nothing changed) when the config cannot be built. A
        config equal to the current one keeps the live registry (and its adapters'
        connections); only the revision (and the rest of the config: the idle rules) is
        updated."""
        if self._closing:
            raise RegistryBuildError("the node is stopping")
        current = self._current
        if current is not None and current.config.providers == config.providers:
            current.revision = revision
            current.config = config
            return current
        registry = await AdapterRegistry.build(revision, config, self._factory, self.activity)
        await self._nursery.start(self._serve, registry)
        if self._closing:  # `aclose` began while we were building: never make it current
            self._retire(registry, code=FailureCode.NODE_STOPPING)
            raise RegistryBuildError("the node is stopping")
        # No await from here on: the swap is atomic for the runs that arrive.
        previous, self._current = self._current, registry
        if previous is not None:
            self._retire(previous)
        heap.providers_built()  # long-lived from now on: out of the collector's sight (Rule 1)
        return registry

    def has_run(self, key: str) -> bool:
        """Whether a run of `key` is active in any registry (asked twice for every run
        that arrives: the live registry first, the retiring ones only if there are any)."""
        current = self._current
        if current is not None and current.has_run(key):
            return True
        return bool(self._retiring) and any(registry.has_run(key) for registry in self._retiring)

    @property
    def accepting(self) -> bool:
        """Whether a run that arrives now has a registry to run on."""
        return not self._closing and self._current is not None

    async def start_run(
        self,
        run: Run,
        *,
        send: Send | None = None,
        key: str | None = None,
        on_end: Callable[[], None] | None = None,
        before: BeforeRun | None = None,
    ) -> bool:
        """Route `run` to the current registry (or answer why it cannot run); True when
        it started. `send` carries its events (default: the manager's); `key`, `on_end`
        and `before` are as in `AdapterRegistry.start_run` (`on_end` is called only for
        a run that started)."""
        send = self._send if send is None else send
        if send is None:
            raise ValueError("a run needs a `send` when the manager has none")
        if self.has_run(run.run_id if key is None else key):
            await _reject_run(
                send, run, FailureCode.DUPLICATE_RUN, "a run with this id is already active"
            )
            return False
        registry = self._current
        if self._closing or registry is None:
            await _reject_run(
                send,
                run,
                FailureCode.NODE_STOPPING,
                "the node is not accepting runs",
                retryable=True,
            )
            return False
        registry.start_run(run, send, key=key, on_end=on_end, before=before)
        return True

    def cancel_run(
        self,
        key: str,
        code: FailureCode = FailureCode.CANCELLED,
        message: str = "cancelled by the edge",
    ) -> bool:
        """Cancel the run `key` wherever it runs; its answer is `run_failed{code}`."""
        return any(registry.cancel_run(key, code, message) for registry in self._all())

    async def aclose(self) -> None:
        """Stop: accept no new runs, drain every registry (bounded), close all adapters."""
        self._closing = True
        if self._current is not None:
            registry, self._current = self._current, None
            self._retire(
                registry,
                code=FailureCode.NODE_STOPPING,
                message="the node is shutting down and this run did not finish in time",
            )
        if self._retiring:
            await self._all_closed.wait()

    # --- internals ---------------------------------------------------------------------

    def _all(self) -> Iterable[AdapterRegistry]:
        if self._current is not None:
            yield self._current
        yield from self._retiring

    def _retire(
        self,
        registry: AdapterRegistry,
        *,
        code: FailureCode = FailureCode.REGISTRY_RETIRED,
        message: str | None = None,
    ) -> None:
        registry.retire(code, message)
        self._retiring.append(registry)
        draining = [candidate for candidate in self._retiring if not candidate.cut]
        while len(draining) > self._max_retiring:
            oldest = draining.pop(0)
            log.warning(
                "more than %d registries retiring: cutting revision %s short (%d active run(s))",
                self._max_retiring,
                oldest.revision,
                oldest.active_runs,
            )
            oldest.cut_short()

    async def _serve(
        self, registry: AdapterRegistry, *, task_status: trio.TaskStatus[None]
    ) -> None:
        try:
            await registry.serve(drain_timeout_s=self._drain_timeout_s, task_status=task_status)
        finally:
            if registry in self._retiring:
                self._retiring.remove(registry)
            if self._closing and not self._retiring and self._current is None:
                self._all_closed.set()


async def _reject_run(
    send: Send, run: Run, code: FailureCode, message: str, *, retryable: bool = False
) -> None:
    await send(RunFailed(run_id=run.run_id, code=code, message=message, retryable=retryable))


async def _aclose_all(adapters: Iterable[Adapter]) -> None:
    """Close adapters concurrently; one failing to close does not keep the others open."""

    async def aclose(adapter: Adapter) -> None:
        try:
            await adapter.aclose()
        except Exception:
            log.exception("closing the adapter of provider %s failed", adapter.provider.id)

    async with trio.open_nursery() as nursery:
        for adapter in adapters:
            nursery.start_soon(aclose, adapter)
