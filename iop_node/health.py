"""Periodic health probes for one registry's adapters (SPEC §3 `status`, §9).

The Edge routes only to providers whose health is `available`, so it must hear about a
change quickly, and about nothing else: the monitor reports the full provider list
(`status` carries every provider, so a lost message is repaired by the next one) only
when some provider's health or model list changed.

- At start, every adapter is probed concurrently and the first report is sent once all
  initial probes finished; the monitor is "started" after that report.
- Then each adapter is probed every `provider.adapter.health_interval_s`.
- A probe is bounded by `probe_timeout_s` (never more than the interval). A probe that
  times out or raises makes the provider `unavailable`, with the reason in `detail`;
  a probe must never take the Node down.
- Reports are serialised and each one is taken when it is sent, so the last report the
  Edge receives always describes the latest state.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import msgspec
import trio

from iop_node.adapters.base import Adapter
from schemas.wire import ProviderStatus

log = logging.getLogger(__name__)

DEFAULT_PROBE_TIMEOUT_S = 5.0

OnStatus = Callable[[list[ProviderStatus]], Awaitable[None]]
"""Receives every provider's status whenever one of them changed."""


class HealthMonitor:
    """Probes the adapters of one registry and reports changes through `on_change`."""

    def __init__(
        self,
        adapters: Mapping[str, Adapter],
        on_change: OnStatus,
        *,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
    ) -> None:
        self._adapters = dict(adapters)
        self._on_change = on_change
        self._probe_timeout_s = probe_timeout_s
        self._statuses: dict[str, ProviderStatus] = {
            provider_id: ProviderStatus(id=provider_id, health="unknown")
            for provider_id in self._adapters
        }
        self._report_lock = trio.Lock()

    def statuses(self) -> list[ProviderStatus]:
        """The latest status of every provider, in config order."""
        return list(self._statuses.values())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probe all adapters, report, signal started, then probe each one periodically."""
        async with trio.open_nursery() as nursery:
            for provider_id, adapter in self._adapters.items():
                nursery.start_soon(self._initial_probe, provider_id, adapter)
        await self._report()
        task_status.started()
        async with trio.open_nursery() as nursery:
            for provider_id, adapter in self._adapters.items():
                nursery.start_soon(self._watch, provider_id, adapter, name=f"health {provider_id}")

    async def _watch(self, provider_id: str, adapter: Adapter) -> None:
        interval_s = adapter.provider.adapter.health_interval_s
        while True:
            await trio.sleep(interval_s)
            if self._record(provider_id, await self._probe(provider_id, adapter)):
                await self._report()

    async def _initial_probe(self, provider_id: str, adapter: Adapter) -> None:
        self._record(provider_id, await self._probe(provider_id, adapter))

    def _record(self, provider_id: str, status: ProviderStatus) -> bool:
        previous = self._statuses[provider_id]
        self._statuses[provider_id] = status
        changed = (previous.health, previous.models) != (status.health, status.models)
        if changed and previous.health != status.health:
            level = logging.INFO if status.health == "available" else logging.WARNING
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
            return _unavailable(provider_id, f"health probe timed out after {timeout_s:g}s")
        except Exception as exc:  # a probe bug marks its provider down, never the Node
            log.debug("health probe of %s raised", provider_id, exc_info=True)
            return _unavailable(provider_id, f"health probe failed: {type(exc).__name__}: {exc}")
        if status.id != provider_id:
            status = msgspec.structs.replace(status, id=provider_id)
        return status

    async def _report(self) -> None:
        async with self._report_lock:
            await self._on_change(self.statuses())


def _unavailable(provider_id: str, detail: str) -> ProviderStatus:
    return ProviderStatus(id=provider_id, health="unavailable", detail=detail)
