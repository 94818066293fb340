"""A full disk under `state_dir`, on a real small tmpfs: every response a caller got is in
the usage ledger once there is room again; a full buffer refuses runs and says so; a
refresh that cannot be audited is refused; `serve` and `check-config` name the disk.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trio
import yaml

from iop_edge.runtime.metering.ledger import SQLITE_FILE
from tests.e2e.stack import Stack, one_sim_config, start_stack
from tests.small_disk import SmallDisk, small_disk
from tests.timing import GUARD_S

REPO = Path(__file__).resolve().parents[2]
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path, "8m") as mounted:
        yield mounted


async def _stack(
    nursery: trio.Nursery, tmp_path: Path, disk: SmallDisk, **edge_section: Any
) -> Stack:
    text = one_sim_config(
        disk.path / "state", edge_section=edge_section or None, dispatch={"max_queue": 64}
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


def _run_id(completion_id: str) -> str:
    return completion_id.split("-", 1)[-1]  # chatcmpl-<run id>


async def _chat(client: openai.AsyncOpenAI, stream: bool) -> str:
    """One completion; the run id of a response the caller got whole."""
    if not stream:
        completion = await client.chat.completions.create(
            model="m", max_tokens=5, messages=MESSAGES
        )
        return _run_id(completion.id)
    chunks = await client.chat.completions.create(
        model="m", max_tokens=5, messages=MESSAGES, stream=True
    )
    run_id, finish = "", None
    async for chunk in chunks:
        run_id = _run_id(chunk.id)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish is not None, "a stream cut short"
    return run_id


def _ledger_run_ids(stack: Stack) -> set[str]:
    path = Path(stack.edge.snapshot.config.edge.state_dir) / SQLITE_FILE
    with sqlite3.connect(path) as db:
        return {row[0] for row in db.execute("SELECT run_id FROM usage")}


async def _metric(stack: Stack, line_start: str) -> float:
    async with stack.admin() as admin:
        text = (await admin.get("/metrics")).text
    [value] = [line.split()[-1] for line in text.splitlines() if line.startswith(line_start)]
    return float(value)


async def test_every_response_during_a_full_disk_is_in_the_ledger_afterwards(
    nursery: trio.Nursery, tmp_path: Path, disk: SmallDisk
) -> None:
    stack = await _stack(nursery, tmp_path, disk)
    served: list[str] = []
    async with stack.client() as client:
        served.append(await _chat(client, stream=False))
        with trio.fail_after(GUARD_S):
            await stack.edge.ledger.wait_flushed()
        disk.fill()

        async def caller(index: int) -> None:
            for turn in range(5):
                served.append(await _chat(client, stream=(index + turn) % 2 == 0))

        async with trio.open_nursery() as callers:
            for index in range(8):
                callers.start_soon(caller, index)
        assert len(served) == 41
        assert stack.edge.ledger.state == "buffering"
        assert await _metric(stack, "iop_usage_unwritten_records ") > 0
        assert await _metric(stack, 'iop_usage_ledger_state{state="buffering"}') == 1
        async with stack.http() as http:  # waiting records do not make the Edge unready
            assert (await http.get("/readyz")).status_code == 200
        disk.free()
        with trio.fail_after(10):
            await stack.edge.ledger.wait_flushed()
    assert set(served) <= _ledger_run_ids(stack)
    assert stack.edge.ledger.dropped == 0
    assert await _metric(stack, 'iop_usage_ledger_state_changes_total{state="writable"}') == 1


async def test_a_full_buffer_refuses_new_runs_and_readyz_says_why(
    nursery: trio.Nursery, tmp_path: Path, disk: SmallDisk
) -> None:
    stack = await _stack(nursery, tmp_path, disk, ledger_buffer_records=3)
    served: list[str] = []
    disk.fill()
    async with stack.client() as client:
        with pytest.raises(openai.InternalServerError) as refused:
            for _ in range(100):  # the journal's last block takes a few, then 3 wait
                served.append(await _chat(client, stream=len(served) % 2 == 0))
        assert refused.value.status_code == 503
        assert refused.value.code == "metering_unavailable"
        assert refused.value.response.headers["retry-after"] == "5"
        assert "No space left on device" in refused.value.message
        assert stack.edge.ledger.statistics().unwritten == 3
        for url in (stack.addresses.openai_url, stack.addresses.admin_url):
            async with stack.http() as http:
                ready = await http.get(f"{url}/readyz")
            assert ready.status_code == 503
            reason = ready.json()["reason"]
            assert "No space left on device" in reason
            assert "edge.ledger_when_unwritable: refuse" in reason
        assert await _metric(stack, 'iop_usage_ledger_state{state="full"}') == 1
        disk.free()
        with trio.fail_after(10):
            await stack.edge.ledger.wait_flushed()
        async with stack.http() as http:
            assert (await http.get("/readyz")).status_code == 200
        served.append(await _chat(client, stream=False))
        with trio.fail_after(GUARD_S):
            await stack.edge.ledger.wait_flushed()
    assert set(served) <= _ledger_run_ids(stack)


async def test_serve_unwritable_keeps_serving(
    nursery: trio.Nursery, tmp_path: Path, disk: SmallDisk
) -> None:
    stack = await _stack(
        nursery, tmp_path, disk, ledger_buffer_records=2, ledger_when_unwritable="serve"
    )
    disk.fill()
    async with stack.client() as client:
        for _ in range(20):
            await _chat(client, stream=False)
    assert stack.edge.ledger.state == "full" and stack.edge.ledger.dropped > 0
    async with stack.http() as http:
        assert (await http.get("/readyz")).status_code == 200


async def test_a_refresh_that_cannot_be_audited_is_refused(
    nursery: trio.Nursery, tmp_path: Path, disk: SmallDisk
) -> None:
    stack = await _stack(nursery, tmp_path, disk)
    candidate = yaml.safe_load(stack.config_path.read_text())
    candidate["nodes"][0]["providers"][0]["capacity"] = 9
    body = {"mode": "apply", "config_yaml": yaml.safe_dump(candidate)}
    disk.fill()
    async with stack.admin() as admin:
        refused = await admin.post("/refresh", json=body)
        assert refused.status_code == 503
        [error] = refused.json()["errors"]
        assert "refresh-audit.jsonl cannot be written (No space left on device)" in error["message"]
        assert "nothing was applied" in error["message"]
        assert stack.edge.snapshot.revision == 1
        assert (await admin.get("/catalog")).json()["providers"][0]["capacity"] == 4
        disk.free()
        applied = await admin.post("/refresh", json=body)
        assert applied.status_code == 200 and applied.json()["revision"] == 2


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "iop_edge", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )


def test_serve_and_check_config_name_a_full_disk(tmp_path: Path, disk: SmallDisk) -> None:
    config = tmp_path / "edge.yaml"
    config.write_text(one_sim_config(disk.path / "state"), encoding="utf-8")
    disk.fill()
    checked = _cli("check-config", str(config))
    served = _cli("serve", "--config", str(config))
    for done in (checked, served):
        assert done.returncode == 1, done.stderr
        assert "the disk is full (No space left on device" in done.stderr
        assert "Traceback" not in done.stderr
    assert "edge.state_dir: " in checked.stderr
    assert "iop-edge: error: " in served.stderr and "cannot start: edge.state_dir" in served.stderr
    assert _cli("check-config", "--offline", str(config)).returncode == 0
