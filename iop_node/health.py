"""Periodic health probes for one registry's adapters (design §3 `status`, §9).

The Edge routes only to providers whose health is `available`, so it must hear about a
change quickly, and about nothing else: the monitor reports the full provider list
(`status` carries every provider, so a lost message is repaired by the next one) only
when some provider's health or model list changed.

- At start, every adapter is probed concurrently and the first report is sent once all
  initial probes finished; the monitor is "started" after that report.
- Then each adapter is probed every `provider.adapter.health_interval_s`.
- A probe is bounded by `probe_timeout_s` (never more than the interval). A probe that
  raises, or answers `unavailable`, makes the provider `unavailable` with the reason in
  `detail`; a probe must never take the Node down.
- Busy is not down (design §4 item 11). A provider whose runs are progressing
  (`activity.ProviderActivity`: output within each run's stall window) is `busy` and is
  not probed at all (see `_generating` for why), unless the last probe found it down.
  A probe that *times out* (ours, or the adapter's `ProbeTimeout`) is judged by the
  runs too: `busy` while one of them progresses (a run may start during the probe);
  `unavailable` when they are stalled. With none in flight, it is judged by how far the
  probe got: a runtime that accepted the connection and took the request is alive,
  whoever keeps it busy (another client of the runtime, which the Node does not see),
  so it is `busy` ("probe timed out; upstream accepted the connection") and passive
  signals decide: a run that gets no first byte within its timeout fails as the
  provider's (`upstream_timeout`), which the Edge's cooldown counts. A probe that never
  reached the runtime (the adapter's `ProbeWitness` says so, or cannot tell) makes it
  `unavailable`. A `busy` provider keeps its models and stays in the pool up to
  capacity. A probe that fails any other way (connection refused, an error status) is
  `unavailable` whatever runs are in flight. Each interval decides afresh, so a
  provider whose runs stall, or that refuses connections, leaves the pool within one
  interval (plus the probe timeout).
- A status's `detail` is the Node's words for it, never the health again (the catalog
  shows both: "busy: busy: ..." reads as a stutter), and says whose work keeps a busy
  runtime busy: runs IOP sent ("from IOP"), or work IOP did not send (another client of
  the runtime).
- A probe on demand (`demand`: the Edge's `probe`, sent when callers would be refused
  because a model's providers are all down) wakes the provider's watch at once, at most
  once per `ON_DEMAND_GAP_S` since its last probe began: one probe at a time per
  provider, whatever the number of callers. Its report is sent changed or not, naming
  the provider as probed, so the Edge stops waiting as soon as the probe has spoken. A
  runtime that came back is routable then, not at its next periodic probe.
- Reports are serialised and each one is taken when it is sent, so the last report the
  Edge receives always describes the latest state.
- A status carries each served model's load state where the runtime reports it (design
  §18); a change of state (a model loaded or unloaded by the runtime, or by another
  client) is reported like a change of health. A busy provider is not asked, so it
  keeps the states of its last probe.
- Every status names the caller protocols the provider speaks natively as the Node knows
  now (`protocol_support`, design §14). When a run finds that the upstream lacks one, the
  change is reported at once, not at the next probe: the Edge stops preferring the
  provider for that protocol and its catalog shows it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

import msgspec
import trio

from iop_node.adapters.base import Adapter, NativeRelay, ProbeTimeout, ProbeWitness
from iop_node.protocol_support import ProtocolSupport
from iop_node.runs.activity import ProviderActivity
from schemas.wire import ProviderStatus

log = logging.getLogger(__name__)

DEFAULT_PROBE_TIMEOUT_S = 5.0
#: The least time between the starts of two probes of a provider that a demand may
#: cause (a storm of refused callers probes a runtime once a second, no more).
ON_DEMAND_GAP_S = 1.0
#: Why a provider whose probe went unanswered, with no run of ours in flight, is busy.
ACCEPTED_BUT_SILENT = "probe timed out; upstream accepted the connection"

OnStatus = Callable[[list[ProviderStatus], list[str]], Awaitable[None]]
"""Receives every provider's status whenever one of them changed, or a probe on demand
ended (the second argument: the providers it probed)."""


class HealthMonitor:
    """Probes the adapters of one registry and reports changes through `on_change`."""

    def __init__(
        self,
        adapters: Mapping[str, Adapter],
        on_change: OnStatus,
        *,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
        activity: ProviderActivity | None = None,
    ) -> None:
        self._adapters = dict(adapters)
        self._on_change = on_change
        self._probe_timeout_s = probe_timeout_s
        self._activity = activity if activity is not None else ProviderActivity()
        self._statuses: dict[str, ProviderStatus] = {
            provider_id: ProviderStatus(id=provider_id, health="unknown")
            for provider_id in self._adapters
        }
        self._protocols = {
            provider_id: _support_of(adapter) for provider_id, adapter in self._adapters.items()
        }
        self._report_lock = trio.Lock()
        self._deferred: set[str] = set()
        """The providers whose last status came from their runs, the probe deferred."""
        self._wanted: dict[str, trio.Event] = {
            provider_id: trio.Event() for provider_id in self._adapters
        }
        """Per provider: set when a probe is demanded, replaced once it is taken."""
        self.probed_at: dict[str, float] = {}
        """Per provider: when the probe behind its latest status began (a `busy` status
        made from its runs carries the model states of that probe)."""

    def runs_ended(self, provider_id: str) -> None:
        """A run of the provider ended: once none is left, a `busy` status made from its
        runs (the probe deferred) is stale, so the provider is probed soon rather than a
        whole interval later."""
        if provider_id in self._deferred and self._activity.progress(provider_id).runs == 0:
            self._deferred.discard(provider_id)
            self.demand([provider_id])

    def demand(self, provider_ids: Iterable[str]) -> None:
        """Probe these providers soon (module docstring); ids not here are ignored."""
        for provider_id in provider_ids:
            wanted = self._wanted.get(provider_id)
            if wanted is not None:
                wanted.set()

    def statuses(self) -> list[ProviderStatus]:
        """The latest status of every provider, in config order."""
        return list(self._statuses.values())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probe all adapters, report, signal started, then probe each one periodically."""
        async with trio.open_nursery() as nursery:
            for provider_id, adapter in self._adapters.items():
                nursery.start_soon(self._initial_probe, provider_id, adapter)
        await self._report([])
        task_status.started()
        async with trio.open_nursery() as nursery:
            for provider_id, adapter in self._adapters.items():
                nursery.start_soon(self._watch, provider_id, adapter, name=f"health {provider_id}")
                if isinstance(adapter, NativeRelay):
                    nursery.start_soon(
                        self._watch_protocols,
                        provider_id,
                        adapter.protocol_support,
                        name=f"protocols {provider_id}",
                    )

    async def _watch_protocols(self, provider_id: str, support: ProtocolSupport) -> None:
        """Report a protocol the provider turned out not to speak as soon as a run learns it."""
        seen = support.version
        while True:
            await support.wait_changed(seen)
            seen = support.version
            if self._record(provider_id, self._statuses[provider_id]):
                await self._report([])

    async def probe_now(self, provider_id: str) -> None:
        """Probe one provider at once and report what changed: a load or unload the Node
        just made, so the Edge hears the new states before the command's answer."""
        adapter = self._adapters.get(provider_id)
        if adapter is not None and self._record(
            provider_id, *await self._check(provider_id, adapter)
        ):
            await self._report([provider_id])

    async def _watch(self, provider_id: str, adapter: Adapter) -> None:
        interval_s = adapter.provider.adapter.health_interval_s
        began = trio.current_time()  # the initial probe's, near enough
        while True:
            wanted = self._wanted[provider_id]
            with trio.move_on_after(interval_s):
                await wanted.wait()
            demanded = wanted.is_set()
            if demanded:  # at most one probe per gap, however often it is asked for,
                # and never later than the interval would have probed
                await trio.sleep_until(began + min(ON_DEMAND_GAP_S, interval_s))
                self._wanted[provider_id] = trio.Event()  # later demands ask for the next
            began = trio.current_time()
            changed = self._record(provider_id, *await self._check(provider_id, adapter))
            if changed or demanded:
                await self._report([provider_id] if demanded else [])

    async def _initial_probe(self, provider_id: str, adapter: Adapter) -> None:
        self._record(provider_id, *await self._check(provider_id, adapter))

    async def _check(
        self, provider_id: str, adapter: Adapter
    ) -> tuple[ProviderStatus, float | None]:
        """The provider's status now: from its runs while they generate, else a probe
        (and when it began)."""
        generating = self._generating(provider_id)
        if generating is not None:
            self._deferred.add(provider_id)
            return generating, None
        self._deferred.discard(provider_id)
        began = trio.current_time()
        return await self._probe(provider_id, adapter), began

    def _generating(self, provider_id: str) -> ProviderStatus | None:
        """`busy` without a probe while the provider's runs progress; None: probe it.

        Output is proof of life, and a probe then is worse than redundant: llama.cpp's
        Python server cuts the stream it is generating when any other request arrives
        (`interrupt_requests`, on by default), a model listing included. A provider the
        last probe found down is probed all the same: only a probe brings it back."""
        previous = self._statuses[provider_id]
        if previous.health == "unavailable":
            return None
        progress = self._activity.progress(provider_id)
        if progress.state != "alive":
            return None
        return ProviderStatus(
            id=provider_id,
            health="busy",
            models=previous.models,
            lifecycle=previous.lifecycle,
            detail=f"{_runs(progress.runs)} from IOP producing output at the runtime "
            "(health probe deferred until they stop)",
        )

    def _record(
        self, provider_id: str, status: ProviderStatus, probed_at: float | None = None
    ) -> bool:
        if probed_at is not None:
            self.probed_at[provider_id] = probed_at
        previous = self._statuses[provider_id]
        protocols = self._protocols[provider_id].protocols()
        if status.protocols != protocols:
            status = msgspec.structs.replace(status, protocols=protocols)
        if status.health == "busy" and status.model_states is None:
            # A busy provider was not asked: what it holds is what it held.
            status = msgspec.structs.replace(
                status, model_states=previous.model_states, max_loaded=previous.max_loaded
            )
        self._statuses[provider_id] = status
        changed = _reported(previous) != _reported(status)
        if changed and previous.health != status.health:
            if status.health == "unavailable":
                level = logging.WARNING
            elif "busy" in (previous.health, status.health):
                level = logging.DEBUG  # a generating provider flips between these often
            else:
                level = logging.INFO
            log.log(
                level,
                "provider %s is %s%s",
                provider_id,
                status.health,
                f": {status.detail}" if status.detail else "",
            )
        return changed

    async def _probe(self, provider_id: str, adapter: Adapter) -> ProviderStatus:
        timeout_s = min(self._probe_timeout_s, adapter.provider.adapter.health_interval_s)
        try:
            with trio.fail_after(timeout_s):
                status = await adapter.probe()
        except trio.TooSlowError:
            accepted = isinstance(adapter, ProbeWitness) and adapter.probe_reached_upstream
            return self._timed_out(
                provider_id, f"health probe timed out after {timeout_s:g}s", accepted=accepted
            )
        except ProbeTimeout as exc:  # the adapter's own: connected, then no answer
            return self._timed_out(provider_id, f"health probe timed out ({exc})", accepted=True)
        except Exception as exc:  # a probe bug marks its provider down, never the Node
            log.debug("health probe of %s raised", provider_id, exc_info=True)
            return _unavailable(provider_id, f"health probe failed: {type(exc).__name__}: {exc}")
        if status.id != provider_id:
            status = msgspec.structs.replace(status, id=provider_id)
        return status

    def _timed_out(self, provider_id: str, what: str, *, accepted: bool) -> ProviderStatus:
        """A probe got no answer in time: busy if the provider's runs progress, or, with
        none in flight, if the runtime `accepted` the probe's connection; else down."""
        progress = self._activity.progress(provider_id)
        runs = _runs(progress.runs)
        previous = self._statuses[provider_id]
        match progress.state:
            case "alive":
                return ProviderStatus(
                    id=provider_id,
                    health="busy",
                    models=previous.models,
                    lifecycle=previous.lifecycle,
                    detail=f"{what} while {runs} from IOP produced output at the runtime",
                )
            case "stalled":
                return _unavailable(
                    provider_id,
                    f"{what}, and its {runs} in flight produced nothing for "
                    f"{progress.silent_s:.0f}s (stalled)",
                )
            case _ if accepted:
                return ProviderStatus(
                    id=provider_id,
                    health="busy",
                    models=previous.models or list(self._adapters[provider_id].provider.models),
                    lifecycle=previous.lifecycle,
                    detail=f"{ACCEPTED_BUT_SILENT} ({what}); no run from IOP in flight: "
                    "the runtime is busy with work IOP did not send",
                )
            case _:
                return _unavailable(provider_id, f"{what} with no run in flight")

    async def _report(self, probed: list[str]) -> None:
        async with self._report_lock:
            await self._on_change(self.statuses(), probed)


def _reported(status: ProviderStatus) -> tuple[object, ...]:
    """What of a status is worth a report to the Edge when it changes (not the detail,
    which a busy provider rewrites at every interval)."""
    return (
        status.health,
        status.models,
        status.protocols,
        status.model_states,
        status.max_loaded,
    )


def _support_of(adapter: Adapter) -> ProtocolSupport:
    """The adapter's record of what its upstream speaks; an adapter that relays nothing
    natively speaks what its config says of chat, and never learns more."""
    if isinstance(adapter, NativeRelay):
        return adapter.protocol_support
    return ProtocolSupport(adapter.provider, relayable=("chat",))


def _unavailable(provider_id: str, detail: str) -> ProviderStatus:
    return ProviderStatus(id=provider_id, health="unavailable", detail=detail)


def _runs(count: int) -> str:
    return f"{count} run{'s' if count != 1 else ''}"
