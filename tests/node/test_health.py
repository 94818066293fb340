"""Health probes (`iop_node.health`): first report after the initial probes, then changes
only; a probe that times out while runs progress means busy, not down (design §4 item 11)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_node.adapters.base import Emit, ProbeTimeout, RunResult
from iop_node.health import ON_DEMAND_GAP_S, HealthMonitor
from iop_node.runs.activity import ProviderActivity
from schemas.config import AdapterSettings, ProviderConfig
from schemas.wire import ModelState, ProviderStatus, Run


class ScriptedProbe:
    """An adapter whose probe answers come from a script (the last answer repeats).

    An answer is a status, an exception to raise, or `None` for "hang until cancelled".
    """

    def __init__(
        self,
        provider_id: str,
        answers: list[ProviderStatus | Exception | None],
        interval_s: float,
        first_byte_timeout_s: float | None = None,
    ) -> None:
        self.provider = ProviderConfig(
            id=provider_id,
            type="vllm",
            models=["m"],
            capacity=1,
            adapter=AdapterSettings(
                health_interval_s=interval_s, first_byte_timeout_s=first_byte_timeout_s
            ),
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
    """An available provider as reported: it speaks chat (its adapter relays no other
    protocol natively)."""
    return ProviderStatus(
        id=provider_id, health="available", models=list(models or ("m",)), protocols=["chat"]
    )


class Reports:
    def __init__(self) -> None:
        self.reports: list[tuple[float, list[ProviderStatus]]] = []
        self.probed: list[tuple[float, list[str]]] = []
        """When a report answered a probe on demand, and for which providers."""

    async def __call__(self, statuses: list[ProviderStatus], probed: list[str]) -> None:
        self.reports.append((trio.current_time(), statuses))
        if probed:
            self.probed.append((trio.current_time(), probed))


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
        assert statuses[1].detail == "health probe timed out after 3s with no run in flight"

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
    assert reports.reports[0][1][0].detail == (
        "health probe timed out after 0.5s with no run in flight"
    )


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


# --- busy is not down -----------------------------------------------------------------------


async def test_a_provider_producing_output_is_busy_and_not_probed_until_its_runs_stall(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Output is proof of life, and a probe could cut the stream (llama.cpp's server
    interrupts the request it generates for when another arrives): while a run produces
    output the provider is `busy` (in the pool, models kept) and nobody probes it. Once
    the run shows nothing for its first-byte budget, the next interval probes, and a
    probe that gets no answer makes it `unavailable`."""
    adapter = ScriptedProbe(
        "p1", [_up("p1", "m", "m2"), None], interval_s=10, first_byte_timeout_s=25
    )
    activity = ProviderActivity()
    reports = Reports()
    monitor = HealthMonitor({"p1": adapter}, reports, probe_timeout_s=3, activity=activity)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        assert adapter.probes == 1
        run = activity.start(adapter.provider, stream=True)

        async def generate() -> None:  # a chunk every 5 s until t=40, then silence
            for _ in range(8):
                await trio.sleep(5)
                run.output()

        nursery.start_soon(generate)
        await trio.sleep(11)
        [status] = reports.reports[-1][1]
        assert status.health == "busy"
        assert status.models == ["m", "m2"]  # still serving what it served
        assert status.detail == (
            "1 run from IOP producing output at the runtime (health probe deferred until they stop)"
        )

        await trio.sleep(61 - 11)  # t=60: silent for 20 s, within its 25 s budget
        assert adapter.probes == 1  # never probed while it generated
        assert len(reports.reports) == 2  # busy -> busy is no change

        await trio.sleep(74 - 61)  # t=70: silent for 30 s: probed, no answer by t=73
        assert adapter.probes == 2
        [status] = reports.reports[-1][1]
        assert status.health == "unavailable"
        assert status.detail == (
            "health probe timed out after 3s, and its 1 run in flight produced nothing "
            "for 33s (stalled)"
        )
        activity.finish("p1", run)
        nursery.cancel_scope.cancel()


