"""The books of ended requests (`metering.books`): metrics, access lines and activity are
entered in batches, in order, never lost, and never missed by a reader."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

from iop_edge.runtime.metering.access_log import AccessLog, RefusedRequest
from iop_edge.runtime.metering.activity import Activity
from iop_edge.runtime.metering.books import HOLD_S, MAX_KEPT, RunBooks
from iop_edge.runtime.metering.metering import Metering, RunRecord
from iop_edge.runtime.metering.metrics import EdgeMetrics
from iop_edge.runtime.metering.usage_ledger.usage import UsageLedger
from schemas.catalog import Catalog
from schemas.runtime.log_lines import LineHandler, TextLinesFormatter
from schemas.wire import Usage


def _record(run_id: str, **changes: object) -> RunRecord:
    base = RunRecord(
        run_id=run_id,
        request_id=run_id,
        model="m",
        principal_ref="alice",
        token_ref="t",
        alias=None,
        provider="p1",
        node="n1",
        status=200,
        code=None,
        usage=Usage(prompt_tokens=10, completion_tokens=21, total_tokens=31),
        usage_source="provider",
        latency_s=0.25,
        ttft_s=None,
        queued_s=0.0,
    )
    return msgspec.structs.replace(base, **changes)


class _Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def lines(self) -> list[str]:
        return "".join(self.writes).splitlines()


class _Books:
    """A `RunBooks` over real metrics, an access log into `stream` and an activity."""

    def __init__(self, logger: logging.Logger, tmp_path: Path) -> None:
        self.stream = _Writes()
        handler = LineHandler(self.stream)
        handler.setFormatter(TextLinesFormatter())
        logger.handlers[:] = [handler]
        self.metrics = EdgeMetrics(lambda: Catalog(revision=1))
        self.activity = Activity(bucket_s=10, buckets=6, clock=time.time)
        metering = Metering(self.metrics, UsageLedger(tmp_path / "ledger.sqlite"))
        self.books = RunBooks(metering, AccessLog(logger), self.activity)

    def counted(self) -> float:
        value = self.metrics.registry.get_sample_value(
            "iop_requests_total", {"model": "m", "provider": "p1", "status": "200", "code": ""}
        )
        return value or 0.0

    def requests_in_buckets(self) -> int:
        return sum(bucket.requests for bucket in self.activity.report().buckets)


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("iop_test.books")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    yield logger
    logger.handlers.clear()
    logger.propagate = True


def test_without_its_task_a_run_is_entered_at_once(logger: logging.Logger, tmp_path: Path) -> None:
    books = _Books(logger, tmp_path)
    books.books.add(_record("a"))
    assert books.counted() == 1
    assert [line.split()[4] for line in books.stream.lines()] == ["request_id=a"]
    assert books.requests_in_buckets() == 1


async def test_runs_are_entered_together_within_the_hold(
    logger: logging.Logger, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    books = _Books(logger, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(books.books.run)
        for run_id in ("a", "b", "c"):
            books.books.add(_record(run_id))
        assert books.counted() == 0 and books.stream.writes == []
        await trio.sleep(HOLD_S)
        await trio.testing.wait_all_tasks_blocked()
        assert books.counted() == 3
        [one_write] = books.stream.writes  # one write for the batch
        assert [line.split()[4] for line in one_write.splitlines()] == [
            "request_id=a",
            "request_id=b",
            "request_id=c",
        ]
        nursery.cancel_scope.cancel()


async def test_a_refused_request_is_entered_in_its_place_among_the_runs(
    logger: logging.Logger, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A request refused before it became a run is kept like a run: its line comes in
    the order it ended, in the same write, and the pool page counts it."""
    books = _Books(logger, tmp_path)
    refused = RefusedRequest("b", "/v1/chat/completions", 401, "invalid_api_key", 0.001)
    async with trio.open_nursery() as nursery:
        await nursery.start(books.books.run)
        books.books.add(_record("a"))
        books.books.refused(refused)
        books.books.add(_record("c"))
        assert books.stream.writes == [] and books.requests_in_buckets() == 0
        await trio.sleep(HOLD_S)
        await trio.testing.wait_all_tasks_blocked()
        [one_write] = books.stream.writes
        assert [line.split()[4] for line in one_write.splitlines()] == [
            "request_id=a",
            "request_id=b",
            "request_id=c",
        ]
        assert "path=/v1/chat/completions status=401" in one_write.splitlines()[1]
        assert books.requests_in_buckets() == 3 and books.counted() == 2
        nursery.cancel_scope.cancel()


async def test_a_reader_that_settles_misses_no_run(
    logger: logging.Logger, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    books = _Books(logger, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(books.books.run)
        books.books.add(_record("a"))
        books.books.settle()  # what /metrics and /activity do first
        assert books.counted() == 1 and books.requests_in_buckets() == 1
        nursery.cancel_scope.cancel()


async def test_a_burst_is_entered_a_batch_at_a_time_and_the_rest_at_the_end(
    logger: logging.Logger, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    books = _Books(logger, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(books.books.run)
        for index in range(MAX_KEPT + 5):
            books.books.add(_record(f"r{index}"))
        assert books.counted() == MAX_KEPT  # the batch that filled up, at once
        nursery.cancel_scope.cancel()  # the Edge stops: what is kept is entered
    assert books.counted() == MAX_KEPT + 5
    assert len(books.stream.lines()) == MAX_KEPT + 5


async def test_a_line_and_a_bucket_carry_the_time_the_run_ended(
    logger: logging.Logger,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    autojump_clock: trio.testing.MockClock,
) -> None:
    now = [1_764_000_009.5]
    monkeypatch.setattr("time.time", lambda: now[0])
    books = _Books(logger, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(books.books.run)
        books.books.add(_record("a"))
        now[0] = 1_764_000_010.5  # entered in the next 10 s bucket's time
        await trio.sleep(HOLD_S)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    [line] = books.stream.lines()
    ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_764_000_009))
    assert line.startswith(f"{ended},500 ")
    report = books.activity.report()
    assert [bucket.requests for bucket in report.buckets][-2:] == [1, 0]


async def test_a_run_that_cannot_be_entered_costs_no_other_its_entry(
    logger: logging.Logger,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    autojump_clock: trio.testing.MockClock,
) -> None:
    books = _Books(logger, tmp_path)
    broken = _record("broken", latency_s="not a number")  # a defect upstream of the books
    async with trio.open_nursery() as nursery:
        await nursery.start(books.books.run)
        books.books.add(broken)
        books.books.add(_record("b"))
        books.books.settle()
        nursery.cancel_scope.cancel()
    assert [line.split()[4] for line in books.stream.lines()] == ["request_id=b"]
    assert "request broken could not be counted" in caplog.text
