"""The Responses store (iop_edge.runtime.metering.response_store) over SQLite: principal
scoping, conversations, bounds by count and by age, a database that fails."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import yaml

from iop_edge.core.config import parse_config
from iop_edge.runtime.metering.response_store import (
    ChainBroken,
    ResponseStore,
    SqliteResponses,
    StoreUnavailable,
)
from schemas.config import ResponsesSection
from tests.unit.test_config import errors_of, valid


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _final(response_id: str, text: str) -> bytes:
    return msgspec.json.encode(
        {
            "id": response_id,
            "object": "response",
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text}],
                }
            ],
        }
    )


def _asked(text: str) -> list[Any]:
    return [{"type": "message", "role": "user", "content": text}]


async def _open(nursery: trio.Nursery, path: Path, clock: Clock, **policy: Any) -> ResponseStore:
    store = ResponseStore(SqliteResponses(path), ResponsesSection(**policy), clock=clock)
    await nursery.start(store.run)
    return store


async def test_a_conversation_is_continued_read_and_deleted_by_its_principal_only(
    tmp_path: Path,
) -> None:
    path = tmp_path / "usage.sqlite3"
    async with trio.open_nursery() as nursery:
        store = await _open(nursery, path, Clock())
        assert await store.keep("alice", _final("r1", "hello"), _asked("hi"), previous_id=None)
        await store.keep("alice", _final("r2", "more"), _asked("and?"), previous_id="r1")
        chain = await store.conversation("alice", "r2")
        assert [turn.id for turn in chain] == ["r1", "r2"]
        assert [msgspec.json.decode(item) for item in chain[0].input_items] == _asked("hi")
        said = msgspec.json.decode(chain[1].output_items[0])
        assert said["content"][0]["text"] == "more"
        # another principal sees nothing, exactly as for an id that does not exist
        with pytest.raises(ChainBroken, match="'r2' not found"):
            await store.conversation("bob", "r2")
        assert await store.read("bob", "r1") is None
        assert await store.delete("bob", "r1") is False
        # bob storing under alice's id does not overwrite hers
        await store.keep("bob", _final("r1", "hijack"), _asked("x"), previous_id=None)
        assert b"hello" in (await store.read("alice", "r1") or b"")
        assert await store.delete("alice", "r1") is True
        assert await store.read("alice", "r1") is None
        with pytest.raises(ChainBroken, match="'r1', which is no longer stored"):
            await store.conversation("alice", "r2")
        nursery.cancel_scope.cancel()


async def test_it_outlives_the_process_that_stored_it(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    clock = Clock()
    async with trio.open_nursery() as nursery:
        store = await _open(nursery, path, clock)
        await store.keep("alice", _final("r1", "hello"), _asked("hi"), previous_id=None)
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        again = await _open(nursery, path, clock)
        assert [turn.id for turn in await again.conversation("alice", "r1")] == ["r1"]
        nursery.cancel_scope.cancel()


async def test_the_least_recently_used_go_first_and_continuing_renews_a_conversation(
    tmp_path: Path,
) -> None:
    clock = Clock()
    async with trio.open_nursery() as nursery:
        store = await _open(nursery, tmp_path / "usage.sqlite3", clock, max_stored=3)
        for number in range(3):
            clock.now += 1
            await store.keep("p", _final(f"r{number}", "a"), _asked("q"), previous_id=None)
        clock.now += 1  # continuing r0 renews it: r1 is now the least recently used
        await store.keep("p", _final("c0", "a"), _asked("q"), previous_id="r0", continues=["r0"])
        assert await store.read("p", "r1") is None
        for kept in ("r0", "r2", "c0"):
            assert await store.read("p", kept) is not None, kept
        with sqlite3.connect(tmp_path / "usage.sqlite3") as db:
            assert db.execute("SELECT COUNT(*) FROM responses").fetchone() == (3,)
        nursery.cancel_scope.cancel()


async def test_an_expired_response_is_unknown_at_once_and_pruned_later(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "usage.sqlite3"
    async with trio.open_nursery() as nursery:
        store = await _open(nursery, path, clock, max_age_s=60)
        await store.keep("p", _final("old", "a"), _asked("q"), previous_id=None)
        clock.now += 61
        assert await store.read("p", "old") is None
        with pytest.raises(ChainBroken):
            await store.conversation("p", "old")
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        await _open(nursery, path, clock, max_age_s=60)  # opening prunes
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT COUNT(*) FROM responses").fetchone() == (0,)
        nursery.cancel_scope.cancel()


async def test_a_failing_database_keeps_nothing_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "usage.sqlite3"
    async with trio.open_nursery() as nursery:
        store = await _open(nursery, path, Clock())
        with sqlite3.connect(path) as db:
            db.execute("ALTER TABLE responses RENAME TO hidden")
        stored = await store.keep("p", _final("r1", "a"), _asked("q"), previous_id=None)
        assert stored is None and "response r1 was not stored" in caplog.text
        with pytest.raises(StoreUnavailable, match="no such table"):
            await store.read("p", "r1")
        nursery.cancel_scope.cancel()


async def test_a_response_without_an_id_is_not_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with trio.open_nursery() as nursery:
        store = await _open(nursery, tmp_path / "usage.sqlite3", Clock())
        assert await store.keep("p", b'{"output": []}', _asked("q"), previous_id=None) is None
        assert "was not stored" in caplog.text
        nursery.cancel_scope.cancel()


def test_the_bounds_are_checked_with_their_config_paths() -> None:
    raw = valid()
    raw["edge"] = {"responses": {"max_age_s": 0, "max_stored": -1, "max_count": 3}}
    errors = {(error.path, error.message) for error in errors_of(raw)}
    assert ("edge.responses.max_age_s", "must be > 0") in errors
    assert ("edge.responses.max_stored", "must be >= 1") in errors
    assert any(path == "edge.responses.max_count" for path, _ in errors)
    raw["edge"] = {"responses": {"max_age_s": 3600, "max_stored": 50}}
    parsed = parse_config(yaml.safe_dump(raw)).config.edge.responses
    assert parsed == ResponsesSection(max_age_s=3600, max_stored=50)
