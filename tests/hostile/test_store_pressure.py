"""One principal tries to fill the Responses store, and with it the small disk under
`state_dir` that the usage journal and ledger share: it is answered, unstored, once the
store would leave less than `edge.responses.min_free_bytes`, and told so (`store: false`,
`x-iop-response-stored: false`, `iop_responses_unstored_total{reason="disk_low"}`); the
other principals are served and every run of everyone is metered (the ledger never stops
being writable). And when the usage records grow into that reserve, the store gives it
back: its least recently used responses go, and their pages are the ledger's."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import trio

from iop_edge.runtime.metering.ledger import SQLITE_FILE
from tests.e2e.stack import Stack, edge_config, principals_section, sim_provider, start_stack
from tests.small_disk import SmallDisk, small_disk

FILLER = "filler-token-for-tests"
OTHER = "other-token-for-tests"
#: About 200 KB of input a request: each stored response takes that much of the disk.
BIG_INPUT = "lorem ipsum " * 17_000


#: The room `state_dir` keeps for metering.
RESERVE = 6 * 1024 * 1024
#: Responses of `BIG_INPUT` that fit on the disk above the reserve, together more than
#: the reserve.
STORED = 30


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path, "16m") as mounted:
        yield mounted


async def _start(nursery: trio.Nursery, tmp_path: Path, state_dir: Path) -> Stack:
    text = edge_config(
        state_dir,
        providers=[sim_provider("sim-1", capacity=4)],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
        openai_section=principals_section({"filler": FILLER, "other": OTHER}),
        edge_section={
            "responses": {"min_free_bytes": RESERVE},
            "ledger_buffer_records": 5,  # a ledger that stopped writing would show at once
        },
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


def _room(disk: SmallDisk, database: Path) -> int:
    """What the ledger can still write: the disk's free space and the database's free
    pages."""
    with sqlite3.connect(database) as db:
        free_pages = db.execute("PRAGMA freelist_count").fetchone()[0]
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
    return disk.free_bytes() + free_pages * page_size


async def test_one_principal_filling_the_store_leaves_metering_and_the_others_alone(
    nursery: trio.Nursery, tmp_path: Path, disk: SmallDisk
) -> None:
    state_dir = disk.path / "state"
    stack = await _start(nursery, tmp_path, state_dir)
    stored: list[str] = []
    unstored = 0
    said_unstored = 0  # everyone's answers saying `x-iop-response-stored: false`
    others: list[str] = []
    async with stack.client(api_key=FILLER) as filler, stack.client(api_key=OTHER) as other:
        for _ in range(80):  # more than the disk holds
            raw = await filler.responses.with_raw_response.create(
                model="m", input=BIG_INPUT, max_output_tokens=4
            )
            if raw.headers["x-iop-response-stored"] == "true":
                stored.append(raw.parse().id)
            else:
                unstored += 1
                said_unstored += 1
                assert raw.parse().store is False
            raw = await other.responses.with_raw_response.create(
                model="m", input="hi", max_output_tokens=4
            )
            others.append(raw.parse().id)
            said_unstored += raw.headers["x-iop-response-stored"] == "false"
        assert stored and unstored  # it stored until the disk's reserve, then no more
        # The reserve held: what the ledger can write, the disk's free space and the
        # database's free pages (the WAL's growth takes some of it).
        assert _room(disk, state_dir / SQLITE_FILE) >= RESERVE - 1024 * 1024
        assert stack.edge.ledger.state == "writable"
        async with stack.admin() as admin:
            metrics = (await admin.get("/metrics")).text
        assert (
            f'iop_responses_unstored_total{{reason="disk_low"}} {float(said_unstored)}' in metrics
        )
        # what was said stored is there to continue
        await filler.responses.create(
            model="m", input="more", max_output_tokens=4, previous_response_id=stored[-1]
        )
        with trio.fail_after(10):
            await stack.edge.ledger.wait_flushed()
    with sqlite3.connect(state_dir / SQLITE_FILE) as db:
        rows = dict(
            db.execute(
                "SELECT principal_ref, COUNT(*) FROM usage WHERE status = 200 "
                "GROUP BY principal_ref"
            ).fetchall()
        )
    assert rows == {"filler": 81, "other": 80}


async def test_usage_records_growing_into_the_reserve_take_it_back_from_the_store(
    nursery: trio.Nursery, tmp_path: Path, disk: SmallDisk
) -> None:
    state_dir = disk.path / "state"
    stack = await _start(nursery, tmp_path, state_dir)
    stored: list[str] = []
    async with stack.client(api_key=FILLER) as filler:
        for _ in range(STORED):
            raw = await filler.responses.with_raw_response.create(
                model="m", input=BIG_INPUT, max_output_tokens=4
            )
            assert raw.headers["x-iop-response-stored"] == "true"
            stored.append(raw.parse().id)
        # What a long run's usage records would take: the disk but 2 MiB, most of the
        # reserve.
        (disk.path / "records").write_bytes(bytes(disk.free_bytes() - 2 * 1024 * 1024))
        database = state_dir / SQLITE_FILE
        assert _room(disk, database) < RESERVE
        await stack.edge.responses.keep_room()  # as it does every few seconds
        assert _room(disk, database) >= RESERVE
        async with stack.admin() as admin:
            metrics = (await admin.get("/metrics")).text
        dropped = int(
            float(metrics.split("\niop_responses_dropped_for_metering_total ")[1].split()[0])
        )
        assert 0 < dropped < len(stored)
        # the least recently used went; the newest are there to continue
        with pytest.raises(openai.NotFoundError):
            await filler.responses.retrieve(stored[0])
        await filler.responses.create(
            model="m", input="more", max_output_tokens=4, previous_response_id=stored[-1]
        )
    assert stack.edge.ledger.state == "writable"
