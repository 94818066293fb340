"""The console's tables (`iop_edge.cli.console`): refresh replicas, catalog providers."""

from __future__ import annotations

import io

from rich.console import Console

from iop_edge.cli.console import render_catalog, render_refresh_report


def _text(report: dict[str, object]) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    render_refresh_report(console, report, 200)
    output = console.file
    assert isinstance(output, io.StringIO)
    return output.getvalue()


def _replica(instance: str, *, current: bool, same: bool) -> dict[str, object]:
    return {
        "instance": instance,
        "state": "serving",
        "revision": 3 if same else 1,
        "config_sha256": ("a" if same else "b") * 64,
        "current": current,
        "same_config": same,
        "admin_url": f"http://127.0.0.1:77{len(instance)}",
    }


def test_replicas_on_another_config_stand_out() -> None:
    report = {
        "mode": "apply",
        "outcome": "applied",
        "base_revision": 2,
        "revision": 3,
        "replicas": [
            _replica("edge-a/101", current=True, same=True),
            _replica("edge-b/202", current=False, same=False),
        ],
    }
    text = _text(report)
    assert "edge-a/101 (this one)" in text
    [line] = [line for line in text.splitlines() if "edge-b/202" in line]
    assert "other config" in line and "bbbbbbbbbbbb" in line


def test_a_lone_edge_shows_no_replica_table() -> None:
    report = {
        "mode": "apply",
        "outcome": "applied",
        "base_revision": 2,
        "revision": 3,
        "replicas": [_replica("edge-a/101", current=True, same=True)],
    }
    assert "replicas" not in _text(report)


#: A provider's catalog record, as the admin API answers it (the fields the table reads).
GPU1 = {
    "id": "gpu1-vllm",
    "node_id": "gpu1",
    "type": "vllm",
    "connected": True,
    "health": "available",
    "capacity": 4,
    "in_flight": 0,
}


def _catalog_text(providers: list[dict[str, object]], width: int) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    render_catalog(console, {"models": [], "providers": providers})
    output = console.file
    assert isinstance(output, io.StringIO)
    return output.getvalue()


def test_the_catalog_table_shows_what_each_provider_speaks_natively() -> None:
    provider = {**GPU1, "protocols": ["chat", "messages", "responses"]}
    translating = {**provider, "id": "cpu-sim", "type": "sim", "protocols": ["chat"]}
    lines = _catalog_text([provider, translating], 200).splitlines()
    assert any("protocols" in line for line in lines)
    assert any("gpu1-vllm" in line and "chat, messages, responses" in line for line in lines)
    assert any("cpu-sim" in line and "│ chat " in line for line in lines)


def test_the_catalog_table_says_which_models_a_provider_s_node_does_not_serve_yet() -> None:
    provider = {
        **GPU1,
        "models": ["small", "large", "huge"],
        "unapplied": {"large": "pending", "huge": "refused"},
    }
    text = " ".join(_catalog_text([provider], 240).split())
    assert "small, large (not applied by its node yet), huge (refused by its node)" in text, text
