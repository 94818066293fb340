"""An idle fleet's pings cost the Edge in proportion to their rate, so the heartbeat
interval an Edge announces grows with its fleet (`runtime.nodes.heartbeat`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from iop_edge.core.configuration.config import parse_config
from iop_edge.edge import Edge
from iop_edge.runtime.nodes.heartbeat import PINGS_PER_S, fleet_interval


@pytest.mark.parametrize("nodes", [0, 1, 100, PINGS_PER_S * 5, 7_500, 10_000, 50_000])
def test_an_idle_fleet_pings_at_most_the_budget_and_never_faster_than_asked(nodes: int) -> None:
    interval = fleet_interval(5.0, nodes)
    assert interval >= 5.0
    assert nodes / interval <= PINGS_PER_S


def test_small_fleets_keep_the_configured_interval_large_ones_stretch_it() -> None:
    assert fleet_interval(5.0, 2000) == 5.0
    assert fleet_interval(5.0, 10_000) == 20.0


async def test_the_edge_announces_its_fleets_interval(tmp_path: Path) -> None:
    nodes = "".join(
        f"  - id: n{i}\n    token_hash_sha256: {'a' * 64}\n" for i in range(PINGS_PER_S * 8)
    )
    text = (
        f"edge: {{id: e, listen: '127.0.0.1:0', state_dir: '{tmp_path}'}}\n"
        "admin: {listen: '127.0.0.1:0'}\n"
        "openai: {listen: '127.0.0.1:0'}\n"
        f"nodes:\n{nodes}"
    )
    edge = Edge(parse_config(text), heartbeat_s=2.0)
    assert edge.hub.heartbeat_s == 8.0
    assert edge.hub.heartbeats.interval_s == 8.0
