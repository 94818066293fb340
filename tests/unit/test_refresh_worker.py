"""The refresh worker process (`runtime.refresh.worker`): a worker that crashes, hangs or
ended while idle fails at most the refresh it was doing, with a clear error, and the
running config is untouched; the next refresh starts another worker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

from iop_edge.core.configuration.config import parse_config
from iop_edge.runtime.refresh.audit import AuditLog
from iop_edge.runtime.refresh.refresh import Refresher
from iop_edge.runtime.refresh.worker_client import RefreshWorker
from iop_edge.runtime.refresh.worker_protocol import VERSION
from tests.unit.test_refresh import FakeEdge, apply, config_dict, to_yaml, with_capacity

#: A worker that says hello, as the real one does, and then never answers.
SILENT = (
    "import sys, time, msgspec\n"
    "from iop_edge.runtime.refresh.worker_protocol import VERSION, Hello, frame\n"
    "sys.stdout.buffer.write(frame(msgspec.msgpack.encode(Hello(VERSION))))\n"
    "sys.stdout.buffer.flush()\n"
    "time.sleep(3600)\n"
)


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge(parse_config(to_yaml(config_dict())))


def audited(tmp_path: Path) -> list[str]:
    return (tmp_path / "state" / "refresh-audit.jsonl").read_text().splitlines()


async def test_a_worker_that_crashes_fails_the_refresh_and_the_running_config_stays(
    edge: FakeEdge, tmp_path: Path
) -> None:
    crashing = RefreshWorker([sys.executable, "-c", "raise SystemExit(3)"])
    refresher = Refresher(
        edge, config_path=None, audit=AuditLog(tmp_path / "state"), worker=crashing
    )
    before = edge.snapshot

    result = await refresher.refresh(apply(with_capacity(8, "gpu1")))

    assert result.verdict == "unavailable" and result.report.outcome == "rejected"
    [error] = result.report.errors
    assert error.path == ""
    assert "the refresh worker exited (code 3) without answering" in error.message
    assert "nothing was applied" in error.message
    assert edge.snapshot is before and edge.swaps == [] and edge.pushes == []
    assert '"verdict":"unavailable"' in audited(tmp_path)[-1]


async def test_a_worker_that_hangs_is_stopped_at_the_deadline_and_the_next_one_started(
    edge: FakeEdge, tmp_path: Path
) -> None:
    silent = RefreshWorker([sys.executable, "-c", SILENT])
    refresher = Refresher(
        edge,
        config_path=None,
        audit=AuditLog(tmp_path / "state"),
        worker=silent,
        worker_deadline_s=0.2,
    )
    before = edge.snapshot

    result = await refresher.refresh(apply(with_capacity(8, "gpu1")))

    assert result.verdict == "unavailable"
    assert "did not answer within 0.2s" in result.report.errors[0].message
    assert edge.snapshot is before and edge.swaps == []
    assert silent.process is None  # stopped, not left behind
    assert silent.starts == 1
    await refresher.refresh(apply(with_capacity(8, "gpu1")))
    assert silent.starts == 2  # a new worker for the next refresh
    await refresher.aclose()


async def test_a_worker_that_ended_while_idle_is_replaced_and_told_the_running_config(
    edge: FakeEdge, tmp_path: Path
) -> None:
    refresher = Refresher(edge, config_path=None, audit=AuditLog(tmp_path / "state"))
    first = await refresher.refresh(apply(with_capacity(8, "gpu1")))
    assert first.verdict == "accepted" and edge.snapshot.revision == 2
    process = refresher.worker.process
    assert process is not None
    process.kill()
    with trio.fail_after(30):
        await process.wait()

    second = await refresher.refresh(apply(with_capacity(9, "gpu1")))

    assert second.verdict == "accepted", second.report.errors
    # diffed against the running config (revision 2), which the new worker was sent
    assert [change.path for change in second.report.changes] == [
        "nodes[gpu1].providers[gpu1-sim].capacity"
    ]
    assert edge.snapshot.revision == 3
    assert edge.snapshot.providers["gpu1-sim"].capacity == 9
    assert refresher.worker.starts == 2
    await refresher.aclose()
    assert refresher.worker.process is None


async def test_a_worker_of_another_protocol_version_is_stopped_and_named(
    edge: FakeEdge, tmp_path: Path
) -> None:
    other = SILENT.replace("Hello(VERSION)", "Hello(VERSION + 1)")
    worker = RefreshWorker([sys.executable, "-c", other])
    refresher = Refresher(edge, config_path=None, audit=AuditLog(tmp_path / "state"), worker=worker)

    result = await refresher.refresh(apply(with_capacity(8, "gpu1")))

    assert result.verdict == "unavailable"
    message = result.report.errors[0].message
    assert f"speaks protocol {VERSION + 1}, this Edge {VERSION}" in message
    assert worker.process is None  # stopped, not reused by the next refresh
    assert edge.swaps == []


#: A worker that says hello and answers every request with a plan whose long lists it
#: does not say the lengths of (`worker_protocol`, Rule 5), and nothing after it.
UNFRAMED_PLAN = (
    "import sys, msgspec\n"
    "from iop_edge.runtime.refresh.worker_protocol import VERSION, Hello, Plan, Prepared, frame\n"
    "out = sys.stdout.buffer\n"
    "out.write(frame(msgspec.msgpack.encode(Hello(VERSION))))\n"
    "out.flush()\n"
    "sys.stdin.buffer.read(4)\n"
    "plan = Plan(changes=[], changed_nodes=[], changed_providers=[], changed_models=[],\n"
    "            pending_restart=[], errors=[])\n"
    "out.write(frame(msgspec.msgpack.encode(Prepared(config_sha256='0' * 64, plan=plan))))\n"
    "out.flush()\n"
    "sys.stdin.buffer.read()\n"
)


async def test_a_worker_whose_plan_breaks_the_protocol_fails_the_refresh(
    edge: FakeEdge, tmp_path: Path
) -> None:
    worker = RefreshWorker([sys.executable, "-c", UNFRAMED_PLAN])
    refresher = Refresher(edge, config_path=None, audit=AuditLog(tmp_path / "state"), worker=worker)

    result = await refresher.refresh(apply(with_capacity(8, "gpu1")))

    assert result.verdict == "unavailable"
    assert "answered a plan without its lists' lengths" in result.report.errors[0].message
    assert worker.process is None and edge.swaps == []


def test_the_worker_process_does_not_import_trio() -> None:
    """The worker reads and plans configs and needs no event loop: it leaves Trio out (6 of
    the 30 MiB it would hold, half the CPU of its start), as `runtime.lifecycle.heap`
    keeps the loop's part in `heap_keeper`."""
    probe = (
        "import sys, iop_edge.procedures.refresh_worker\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'trio'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
