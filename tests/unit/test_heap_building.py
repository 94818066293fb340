"""A config is read, and the Edge built from it, with the collector paused
(`runtime.lifecycle.heap` Rule 6): what startup makes lives as long as the process, and
the one collection of it is `settle()`'s. The tests drive the real collector and restore
it after (`collector_restored`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from bench.many_nodes import ManyNodesShape, fleet_config, node_credentials
from iop_edge.core.configuration.config import parse_config
from iop_edge.main import serve_edge
from iop_edge.runtime.lifecycle.heap import THRESHOLDS, building
from iop_edge.runtime.refresh.config_file import check_config, load_config

#: Below the size from which an Edge starts its refresh worker as it starts: a fleet
#: large enough for the collector to run many times while it is read.
NODES = 600
#: CPython's defaults, so how often the collector runs does not depend on earlier tests.
DEFAULT_THRESHOLDS = (700, 10, 10)


@pytest.fixture
def collector_restored() -> Iterator[None]:
    """The real collector on, at its default thresholds, nothing frozen; as it was after."""
    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    gc.enable()
    gc.set_threshold(*DEFAULT_THRESHOLDS)
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        if not enabled:
            gc.disable()


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """The generation of every collection that starts while the test runs."""
    started: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        yield started
    finally:
        gc.callbacks.remove(seen)


def _fleet(state_dir: Path) -> str:
    shape = ManyNodesShape(nodes=NODES, models=1)
    return fleet_config(shape, node_credentials(NODES), state_dir, capacity=4)


def test_a_fleets_config_is_read_without_a_collection(
    tmp_path: Path, collector_restored: None, collections: list[int]
) -> None:
    text = _fleet(tmp_path / "state")
    path = tmp_path / "edge.yaml"
    path.write_text(text, encoding="utf-8")

    parse_config(text)  # the reading alone, as nothing of the Edge's process does it
    assert len(collections) > 10, "the config is too small to show what the pause saves"
    for read in (lambda: check_config(text), lambda: load_config(path)):
        gc.collect()  # every generation's count from zero
        collections.clear()
        parsed = read()
        # None while it read; the first allocation after it brings one young collection
        # of all it made (the list this comparison makes).
        assert collections == [0]
        assert gc.isenabled()
        assert len(parsed.config.nodes) == NODES


async def test_an_edge_is_built_with_one_collection_the_settling_one(
    tmp_path: Path, collector_restored: None, collections: list[int]
) -> None:
    path = tmp_path / "edge.yaml"
    path.write_text(_fleet(tmp_path / "state"), encoding="utf-8")
    gc.collect()  # every generation's count from zero: what follows decides alone
    collections.clear()

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_edge, path)
        assert collections == [2]  # `settle()`'s, of everything startup built
        assert gc.isenabled()
        assert gc.get_threshold() == THRESHOLDS
        assert gc.get_freeze_count() > 0
        nursery.cancel_scope.cancel()


def test_building_puts_the_collector_back_as_it_was(collector_restored: None) -> None:
    with pytest.raises(RuntimeError), building():
        assert not gc.isenabled()
        raise RuntimeError("a config that could not be read")
    assert gc.isenabled()

    with building():
        with building():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer body is not over yet
    assert gc.isenabled()

    gc.disable()  # a process that keeps it off (the refresh worker)
    with building():
        assert not gc.isenabled()
    assert not gc.isenabled()
