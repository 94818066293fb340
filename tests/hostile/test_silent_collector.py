"""A trace collector that accepts connections and never answers does not hold a stop.

The collector here is a TCP server on 127.0.0.1:0 that reads whatever it is sent and
never writes a byte: the worst a collector can do to an exporter short of refusing
(a refused connection fails at once). The Edge's and the Node's tracing are stopped
while an export is waiting on it; each returns within `SHUTDOWN_TIMEOUT_S` (1 s), far
below the exporter's own 10 s timeout and its retries, which the stop used to wait for.
The bound is the stop's own deadline; these tests guard it with `GUARD_S`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import trio

from iop_edge.runtime.metering.tracing import edge_tracing
from iop_node.cli import TELEMETRY_FLAGS
from iop_node.tracing import node_tracing
from schemas.config import TelemetrySection
from schemas.runtime.spans import Tracing
from schemas.runtime.telemetry import SHUTDOWN_TIMEOUT_S
from tests.timing import GUARD_S

pytest.importorskip("opentelemetry.sdk", reason="the `otel` extra is not installed")

#: The export thread's wait between batches (the SDK's `OTEL_BSP_SCHEDULE_DELAY`, ms):
#: short, so an export is under way before the stop begins.
SCHEDULE_DELAY_MS = "20"


class SilentCollector:
    """Accepts connections, reads every request, answers none."""

    def __init__(self) -> None:
        self.url = ""
        self.received = trio.Event()
        """Set once an export request's bytes arrived."""
        self.bytes_in = 0

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1/traces"
        task_status.started()
        await trio.serve_listeners(self._hold, listeners)

    async def _hold(self, stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some():
                self.bytes_in += len(data)
                self.received.set()


async def _stops_while_an_export_waits(
    monkeypatch: pytest.MonkeyPatch,
    start: Callable[[str], tuple[Tracing, Callable[[], object]]],
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", SCHEDULE_DELAY_MS)
    collector = SilentCollector()
    async with trio.open_nursery() as nursery:
        await nursery.start(collector.serve)
        tracing, aclose = start(collector.url)
        for index in range(3):
            tracing.start(f"span-{index}", "internal", None).end()
        with trio.fail_after(GUARD_S):
            await collector.received.wait()  # the export thread is now waiting on it
        began = time.monotonic()
        with trio.fail_after(GUARD_S):
            await aclose()  # type: ignore[misc]
        took = time.monotonic() - began
        assert collector.bytes_in > 0  # an export was sent and is still unanswered
        nursery.cancel_scope.cancel()
    # The stop's own deadline, not the exporter's timeout (10 s) or the guard, ended it.
    assert took < GUARD_S
    assert SHUTDOWN_TIMEOUT_S <= 1.0


async def test_an_edge_stops_although_the_collector_never_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def start(url: str) -> tuple[Tracing, Callable[[], object]]:
        tracing = edge_tracing(
            TelemetrySection(endpoint=url),
            {},
            instance_id="edge-test",
            version="0",
            provider_name=lambda provider: provider,
        )
        assert tracing is not None
        return tracing._tracing, tracing.aclose

    await _stops_while_an_export_waits(monkeypatch, start)


async def test_a_node_stops_although_the_collector_never_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def start(url: str) -> tuple[Tracing, Callable[[], object]]:
        tracing = node_tracing(
            TelemetrySection(endpoint=url), {}, node_id="node-1", version="0", names=TELEMETRY_FLAGS
        )
        assert tracing is not None
        return tracing.tracing, tracing.aclose

    await _stops_while_an_export_waits(monkeypatch, start)


async def test_the_pipeline_itself_lets_go_of_a_silent_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The export thread's own shutdown is bounded too (the worker thread joined within
    its timeout), so an abandoned flush is not one that keeps exporting for long."""

    def start(url: str) -> tuple[Tracing, Callable[[], object]]:
        tracing = node_tracing(
            TelemetrySection(endpoint=url), {}, node_id="node-1", version="0", names=TELEMETRY_FLAGS
        )
        assert tracing is not None
        inner = tracing.tracing

        async def shutdown_in_thread() -> None:
            await trio.to_thread.run_sync(inner.shutdown)  # not abandoned: waited for

        return inner, shutdown_in_thread

    await _stops_while_an_export_waits(monkeypatch, start)
