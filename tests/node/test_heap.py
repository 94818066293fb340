"""The Node's heap (`iop_node.heap`): settled only in a Node's own process.

The collector is process-wide, so what a managed process does is checked in a child
process; this one must stay as it is (the tests run Nodes in process)."""

from __future__ import annotations

import gc
import subprocess
import sys

from iop_node import heap


def test_a_node_inside_another_program_leaves_its_collector_alone() -> None:
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    assert not heap.managed()
    heap.providers_built()
    assert gc.get_threshold() == thresholds
    # Nothing frozen: a freeze adds the whole heap (a frozen object another test left
    # may be freed meanwhile, so the count can only fall).
    assert gc.get_freeze_count() <= frozen


_CHILD = """
import gc, weakref
from iop_node import heap
class Retired:  # a retired provider's adapter: cyclic garbage once let go
    pass
retired = Retired()
retired.me = retired
gone = weakref.ref(retired)
del retired
gc.disable()  # only the settling may collect it
heap.manage()
heap.providers_built()
print(*gc.get_threshold(), gc.get_freeze_count() > 1000, gone() is None)
"""


def test_a_node_process_freezes_its_heap_once_its_providers_are_built() -> None:
    child = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=60
    )
    *thresholds, frozen, collected = child.stdout.split()
    assert tuple(map(int, thresholds)) == heap.THRESHOLDS
    assert frozen == "True"  # the heap built so far is out of the collector's sight
    assert collected == "True"  # after the garbage in it was collected
