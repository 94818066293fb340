"""The book of models a refresh gave providers whose Nodes have not applied it yet
(iop_edge.runtime.runs.unapplied_models): pure, snapshot in, answers out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.runs.unapplied_models import UnappliedModels
from schemas.config import EdgeConfig, NodeEntry, ProviderConfig

HASH = "0" * 64


def snapshot(revision: int, nodes: Mapping[str, Mapping[str, Sequence[str]]]) -> Snapshot:
    """`nodes`: node id -> provider id -> the names the provider serves."""
    config = EdgeConfig(
        nodes=[
            NodeEntry(
                id=node_id,
                token_hash_sha256=HASH,
                providers=[
                    ProviderConfig(id=pid, type="sim", models=list(names), capacity=1)
                    for pid, names in providers.items()
                ],
            )
            for node_id, providers in nodes.items()
        ]
    )
    return Snapshot.build(config, revision=revision, config_sha256=HASH)


BASE = snapshot(1, {"n1": {"a": ["small"]}, "n2": {"b": ["small"]}})


def test_a_name_new_to_a_provider_is_pending_until_its_node_applies_that_revision() -> None:
    book = UnappliedModels()
    grown = snapshot(2, {"n1": {"a": ["small", "large"]}, "n2": {"b": ["small"]}})
    book.swapped(BASE, grown)
    assert book
    assert book.state("n1", "a", "large") == "pending"
    assert book.state("n1", "a", "small") == "applied"  # what it served before runs on
    assert book.state("n2", "b", "large") == "applied"
    assert book.applied("n2", 2) == []  # another Node's ack
    assert book.applied("n1", 1) == []  # an older revision's
    assert book.state("n1", "a", "large") == "pending"
    assert book.applied("n1", 2) == ["a"]
    assert book.state("n1", "a", "large") == "applied"
    assert not book


def test_a_refusal_covers_what_its_revision_added_not_what_came_after() -> None:
    book = UnappliedModels()
    second = snapshot(2, {"n1": {"a": ["small", "large"]}, "n2": {"b": ["small"]}})
    third = snapshot(3, {"n1": {"a": ["small", "large", "huge"]}, "n2": {"b": ["small"]}})
    book.swapped(BASE, second)
    book.swapped(second, third)
    assert book.refused("n1", 2) == ["a"]
    assert book.state("n1", "a", "large") == "refused"
    assert book.state("n1", "a", "huge") == "pending"  # revision 3 is on its way
    assert book.of("n1", "a") == {"huge": "pending", "large": "refused"}  # the catalog's
    assert book.of("n2", "b") == {}
    book.applied("n1", 3)
    assert book.state("n1", "a", "large") == book.state("n1", "a", "huge") == "applied"
    assert book.of("n1", "a") == {}
    assert not book


def test_a_swap_that_keeps_a_nodes_entry_looks_at_nothing_of_it() -> None:
    book = UnappliedModels()
    book.swapped(BASE, BASE)
    same_entries = Snapshot.build(BASE.config, revision=2, config_sha256=HASH)
    book.swapped(BASE, same_entries)  # the very entries: a fleet's unchanged Nodes
    assert not book


def test_a_provider_new_to_the_edge_has_all_its_names_added_and_a_node_gone_is_forgotten() -> None:
    book = UnappliedModels()
    more = snapshot(2, {"n1": {"a": ["small"], "c": ["x"]}, "n2": {"b": ["small"]}})
    book.swapped(BASE, more)
    assert book.state("n1", "c", "x") == "pending"
    without_n1 = snapshot(3, {"n2": {"b": ["small"]}})
    book.swapped(more, without_n1)
    assert not book
