"""`GET /catalog` at fleet size: the query (`core.catalog_query`) and the answer written a
slice at a time (`http.admin_api.catalog_stream`), against a real scheduler of a generated pool."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import trio

from iop_edge.core.catalog_query import MAX_LIMIT, CatalogQuery, CatalogQueryError
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.admin_api.catalog_stream import SCAN, SLICE, catalog_chunks
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas.catalog import Catalog
from schemas.config import EdgeConfig, ModelEntry, NodeEntry, ProviderConfig

NODES = 40
PER_NODE = 3
MODELS = 4


def fleet_snapshot(nodes: int = NODES) -> Snapshot:
    """`nodes` Nodes of `PER_NODE` providers; provider j of Node i serves model
    (i * PER_NODE + j) % MODELS."""
    served: dict[int, dict[str, str]] = {m: {} for m in range(MODELS)}
    entries = []
    for i in range(nodes):
        providers = []
        for j in range(PER_NODE):
            pid = f"n{i:03d}-p{j}"
            model = (i * PER_NODE + j) % MODELS
            served[model][pid] = f"served-{model}"
            providers.append(
                ProviderConfig(id=pid, type="sim", models=[f"served-{model}"], capacity=2)
            )
        entries.append(NodeEntry(id=f"n{i:03d}", token_hash_sha256="0" * 64, providers=providers))
    config = EdgeConfig(
        models=[ModelEntry(id=f"model-{m}", providers=served[m]) for m in range(MODELS)],
        nodes=entries,
    )
    return Snapshot.build(config, revision=3, config_sha256="0" * 64)


def scheduler_with_health(snapshot: Snapshot) -> Scheduler:
    """Every even Node connected (its providers available, one of them unknown); the odd
    ones never connected (unavailable)."""
    scheduler = Scheduler(snapshot)
    for node_id, provider_ids in snapshot.node_providers.items():
        if int(node_id[1:]) % 2 == 0:
            scheduler.node_connected(node_id)
            for pid in provider_ids[:-1]:
                scheduler.provider_status(pid, "available", [])
    return scheduler


async def read(scheduler: Scheduler, **arguments: str) -> dict[str, Any]:
    query = CatalogQuery.from_arguments(arguments)
    body = b"".join([chunk async for chunk in catalog_chunks(scheduler, query)])
    answer: dict[str, Any] = json.loads(body)
    return answer


def ids(answer: dict[str, Any]) -> list[str]:
    return [provider["id"] for provider in answer["providers"]]


# --- the query -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"health": "fine"}, "health must be one of available, busy, draining, unavailable"),
        ({"limit": "ten"}, f"limit must be a whole number, 1..{MAX_LIMIT}"),
        ({"limit": "0"}, f"limit must be 1..{MAX_LIMIT}"),
        ({"limit": str(MAX_LIMIT + 1)}, f"limit must be 1..{MAX_LIMIT}"),
        ({"modle": "m"}, "unknown catalog argument(s) modle; use model, node, health, limit"),
    ],
)
def test_a_bad_argument_is_named(arguments: dict[str, str], message: str) -> None:
    with pytest.raises(CatalogQueryError) as error:
        CatalogQuery.from_arguments(arguments)
    assert str(error.value).startswith(message)


def test_an_empty_query_is_the_whole_catalog() -> None:
    query = CatalogQuery.from_arguments({"model": "", "limit": ""})
    assert query == CatalogQuery() and not query.filtered


# --- filters and pages -----------------------------------------------------------------


async def test_the_unfiltered_answer_is_the_catalog_document() -> None:
    scheduler = scheduler_with_health(fleet_snapshot())
    answer = await read(scheduler)
    whole = json.loads(msgspec.json.encode(scheduler.catalog()))
    assert answer == whole
    assert list(answer) == list(Catalog.__struct_fields__)  # the same field order
    assert ids(answer) == sorted(ids(answer)) and len(ids(answer)) == NODES * PER_NODE
    assert answer["next"] is None


async def test_filters_by_node_model_and_health_and_combine() -> None:
    scheduler = scheduler_with_health(fleet_snapshot())
    assert ids(await read(scheduler, node="n007")) == ["n007-p0", "n007-p1", "n007-p2"]
    by_model = await read(scheduler, model="model-1")
    assert [m["id"] for m in by_model["models"]] == ["model-1"]
    assert set(ids(by_model)) == set(scheduler.snapshot.models["model-1"].providers)
    unknown = await read(scheduler, health="unknown")
    assert ids(unknown) == [f"n{i:03d}-p2" for i in range(0, NODES, 2)]
    unavailable = await read(scheduler, health="unavailable", node="n003")
    assert ids(unavailable) == ["n003-p0", "n003-p1", "n003-p2"]
    assert ids(await read(scheduler, health="available", node="n003")) == []
    nobody = await read(scheduler, model="no-such-model")
    assert (nobody["models"], nobody["providers"]) == ([], [])


async def test_pages_follow_their_cursors_to_every_provider_once() -> None:
    scheduler = scheduler_with_health(fleet_snapshot())
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        arguments = {"limit": "7", "health": "available"}
        if cursor is not None:
            arguments["cursor"] = cursor
        page = await read(scheduler, **arguments)
        pages += 1
        assert len(page["providers"]) <= 7
        seen.extend(ids(page))
        cursor = page["next"]
        if cursor is None:
            break
        assert cursor == ids(page)[-1]
    expected = [f"n{i:03d}-p{j}" for i in range(0, NODES, 2) for j in range(PER_NODE - 1)]
    assert seen == expected
    assert pages == -(-len(expected) // 7)  # the last page is not followed by an empty one


async def test_a_cursor_is_a_provider_id_so_a_removed_provider_moves_no_page() -> None:
    snapshot = fleet_snapshot()
    scheduler = scheduler_with_health(snapshot)
    first = await read(scheduler, limit="5")
    # A refresh removes a provider of the first page: the second page is unchanged.
    smaller = Snapshot.build(
        _without_node(snapshot.config, "n000"), revision=4, config_sha256="0" * 64
    )
    scheduler.apply_snapshot(smaller)
    second = await read(scheduler, limit="5", cursor=first["next"])
    assert ids(second) == ["n001-p2", "n002-p0", "n002-p1", "n002-p2", "n003-p0"]


def _without_node(config: EdgeConfig, node_id: str) -> EdgeConfig:
    nodes = [node for node in config.nodes if node.id != node_id]
    gone = {p.id for node in config.nodes if node.id == node_id for p in node.providers}
    models = [
        ModelEntry(
            id=model.id, providers={p: s for p, s in model.providers.items() if p not in gone}
        )
        for model in config.models
    ]
    return EdgeConfig(models=models, nodes=nodes)


# --- slices (never hold the loop) ---------------------------------------------------------


class StepWork(trio.abc.Instrument):
    """How many provider records (and health looks) each task step made: the catalog's
    work between two checkpoints."""

    def __init__(self) -> None:
        self.records = 0
        self.looks = 0
        self.most_records = 0
        self.most_looks = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.records = self.looks = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.most_records = max(self.most_records, self.records)
        self.most_looks = max(self.most_looks, self.looks)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> StepWork:
    work = StepWork()
    build = Scheduler.catalog_providers
    look = Scheduler.catalog_health

    def counted_build(self: Scheduler, provider_ids: Any) -> Any:
        records = build(self, provider_ids)
        work.records += len(records)
        return records

    def counted_look(self: Scheduler, provider_id: str) -> Any:
        work.looks += 1
        return look(self, provider_id)

    monkeypatch.setattr(Scheduler, "catalog_providers", counted_build)
    monkeypatch.setattr(Scheduler, "catalog_health", counted_look)
    return work


async def test_no_step_builds_more_than_a_slice_of_a_large_catalog(counted: StepWork) -> None:
    nodes = 3 * SCAN // PER_NODE  # three scan windows' worth of providers
    scheduler = scheduler_with_health(fleet_snapshot(nodes))
    trio.lowlevel.add_instrument(counted)
    whole = await read(scheduler)
    assert len(whole["providers"]) == nodes * PER_NODE
    unknown = await read(scheduler, health="unknown", limit="10")
    assert len(unknown["providers"]) == 10 and unknown["next"] is not None
    assert 0 < counted.most_records <= SLICE
    assert 0 < counted.most_looks <= SCAN
