"""`core.gc_pause`: a hold freezes the live heap, never the garbage waiting for the
collector.

A frozen object is out of the cyclic collector's sight until the heap keeper thaws the
heap; garbage frozen with the live heap stays in memory as long. The Edge's thresholds
let cyclic garbage wait for tens of thousands of allocations, so a hold that froze it
(every refresh opens one) kept megabytes of finished requests each time.

The collector is real here (`manual_collector`, `garbage`: tests/unit/conftest.py).
"""

from __future__ import annotations

import gc
import threading
import weakref

from iop_edge.core.gc_pause import freezes, gc_held, gc_paused, held, paused, watch_holds


def watched(obj: object) -> bool:
    """Whether the collector walks `obj` (frozen objects are not in its generations)."""
    return any(candidate is obj for candidate in gc.get_objects())


def test_a_hold_does_not_freeze_the_garbage_waiting_for_the_collector(
    garbage: weakref.ref[object],
) -> None:
    assert garbage() is not None  # waiting for a collection
    with gc_held():
        pass
    gc.collect()
    assert garbage() is None


def test_a_hold_freezes_what_is_alive(manual_collector: None) -> None:
    alive: list[object] = []
    alive.append(alive)  # a cycle, as the Edge's long-lived objects are
    before = freezes()
    with gc_held():
        pass
    assert freezes() > before
    assert not watched(alive)  # frozen: still alive, out of the collector's sight
    assert alive[0] is alive


def test_a_pause_is_seen_while_it_is_open_whatever_the_thread() -> None:
    seen: list[bool] = []
    assert not paused()
    with gc_paused():
        assert paused()
        worker = threading.Thread(target=lambda: seen.append(paused()))
        worker.start()
        worker.join()
    assert seen == [True]
    assert not paused()


def test_the_watchers_hear_when_the_first_hold_opens_and_the_last_closes(
    manual_collector: None,
) -> None:
    heard: list[tuple[str, int, bool]] = []
    with watch_holds(
        lambda: heard.append(("closed", freezes(), held())),
        opened=lambda: heard.append(("opened", freezes(), held())),
    ):
        assert not held()
        with gc_held():
            assert heard == [("opened", freezes(), True)]  # after the freeze that opened it
            with gc_held():
                pass
            assert len(heard) == 1  # an inner hold: neither opened nor closed the heap
        assert heard[1:] == [("closed", freezes(), False)]  # after the closing freeze
    with gc_held():
        pass
    assert len(heard) == 2  # no longer watching
