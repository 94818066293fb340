"""The console's tables (`iop_edge.cli.console`): refresh replicas, catalog providers, and
the aligned rows of a fleet's tables (`iop_edge.cli.fitted_table` Rule 4)."""

from __future__ import annotations

import io

from rich.console import Console
from rich.text import Text

from iop_edge.cli.console import render_catalog, render_refresh_report
from iop_edge.cli.fitted_table import ALIGNED_ROWS, Column, fitted_table
from iop_edge.cli.models import _render_list


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


def test_a_long_health_reason_folds_and_leaves_room_for_the_other_columns() -> None:
    """The health column is planned at its fold width (`Column.folds_at`), not at its
    longest reason: a reason of a hundred characters does not push every optional column
    out of a 100-column terminal; it is folded, whole."""
    reason = "the runtime answered the probe with 503 Service Unavailable: " + "busy " * 8
    provider = {**GPU1, "connected": False, "health_reason": reason.strip()}
    text = _catalog_text([provider], 100)
    header = next(line for line in text.splitlines() if "provider" in line and "health" in line)
    assert "node" in header and "connected" in header, header
    assert all(word in text for word in reason.split()), text


def test_a_fleets_providers_are_aligned_rows_whole_and_unframed() -> None:
    """Past `ALIGNED_ROWS` rows (fitted_table Rule 4): every provider a line of its own,
    its cells at their columns, none cut or folded at the terminal's width."""
    reason = "node disconnected, last seen an hour ago by every Edge"
    providers = [
        {**GPU1, "id": f"node-{i:05d}-vllm", "node_id": f"node-{i:05d}"}
        for i in range(ALIGNED_ROWS + 1)
    ]
    providers[7] = {**providers[7], "connected": False, "health_reason": reason}
    lines = _catalog_text(providers, 60).splitlines()

    header = next(i for i, line in enumerate(lines) if line.startswith("provider "))
    rows = lines[header + 1 : header + 1 + len(providers)]
    assert [row.split()[0] for row in rows] == [p["id"] for p in providers]
    assert not any("│" in line or "┃" in line for line in lines[header:])
    health = lines[header].index("health")
    assert rows[7][health:] == f"unavailable: {reason}"  # past the 60 columns, whole
    assert all(row[health:] == "available" for row in rows if row is not rows[7])
    assert lines[header + 1 + len(providers)].startswith("not shown at 60 columns:")


def test_a_fleets_models_by_provider_are_aligned_rows() -> None:
    document = {
        "models": [
            {
                "model": "m",
                "providers": [
                    {
                        "provider": f"p{i}",
                        "served_model": "served",
                        "connected": True,
                        "state": "loaded",
                        "max_loaded": 1,
                    }
                    for i in range(ALIGNED_ROWS + 1)
                ],
            }
        ]
    }
    console = Console(file=io.StringIO(), width=40, color_system=None)
    _render_list(console, document)
    output = console.file
    assert isinstance(output, io.StringIO)
    lines = output.getvalue().splitlines()
    assert lines[:2] == [
        "Models by provider",
        "model  provider  served as  state   holds at once",
    ]
    assert lines[2] == "m      p0        served     loaded  1"
    assert len(lines) == 2 + ALIGNED_ROWS + 1


def test_a_long_fitted_table_keeps_its_footer_and_right_justified_counts() -> None:
    rows = ALIGNED_ROWS + 1
    columns = [
        Column("principal", [Text(f"user-{i}") for i in range(rows)], essential=True),
        Column(
            "requests",
            [Text(str(i)) for i in range(rows)],
            essential=True,
            justify="right",
            footer=str(sum(range(rows))),
        ),
        Column("note", [Text("x" * 50) for _ in range(rows)]),
    ]
    table, left_out = fitted_table(columns, 40, title="Usage", show_footer=True)
    console = Console(file=io.StringIO(), width=40, color_system=None)
    console.print(table)
    output = console.file
    assert isinstance(output, io.StringIO)
    lines = output.getvalue().splitlines()
    assert left_out == ["note"]
    assert lines[:3] == ["Usage", "principal  requests", "user-0            0"]
    assert lines[-1] == " " * 13 + str(sum(range(rows)))