async def test_the_last_run_ending_ends_a_deferred_busy_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A `busy` made from the provider's runs names runs; once the last one ended it is
    stale, so the provider is probed then (within the on-demand gap), not an interval
    later."""
    adapter = ScriptedProbe("p1", [_up("p1", "m"), _up("p1", "m")], interval_s=10)
    activity = ProviderActivity()
    reports = Reports()
    monitor = HealthMonitor({"p1": adapter}, reports, probe_timeout_s=3, activity=activity)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        run = activity.start(adapter.provider, stream=True)
        run.output()
        await trio.sleep(10.5)  # the interval's look: busy, the probe deferred
        [status] = reports.reports[-1][1]
        assert status.health == "busy" and adapter.probes == 1
        ended_at = trio.current_time()
        activity.finish("p1", run)
        monitor.runs_ended("p1")
        await trio.sleep(2)
        assert adapter.probes == 2
        [status] = reports.reports[-1][1]
        assert status.health == "available"
        assert reports.reports[-1][0] - ended_at <= ON_DEMAND_GAP_S
        nursery.cancel_scope.cancel()


async def test_a_demand_never_delays_a_probe_past_its_interval(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An interval shorter than the on-demand gap probes as often as it says: a demand
    (a run ending, an Edge asking) waits for the interval, not for the gap."""
    adapter = ScriptedProbe("p1", [_up("p1", "m")] * 4, interval_s=0.25)
    reports = Reports()
    monitor = HealthMonitor({"p1": adapter}, reports, probe_timeout_s=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        began = trio.current_time()
        monitor.demand(["p1"])
        await trio.sleep(0.3)
        [(answered_at, probed)] = reports.probed
        assert probed == ["p1"] and answered_at - began <= 0.25
        nursery.cancel_scope.cancel()


async def test_a_run_that_starts_while_a_probe_hangs_makes_the_timeout_busy(
    autojump_clock: trio.abc.Clock,
) -> None:
    adapter = ScriptedProbe("p1", [_up("p1"), None], interval_s=10)
    activity = ProviderActivity()
    reports = Reports()
    monitor = HealthMonitor({"p1": adapter}, reports, probe_timeout_s=3, activity=activity)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        await trio.sleep(11)  # the probe at t=10 hangs; a non-stream run starts at t=11
        run = activity.start(adapter.provider, stream=False)
        await trio.sleep(3)
        [status] = reports.reports[-1][1]
        assert (status.health, status.detail) == (
            "busy",
            "health probe timed out after 3s while 1 run from IOP produced output at the runtime",
        )
        activity.finish("p1", run)  # done, and still no answer: down at the next probe
        await trio.sleep(10 + 3)
        [status] = reports.reports[-1][1]
        assert (status.health, status.detail) == (
            "unavailable",
            "health probe timed out after 3s with no run in flight",
        )
        nursery.cancel_scope.cancel()


async def test_a_provider_found_down_is_probed_even_with_runs_in_flight(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Connection refused is an answer, not silence: down, and only a probe that passes
    brings it back, whatever its older runs still do."""
    adapter = ScriptedProbe(
        "p1",
        [_up("p1"), RuntimeError("connection refused"), ProbeTimeout("timed out: read")],
        interval_s=10,
    )
    activity = ProviderActivity()
    reports = Reports()
    async with trio.open_nursery() as nursery:
        await nursery.start(HealthMonitor({"p1": adapter}, reports, activity=activity).run)
        await trio.sleep(11)
        [status] = reports.reports[-1][1]
        assert (status.health, status.detail) == (
            "unavailable",
            "health probe failed: RuntimeError: connection refused",
        )
        run = activity.start(adapter.provider, stream=True)  # admitted before the outage
        await trio.sleep(10)
        assert adapter.probes == 3  # probed although the run is young
        [status] = reports.reports[-1][1]  # the adapter's own timeout, judged by the run
        assert status.health == "busy"
        assert status.detail is not None
        assert status.detail.startswith("health probe timed out (timed out: read)")
        activity.finish("p1", run)
        nursery.cancel_scope.cancel()


def _holding(provider_id: str, **states: str) -> ProviderStatus:
    """An available provider whose runtime reports its models' load states."""
    return ProviderStatus(
        id=provider_id,
        health="available",
        models=list(states),
        protocols=["chat"],
        model_states=[ModelState(name=n, state=s) for n, s in states.items()],  # type: ignore[arg-type]
        max_loaded=1,
    )


async def test_a_change_of_load_state_is_reported_like_a_change_of_health(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The runtime unloaded one model and loaded the other (another client asked it, say):
    the Edge hears of it at the next probe, and not again while nothing changes."""
    adapter = ScriptedProbe(
        "router",
        [
            _holding("router", a="loaded", b="unloaded"),
            _holding("router", a="loaded", b="unloaded"),
            _holding("router", a="unloaded", b="loading"),
            _holding("router", a="unloaded", b="loaded"),
        ],
        interval_s=5,
    )
    reports = Reports()
    async with trio.open_nursery() as nursery:
        await nursery.start(HealthMonitor({"router": adapter}, reports).run)
        await trio.sleep(5 * 4 + 1)
        nursery.cancel_scope.cancel()
    assert [time for time, _ in reports.reports] == pytest.approx([0, 10, 15])
    held = [
        {s.name: s.state for s in report[0].model_states or ()} for _, report in reports.reports
    ]
    assert held == [
        {"a": "loaded", "b": "unloaded"},
        {"a": "unloaded", "b": "loading"},
        {"a": "unloaded", "b": "loaded"},
    ]


async def test_a_busy_provider_keeps_the_states_of_its_last_probe(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A probe that times out with the runtime accepting the connection is `busy`, and
    says nothing new of what it holds: the last probe's states stand."""
    adapter = ScriptedProbe(
        "router", [_holding("router", a="loaded"), ProbeTimeout("read timed out")], interval_s=5
    )
    reports = Reports()
    monitor = HealthMonitor({"router": adapter}, reports)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        await trio.sleep(6)
        nursery.cancel_scope.cancel()
    [busy] = monitor.statuses()
    assert busy.health == "busy"
    assert busy.model_states == [ModelState(name="a", state="loaded")]
    assert busy.max_loaded == 1


async def test_a_probe_on_demand_comes_at_once_and_at_most_once_a_second(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A runtime that came back is found by the probe a demand causes, not at the next
    periodic one; a storm of demands probes it once a second, one probe at a time, and
    each demanded probe is reported, changed or not."""
    down = RuntimeError("connection refused")
    adapter = ScriptedProbe("p1", [down, down, _up("p1")], interval_s=60)
    reports = Reports()
    monitor = HealthMonitor({"p1": adapter}, reports)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        assert adapter.probes == 1 and reports.reports[0][1][0].health == "unavailable"
        await trio.sleep(5)
        for _ in range(50):  # fifty callers refused in the same instant
            monitor.demand(["p1", "not-here"])
        await trio.testing.wait_all_tasks_blocked()
        assert adapter.probes == 2  # at once: no wait for the 60 s interval
        assert reports.probed == [(5, ["p1"])]  # still down, and said so
        monitor.demand(["p1"])
        await trio.testing.wait_all_tasks_blocked()
        assert adapter.probes == 2  # not twice within a second
        await trio.sleep(1)
        await trio.testing.wait_all_tasks_blocked()
        assert adapter.probes == 3
        assert reports.probed[-1] == (6, ["p1"])
        assert reports.reports[-1][1][0].health == "available"
        nursery.cancel_scope.cancel()
