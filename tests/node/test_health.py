"""Health probes (`iop_node.health`): first report after the initial probes, then changes only."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_node.adapters.base import Emit, RunResult
from iop_node.health import HealthMonitor
from schemas.config import AdapterSettings, ProviderConfig
from schemas.wire import ProviderStatus, Run


class ScriptedProbe:
    """An adapter whose probe answers come from a script (the last answer repeats).

    An answer is a status, an exception to raise, or `None` for "hang until cancelled".
    """

    def __init__(
        self, provider_id: str, answers: list[ProviderStatus | Exception | None], interval_s: float
    ) -> None:
        self.provider = ProviderConfig(
            id=provider_id,
            type="vllm",
            models=["m"],
            capacity=1,
            adapter=AdapterSettings(health_interval_s=interval_s),
        )
        self._answers = answers
        self.probes = 0

    async def probe(self) -> ProviderStatus:
        answer = self._answers[min(self.probes, len(self._answers) - 1)]
        self.probes += 1
        if answer is None:
            await trio.sleep_forever()
        if isinstance(answer, Exception):
            raise answer
        assert answer is not None
        return answer

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


def _up(provider_id: str, *models: str) -> ProviderStatus:
    return ProviderStatus(id=provider_id, health="available", models=list(models or ("m",)))


class Reports:
    def __init__(self) -> None:
        self.reports: list[tuple[float, list[ProviderStatus]]] = []

    async def __call__(self, statuses: list[ProviderStatus]) -> None:
        self.reports.append((trio.current_time(), statuses))


async def test_first_report_waits_for_every_initial_probe(autojump_clock: trio.abc.Clock) -> None:
    slow = ScriptedProbe("slow", [None, _up("slow")], interval_s=10)
    fast = ScriptedProbe("fast", [_up("fast")], interval_s=10)
    reports = Reports()
    monitor = HealthMonitor({"fast": fast, "slow": slow}, reports, probe_timeout_s=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        # The slow probe timed out: started after the probe timeout, with one report.
        assert trio.current_time() == pytest.approx(3)
        [(_, statuses)] = reports.reports
        assert [status.id for status in statuses] == ["fast", "slow"]
        assert statuses[0] == _up("fast")
        assert statuses[1].health == "unavailable"
        assert statuses[1].detail == "health probe timed out after 3s"

        # At the next interval the slow provider answers: one more report.
        await trio.sleep(10)
        await trio.testing.wait_all_tasks_blocked()
        assert len(reports.reports) == 2
        assert reports.reports[1][1] == [_up("fast"), _up("slow")]
        nursery.cancel_scope.cancel()


async def test_only_changes_are_reported(autojump_clock: trio.abc.Clock) -> None:
    adapter = ScriptedProbe(
        "p1",
        [
            _up("p1"),
            _up("p1"),
            ProviderStatus(id="p1", health="available", models=["m"], detail="new detail"),
            _up("p1", "m", "m2"),
            RuntimeError("connection refused"),
            RuntimeError("connection refused again"),
            _up("p1", "m", "m2"),
        ],
        interval_s=5,
    )
    reports = Reports()
    async with trio.open_nursery() as nursery:
        await nursery.start(HealthMonitor({"p1": adapter}, reports).run)
        await trio.sleep(5 * 6 + 1)
        nursery.cancel_scope.cancel()
    assert adapter.probes == 7
    times = [time for time, _ in reports.reports]
    assert times == pytest.approx([0, 15, 20, 30])
    statuses = [report[0] for _, report in reports.reports]
    assert [status.health for status in statuses] == [
        "available",
        "available",
        "unavailable",
        "available",
    ]
    assert statuses[1].models == ["m", "m2"]
    assert statuses[2].detail == "health probe failed: RuntimeError: connection refused"


async def test_probe_timeout_never_exceeds_the_interval(autojump_clock: trio.abc.Clock) -> None:
    adapter = ScriptedProbe("p1", [None], interval_s=0.5)
    reports = Reports()
    async with trio.open_nursery() as nursery:
        await nursery.start(HealthMonitor({"p1": adapter}, reports, probe_timeout_s=5).run)
        assert trio.current_time() == pytest.approx(0.5)
        nursery.cancel_scope.cancel()
    assert reports.reports[0][1][0].detail == "health probe timed out after 0.5s"


async def test_status_id_is_the_provider_id() -> None:
    adapter = ScriptedProbe("p1", [_up("something-else")], interval_s=10)
    reports = Reports()
    async with trio.open_nursery() as nursery:
        await nursery.start(HealthMonitor({"p1": adapter}, reports).run)
        nursery.cancel_scope.cancel()
    assert reports.reports[0][1] == [_up("p1")]


async def test_no_adapters_still_reports_once() -> None:
    reports = Reports()
    await HealthMonitor({}, reports).run()
    [(_, statuses)] = reports.reports
    assert statuses == []
