"""A snapshot built in steps (`Snapshot.building`): the steps cut a model's providers, not
only the Nodes, and what they build is the snapshot's lookups, whole and in config order."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from iop_edge.core import snapshot as snapshot_module
from iop_edge.core.configuration.config import parse_config
from iop_edge.core.snapshot import Snapshot
from schemas.config import EdgeConfig

NODES = 300
#: Provider ids a model lists; `model-all` lists every provider, `model-odd` every other.
PROVIDERS = [f"node-{i}-p{j}" for i in range(NODES) for j in range(2)]


def fleet() -> EdgeConfig:
    data: dict[str, Any] = {
        "edge": {"id": "edge-1", "listen": "127.0.0.1:0", "state_dir": "./var"},
        "admin": {"listen": "127.0.0.1:0"},
        "openai": {"listen": "127.0.0.1:0"},
        "models": [
            {"id": "model-all", "providers": dict.fromkeys(PROVIDERS, "served")},
            {"id": "model-odd", "providers": dict.fromkeys(PROVIDERS[1::2], "served")},
        ],
        "nodes": [
            {
                "id": f"node-{i}",
                "token_hash_sha256": f"{i % 10}" * 64,
                "providers": [
                    {"id": f"node-{i}-p{j}", "type": "sim", "models": ["served"], "capacity": 2}
                    for j in range(2)
                ],
            }
            for i in range(NODES)
        ],
    }
    return parse_config(yaml.safe_dump(data, sort_keys=False)).config


def test_a_models_providers_are_looked_at_a_step_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(snapshot_module, "STEP_ENTRIES", 100)
    config = fleet()
    steps = Snapshot.building(config, revision=2, config_sha256="0" * 64)
    taken = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            built: Snapshot = done.value
            break
        taken += 1
    # The models list 900 provider entries, each looked at three times (who serves what,
    # the rivals, the rotations), and 600 providers serve a model: 3,300 entries.
    assert taken >= 3300 // 100
    assert built.provider_models["node-0-p1"] == ("model-all", "model-odd")
    assert built.provider_models["node-0-p0"] == ("model-all",)
    assert built.rivals == {
        "model-all": ("model-all", "model-odd"),
        "model-odd": ("model-all", "model-odd"),
    }
    rotation = built.rotations["model-all"]
    assert [provider_id for provider_id, _, _ in rotation] == PROVIDERS  # config order
    assert all(config.id == provider_id for provider_id, config, _ in rotation)
    assert [node for _, _, node in rotation[:3]] == ["node-0", "node-0", "node-1"]
    assert [p for p, _, _ in built.rotations["model-odd"]] == PROVIDERS[1::2]
    assert built.node_providers["node-7"] == ("node-7-p0", "node-7-p1")
