"""What one frame from a Node may list is bounded where it is decoded: a `run_events`
message lists at most `MAX_EVENTS_PER_MESSAGE` chunks and ends, a `status` or `load` at
most `MAX_NODE_PROVIDERS` providers. A frame past a bound is a bad frame, refused before
its entries are built, and no real Node sends one: its writer packs what its outbox holds,
and the config allows a Node no more providers."""

from __future__ import annotations

import msgspec
import pytest
import yaml

from iop_edge.core.configuration.config import ConfigInvalid
from iop_edge.runtime.refresh.config_file import check_config
from schemas import wire
from schemas.channel import OUTBOX_SIZE
from schemas.limits import MAX_EVENTS_PER_MESSAGE, MAX_NODE_PROVIDERS
from tests.unit.test_config import provider, valid


def _frame(message: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode(message)


def test_run_events_list_at_most_their_bound() -> None:
    at_bound = [["r1", b""]] * MAX_EVENTS_PER_MESSAGE
    decoded = wire.decode_from_node(_frame({"type": "run_events", "chunks": at_bound}))
    assert isinstance(decoded, wire.RunEvents) and len(decoded.chunks) == MAX_EVENTS_PER_MESSAGE
    for field, entry in (("chunks", ["r1", b""]), ("ends", {"type": "run_done", "run_id": "r"})):
        past = _frame({"type": "run_events", field: [entry] * (MAX_EVENTS_PER_MESSAGE + 1)})
        with pytest.raises(wire.WireError, match=f"length <= {MAX_EVENTS_PER_MESSAGE}"):
            wire.decode_from_node(past)


def test_a_nodes_writer_never_packs_past_the_bound() -> None:
    """One writer pass packs the item it woke for and what the outbox holds."""
    assert OUTBOX_SIZE + 1 <= MAX_EVENTS_PER_MESSAGE


@pytest.mark.parametrize("kind", ["status", "load"])
def test_a_report_lists_at_most_a_nodes_providers(kind: str) -> None:
    entry = {"id": "p", "health": "available"} if kind == "status" else {"id": "p", "in_flight": 0}
    past = _frame({"type": kind, "providers": [entry] * (MAX_NODE_PROVIDERS + 1)})
    with pytest.raises(wire.WireError, match=f"length <= {MAX_NODE_PROVIDERS}"):
        wire.decode_from_node(past)


def test_the_config_gives_a_node_no_more_providers_than_a_report_may_list() -> None:
    raw = valid()
    raw["nodes"][0]["providers"] = [provider(f"p{n}") for n in range(MAX_NODE_PROVIDERS + 1)]
    with pytest.raises(ConfigInvalid) as invalid:
        check_config(yaml.safe_dump(raw))
    assert any("nodes[0].providers" in str(error) for error in invalid.value.errors)
