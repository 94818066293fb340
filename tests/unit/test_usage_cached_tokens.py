"""The ledger keeps each run's cached prompt tokens: summed in every grouping, taken as 0
for the rows of a ledger an older Edge wrote, and for journal lines written before the
field existed."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec
import trio

from iop_edge.runtime.metering.usage_ledger.ledger_schema import PRINCIPAL_INDEX_NAME
from iop_edge.runtime.metering.usage_ledger.usage import UsageLedger
from iop_edge.runtime.metering.usage_ledger.usage_store import UsageRecord
from tests.unit.usage_records import usage_record

#: The table, and the index, as an Edge from before `cached_tokens` left them.
_OLDER = """
CREATE TABLE usage (
    time REAL NOT NULL, run_id TEXT NOT NULL, principal_ref TEXT NOT NULL,
    token_ref TEXT NOT NULL, alias TEXT, model TEXT NOT NULL, provider TEXT NOT NULL,
    node TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    status INTEGER NOT NULL, latency_ms REAL NOT NULL, ttft_ms REAL,
    usage_source TEXT NOT NULL DEFAULT 'provider', protocol TEXT NOT NULL DEFAULT 'chat'
);
CREATE INDEX usage_by_principal ON usage
    (principal_ref, token_ref, model, time, prompt_tokens, completion_tokens, usage_source);
INSERT INTO usage VALUES (0.5, 'old', 'p', 't', NULL, 'm', 'pr', 'n', 10, 2, 200, 1.0, NULL,
    'provider', 'chat');
"""


def _cached(run_id: str, cached: int, provider: str = "pr") -> UsageRecord:
    return msgspec.structs.replace(usage_record(run_id), cached_tokens=cached, provider=provider)


async def test_an_older_ledger_gains_cached_tokens_and_its_index_is_replaced(
    tmp_path: Path,
) -> None:
    path = tmp_path / "usage.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(_OLDER)
    ledger = UsageLedger(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        ledger.record(_cached("warm", 3))
        ledger.record(_cached("cold", 0, provider="other"))
        with trio.fail_after(5):
            await ledger.wait_flushed()
        by_provider = await ledger.aggregate(since=None, until=None, group_by=["provider"])
        default = await ledger.aggregate(
            since=None, until=None, group_by=["principal_ref", "token_ref", "model"]
        )
        nursery.cancel_scope.cancel()
    assert [(row.provider, row.prompt_tokens, row.cached_tokens) for row in by_provider.rows] == [
        ("other", 3, 0),
        ("pr", 13, 3),
    ]
    assert default.totals is not None
    assert (default.totals.requests, default.totals.cached_tokens) == (3, 3)
    with sqlite3.connect(path) as db:
        cached = dict(db.execute("SELECT run_id, cached_tokens FROM usage"))
        indexes = {
            row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='index'")
        }
    assert cached == {"old": 0, "warm": 3, "cold": 0}
    assert PRINCIPAL_INDEX_NAME in indexes and "usage_by_principal" not in indexes


def test_a_journal_line_from_before_the_field_reads_as_no_cached_tokens() -> None:
    line = msgspec.json.encode(usage_record("r"))
    older = msgspec.json.decode(line, type=dict[str, object])
    del older["cached_tokens"]
    record = msgspec.json.decode(msgspec.json.encode(older), type=UsageRecord)
    assert record.cached_tokens == 0 and record.prompt_tokens == 3


def test_a_report_says_cached_tokens_even_when_there_are_none() -> None:
    """`GET /usage` rows always carry the count: 0 is an answer, not a missing field."""
    from iop_edge.runtime.metering.usage_ledger.usage_store import UsageRow

    row = UsageRow(
        requests=1,
        prompt_tokens=3,
        completion_tokens=4,
        cached_tokens=0,
        estimated_requests=0,
        estimated_tokens=0,
    )
    assert b'"cached_tokens":0' in msgspec.json.encode(row)


def test_a_node_cannot_report_more_cached_tokens_than_the_prompt() -> None:
    from iop_edge.core.node_input import check_node_message
    from schemas import wire

    lying = wire.Usage(prompt_tokens=10, completion_tokens=2, total_tokens=12, cached_tokens=99)
    negative = wire.Usage(prompt_tokens=10, completion_tokens=2, total_tokens=12, cached_tokens=-3)
    sound = wire.Usage(prompt_tokens=10, completion_tokens=2, total_tokens=12, cached_tokens=4)
    message = wire.RunEvents(
        ends=[
            wire.RunDone(run_id="a", usage=lying),
            wire.RunDone(run_id="b", usage=negative),
            wire.RunDone(run_id="c", usage=sound),
        ]
    )
    checked, notes = check_node_message(message)
    assert isinstance(checked, wire.RunEvents)
    assert [end.usage.cached_tokens for end in checked.ends if end.usage] == [10, 0, 4]
    assert len(notes) == 2 and "cached" in notes[0]


def test_the_wire_leaves_zero_counts_off_and_an_older_peer_reads_them() -> None:
    """An older Edge's `Usage` (no `cached_tokens`) reads a newer Node's, and back."""
    from schemas import wire

    class OlderUsage(msgspec.Struct, frozen=True, kw_only=True):
        prompt_tokens: int = 0
        completion_tokens: int = 0
        total_tokens: int = 0

    newer = wire.Usage(prompt_tokens=10, completion_tokens=2, total_tokens=12, cached_tokens=4)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(newer), type=OlderUsage) == OlderUsage(
        prompt_tokens=10, completion_tokens=2, total_tokens=12
    )
    older = OlderUsage(prompt_tokens=10, completion_tokens=2, total_tokens=12)
    read = msgspec.msgpack.decode(msgspec.msgpack.encode(older), type=wire.Usage)
    assert read.cached_tokens == 0 and read.prompt_tokens == 10
    assert b"cached_tokens" not in msgspec.msgpack.encode(
        wire.Usage(prompt_tokens=1, total_tokens=1)
    )
