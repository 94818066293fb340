"""Work in a worker thread steps aside while the event loop beside it is busy
(`schemas.runtime.give_way`, `runtime.refresh.off_loop`)."""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass, field

import msgspec
import pytest
import trio

from iop_edge.runtime.refresh import off_loop
from schemas.runtime import give_way as give_way_module
from schemas.runtime.give_way import MAX_WAIT_S, RELEASE_ITEMS, Gate, free_graph_in_pieces, give_way


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Idle:
    """A gate's event, recording the waits (`threading.Event`'s interface)."""

    def __init__(self) -> None:
        self.state = True
        self.waits: list[float] = []

    def is_set(self) -> bool:
        return self.state

    def set(self) -> None:
        self.state = True

    def clear(self) -> None:
        self.state = False

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return self.state


def _gate() -> tuple[Gate, _Idle, _Clock]:
    clock = _Clock()
    gate = Gate(clock)
    idle = _Idle()
    gate._idle = idle  # type: ignore[assignment]
    return gate, idle, clock


def test_outside_a_gated_thread_give_way_returns_at_once() -> None:
    gate, idle, _ = _gate()
    gate.loop_busy()
    give_way()  # this thread never entered the gate
    assert idle.waits == []


def test_an_idle_loop_lets_the_work_run() -> None:
    gate, idle, _ = _gate()
    with gate.entered():
        gate.loop_busy()
        gate.loop_idle()
        give_way()
    assert idle.waits == []
    assert gate.open


def test_a_busy_loop_makes_the_work_wait_then_run_as_long_again() -> None:
    gate, idle, clock = _gate()
    with gate.entered():
        gate.loop_busy()
        give_way()  # waits in vain (the fake event never opens)
        assert idle.waits == [MAX_WAIT_S]
        clock.now += MAX_WAIT_S / 2
        give_way()  # within its share: runs on
        assert idle.waits == [MAX_WAIT_S]
        clock.now += MAX_WAIT_S
        give_way()  # its share is used: steps aside again
        assert idle.waits == [MAX_WAIT_S, MAX_WAIT_S]


def test_the_gate_is_the_entering_threads_alone() -> None:
    gate, _, _ = _gate()
    with gate.entered():
        assert give_way_module._thread.gate is gate
        seen: list[Gate | None] = []
        other = threading.Thread(target=lambda: seen.append(give_way_module._thread.gate))
        other.start()
        other.join()
        assert seen == [None]
    assert give_way_module._thread.gate is None


async def test_run_sync_closes_the_gate_while_the_loop_is_busy_and_opens_it_when_idle() -> None:
    closed_seen = threading.Event()
    loop_still = threading.Event()

    def work() -> bool:
        gate = give_way_module._thread.gate
        assert gate is not None
        while gate.open:  # the loop below spins: its instrument closes the gate
            give_way()
        closed_seen.set()
        loop_still.wait()
        while not gate.open:  # the loop now waits for this thread: the gate opens
            give_way()
        return True

    interval = sys.getswitchinterval()
    async with trio.open_nursery() as nursery:

        async def spin() -> None:
            while not closed_seen.is_set():
                await trio.lowlevel.checkpoint()  # always runnable: the loop never idles
            loop_still.set()

        nursery.start_soon(spin)
        assert await off_loop.run_sync(work)
    assert sys.getswitchinterval() == interval  # restored with the last run


@dataclass(slots=True, weakref_slot=True)
class _Part:
    parts: list[_Part] = field(default_factory=list)


class _Record(msgspec.Struct, weakref=True):
    by_id: dict[str, _Part]
    order: tuple[_Part, ...]


class _Deaths:
    """When each watched object was freed, counted in `give_way()` calls made before."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.turns = 0
        self.per_turn: dict[int, int] = {}
        self.freed = 0

        def counted() -> None:
            self.turns += 1

        monkeypatch.setattr(give_way_module, "give_way", counted)

    def watch(self, value: object) -> None:
        weakref.finalize(value, self._died)

    def _died(self) -> None:
        self.freed += 1
        self.per_turn[self.turns] = self.per_turn.get(self.turns, 0) + 1


def _fleet(deaths: _Deaths, nodes: int) -> _Record:
    """A config-like graph: nodes with parts, a mapping and a tuple over the same nodes."""
    by_id: dict[str, _Part] = {}
    for index in range(nodes):
        node = _Part([_Part() for _ in range(3)])
        for part in [node, *node.parts]:
            deaths.watch(part)
        by_id[f"node-{index}"] = node
    record = _Record(by_id=by_id, order=tuple(by_id.values()))
    deaths.watch(record)
    return record


def test_a_large_graph_is_freed_a_piece_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    deaths = _Deaths(monkeypatch)
    roots: list[object] = [_fleet(deaths, 2000)]

    free_graph_in_pieces(roots)

    assert roots == []
    assert deaths.freed == 1 + 2000 * 4  # every object, each node held by two parents
    assert max(deaths.per_turn.values()) <= RELEASE_ITEMS  # no cascade between turns
    assert len(deaths.per_turn) >= deaths.freed // RELEASE_ITEMS


def test_parts_held_elsewhere_outlive_the_graph_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    deaths = _Deaths(monkeypatch)
    record = _fleet(deaths, 100)
    kept = record.by_id["node-7"]
    roots: list[object] = [record]
    del record

    free_graph_in_pieces(roots)

    assert deaths.freed == 1 + 99 * 4  # all but the kept node and its parts
    assert len(kept.parts) == 3


def test_a_graph_still_in_use_is_not_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    deaths = _Deaths(monkeypatch)
    record = _fleet(deaths, 100)
    roots: list[object] = [record]

    free_graph_in_pieces(roots)

    assert roots == [] and deaths.freed == 0 and deaths.turns == 0
    assert len(record.by_id) == 100 and len(record.order) == 100


def test_a_cycle_ends_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    _Deaths(monkeypatch)  # no gate: give_way() only counts
    loop: list[object] = [_Part()]
    loop.append(loop)
    roots: list[object] = [loop]
    del loop

    free_graph_in_pieces(roots)  # returns: a part already held is not held again

    assert roots == []
