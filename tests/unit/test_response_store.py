"""The Responses store (iop_edge.runtime.metering.response_store) over SQLite: principal
scoping, conversations, bounds by count, age and bytes (total, per principal, metering's
room, a conversation's), ids never overwritten, a database that fails."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import yaml

from iop_edge.core.configuration.config import parse_config
from iop_edge.runtime.metering.response_store import (
    ROOM_CHECK_S,
    ChainBroken,
    ConversationTooLarge,
    ResponseStore,
    SqliteResponses,
    StoreUnavailable,
    Tally,
)
from schemas.config import ResponsesSection
from tests.timing import GUARD_S
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
        assert (
            await store.keep("alice", _final("r1", "hello"), _asked("hi"), previous_id=None) is None
        )
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
        # bob storing under alice's id does not overwrite hers, and he is told
        assert (
            await store.keep("bob", _final("r1", "hijack"), _asked("x"), previous_id=None)
            == "id_conflict"
        )
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
        unstored = await store.keep(
            "p", _final("r1", "a"), _asked("q"), previous_id=None, request_id="req_1"
        )
        assert unstored == "unavailable"
        assert "request req_1: response r1 not stored (unavailable)" in caplog.text
        assert store.statistics().unstored["unavailable"] == 1
        with pytest.raises(StoreUnavailable, match="no such table"):
            await store.read("p", "r1")
        nursery.cancel_scope.cancel()


async def test_a_response_without_an_id_is_not_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with trio.open_nursery() as nursery:
        store = await _open(nursery, tmp_path / "usage.sqlite3", Clock())
        assert await store.keep("p", b'{"output": []}', _asked("q"), previous_id=None) == (
            "no_response"
        )
        assert await store.keep("p", None, _asked("q"), previous_id=None) == "no_response"
        assert "not stored (no_response)" in caplog.text
        assert store.statistics().unstored["no_response"] == 2
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


def _size(response_id: str, text: str, asked: str) -> int:
    return len(_final(response_id, text)) + len(msgspec.json.encode(_asked(asked)))


async def test_one_principal_at_its_share_is_refused_and_the_others_are_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    one = _size("a0", "x" * 100, "q")
    async with trio.open_nursery() as nursery:
        store = await _open(
            nursery, tmp_path / "usage.sqlite3", Clock(), max_bytes_per_principal=3 * one
        )
        for number in range(3):
            assert (
                await store.keep(
                    "a", _final(f"a{number}", "x" * 100), _asked("q"), previous_id=None
                )
                is None
            )
        refused = await store.keep(
            "a", _final("a3", "x" * 100), _asked("q"), previous_id=None, request_id="req_9"
        )
        assert refused == "principal_full"
        assert "request req_9: response a3 not stored (principal_full)" in caplog.text
        assert "edge.responses.max_bytes_per_principal" in caplog.text
        assert await store.read("a", "a3") is None
        assert await store.read("a", "a0") is not None  # refused, not evicted
        # another principal stores as before
        assert await store.keep("b", _final("b0", "x" * 100), _asked("q"), previous_id=None) is None
        # deleting one makes room again (the refusal counts in the database first)
        assert await store.delete("a", "a0") is True
        assert await store.keep("a", _final("a3", "x" * 100), _asked("q"), previous_id=None) is None
        assert store.statistics().unstored["principal_full"] == 1
        nursery.cancel_scope.cancel()


async def test_a_response_larger_than_a_principals_share_is_never_stored(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        store = await _open(
            nursery, tmp_path / "usage.sqlite3", Clock(), max_bytes_per_principal=1_000
        )
        big = _final("big", "x" * 2_000)
        assert await store.keep("a", big, _asked("q"), previous_id=None) == "too_large"
        assert await store.read("a", "big") is None
        nursery.cancel_scope.cancel()


async def test_past_the_total_bytes_the_least_recently_used_go_first(tmp_path: Path) -> None:
    clock = Clock()
    one = _size("r0", "x" * 1_000, "q")
    path = tmp_path / "usage.sqlite3"
    async with trio.open_nursery() as nursery:
        store = await _open(nursery, path, clock, max_bytes=4 * one)
        for number in range(5):
            clock.now += 1
            owner = "a" if number % 2 else "b"
            stored = await store.keep(
                owner, _final(f"r{number}", "x" * 1_000), _asked("q"), previous_id=None
            )
            assert stored is None
        assert await store.read("b", "r0") is None  # the least recently used went
        assert await store.read("b", "r4") is not None
        assert store.statistics().bytes <= 4 * one
        with sqlite3.connect(path) as db:
            [(held,)] = db.execute("SELECT SUM(length(input) + length(response)) FROM responses")
        assert held == store.statistics().bytes
        nursery.cancel_scope.cancel()


async def test_a_conversation_longer_than_its_bound_is_refused_before_it_is_loaded(
    tmp_path: Path,
) -> None:
    one = _size("t00", "x" * 1_000, "q")
    async with trio.open_nursery() as nursery:
        store = await _open(
            nursery, tmp_path / "usage.sqlite3", Clock(), max_conversation_bytes=5 * one
        )
        previous = None
        for turn in range(8):
            response_id = f"t{turn:02d}"
            await store.keep(
                "a", _final(response_id, "x" * 1_000), _asked("q"), previous_id=previous
            )
            previous = response_id
        assert len(await store.conversation("a", "t04")) == 5
        with pytest.raises(ConversationTooLarge, match="max_conversation_bytes"):
            await store.conversation("a", "t07")
        backend = SqliteResponses(tmp_path / "usage.sqlite3")
        rows = backend.chain("a", "t07", 0.0, 5 * one)
        backend.close()
        assert len(rows) == 6  # what passes the bound is not read further
        nursery.cancel_scope.cancel()


class _SmallDisk(SqliteResponses):
    """The real database, on a disk whose free space the test sets (`free`); the free
    pages inside the file count as room as they are."""

    free = 10_000_000
    pruned: trio.Event | None = None
    """Set (from the worker thread) once a prune has run."""

    def _disk_free(self) -> int | None:
        return self.free

    def free_pages_bytes(self) -> int:
        room = self.room_bytes()
        assert room is not None
        return room - self.free

    def prune(self, before: float, keep: int, keep_bytes: int) -> Tally:
        tally = super().prune(before, keep, keep_bytes)
        if self.pruned is not None:
            trio.from_thread.run_sync(self.pruned.set)
        return tally


async def test_nothing_is_stored_when_the_disk_would_be_left_without_room_for_metering(
    tmp_path: Path,
) -> None:
    backend = _SmallDisk(tmp_path / "usage.sqlite3")
    store = ResponseStore(backend, ResponsesSection(min_free_bytes=10_000_000), clock=Clock())
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        assert await store.keep("a", _final("r0", "x"), _asked("q"), previous_id=None) == "disk_low"
        backend.free = 20_000_000
        assert await store.keep("a", _final("r0", "x"), _asked("q"), previous_id=None) is None
        nursery.cancel_scope.cancel()


async def _fill(store: ResponseStore, clock: Clock, count: int, size: int) -> None:
    """`count` responses of about `size` bytes, a second apart: r00 the least recently
    used."""
    for index in range(count):
        clock.now += 1
        await store.keep("a", _final(f"r{index:02d}", "x" * size), _asked("q"), previous_id=None)


def _on_a_small_disk(
    tmp_path: Path, room_check_s: float = ROOM_CHECK_S
) -> tuple[_SmallDisk, ResponseStore, Clock]:
    """A store keeping 1 MB of room for metering, on a disk with 50 MB free for now."""
    backend = _SmallDisk(tmp_path / "usage.sqlite3")
    backend.free = 50_000_000
    clock = Clock()
    policy = ResponsesSection(min_free_bytes=1_000_000)
    return backend, ResponseStore(backend, policy, clock=clock, room_check_s=room_check_s), clock


async def test_the_store_gives_the_room_the_ledger_grew_into_back_to_metering(
    tmp_path: Path,
) -> None:
    backend, store, clock = _on_a_small_disk(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        await _fill(store, clock, 20, 100_000)
        await store.keep_room()  # room enough: nothing goes
        assert store.statistics().rows == 20
        assert store.statistics().dropped_for_metering == 0
        # The usage records have since taken the disk down to 300 KB free.
        backend.free = 300_000
        await store.keep_room()
        statistics = store.statistics()
        dropped = 20 - statistics.rows
        # Room again for the reserve and an eighth more: the free pages the dropped
        # responses left in the file, which the ledger's rows take first.
        assert backend.free_pages_bytes() >= 1_125_000 - 300_000
        assert 9 <= dropped < 20, "as few as the room needs, not the whole store"
        assert statistics.dropped_for_metering == dropped
        # the least recently used went, the others are there to continue
        assert await store.read("a", "r00") is None
        assert await store.read("a", f"r{dropped - 1:02d}") is None
        assert await store.read("a", f"r{dropped:02d}") is not None
        assert [turn.id for turn in await store.conversation("a", "r19")] == ["r19"]
        nursery.cancel_scope.cancel()


async def test_giving_room_back_again_and_again_is_one_warning_then_info_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iop_edge.runtime.metering.response_store")
    backend, store, clock = _on_a_small_disk(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        await _fill(store, clock, 20, 100_000)
        for free in (600_000, 0):  # the records take more, and more
            backend.free = free
            await store.keep_room()
        drops = [r for r in caplog.records if "kept for metering; dropped" in r.message]
        assert [r.levelname for r in drops] == ["WARNING", "INFO"]
        nursery.cancel_scope.cancel()


async def test_a_store_emptied_for_metering_leaves_the_ledger_whatever_room_there_is(
    tmp_path: Path,
) -> None:
    backend, store, clock = _on_a_small_disk(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        await _fill(store, clock, 3, 100_000)
        backend.free = 0  # full, and the store's 300 KB cannot make up the reserve
        await store.keep_room()
        assert store.statistics().rows == 0
        assert store.statistics().dropped_for_metering == 3
        assert backend.free_pages_bytes() >= 300_000
        await store.keep_room()  # nothing left to drop: a no-op
        assert store.statistics().dropped_for_metering == 3
        nursery.cancel_scope.cancel()


async def test_the_store_checks_metering_s_room_on_its_own(tmp_path: Path) -> None:
    backend, store, clock = _on_a_small_disk(tmp_path, room_check_s=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        await _fill(store, clock, 5, 100_000)
        backend.pruned = trio.Event()
        backend.free = 900_000
        with trio.fail_after(GUARD_S):
            await backend.pruned.wait()
        # The store's calls take turns (one worker thread at a time): this read comes
        # after the check that pruned.
        assert await store.read("a", "r00") is None
        assert store.statistics().dropped_for_metering > 0
        nursery.cancel_scope.cancel()


async def test_a_failing_database_at_a_check_of_the_room_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = _SmallDisk(tmp_path / "usage.sqlite3")
    store = ResponseStore(backend, ResponsesSection(), clock=Clock())
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        backend.close()
        (tmp_path / "usage.sqlite3").unlink()
        (tmp_path / "usage.sqlite3").mkdir()  # a file it can no longer open
        for _ in range(3):
            await store.keep_room()
        said = [r.message for r in caplog.records if "cannot check metering's room" in r.message]
        assert len(said) == 1
        nursery.cancel_scope.cancel()


async def test_a_reused_id_never_overwrites_a_stored_response(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        store = await _open(nursery, tmp_path / "usage.sqlite3", Clock())
        assert await store.keep("a", _final("dup", "first"), _asked("q"), previous_id=None) is None
        again = await store.keep("a", _final("dup", "second"), _asked("q"), previous_id="dup")
        assert again == "id_conflict"
        assert [turn.id for turn in await store.conversation("a", "dup")] == ["dup"]
        assert b"first" in (await store.read("a", "dup") or b"")
        nursery.cancel_scope.cancel()
