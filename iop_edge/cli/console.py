"""Terminal rendering of admin API answers (rich tables), from their JSON form.

The CLI talks to a running Edge over HTTP, so it renders the JSON documents the admin API
returns rather than importing server-side objects.

Every value from the Edge goes out as a `Text`, never as a plain string: rich reads
`[...]` in a string as markup, and would silently drop the keys of a config path such as
`nodes[gpu1].providers[gpu1-vllm].capacity`.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _cell(value: object) -> Text:
    """A table cell or line showing `value` literally (no markup)."""
    return Text(str(value))


def _yes(value: object) -> Text:
    return Text("yes", style="green") if value else Text("no", style="red")


def _health(value: str) -> Text:
    style = {"available": "green", "unavailable": "red"}.get(value, "yellow")
    return Text(value, style=style)


#: The providers table's columns, in display order: the essential ones first (always
#: shown), then the others by importance, each shown if it still fits the terminal, so an
#: 80-column terminal gets a readable table (`--json` has everything).
_PROVIDER_COLUMNS: tuple[tuple[str, bool], ...] = (
    ("provider", True),
    ("health", True),
    ("in_flight/capacity", True),
    ("queued", True),
    ("node", False),
    ("models", False),
    ("load", False),
    ("long", False),
    ("type", False),
    ("enabled", False),
    ("connected", False),
    ("priority", False),
    ("category", False),
    ("lifecycle", False),
)
#: What a column costs beyond its widest value: padding and the border.
_COLUMN_FRAME = 3


def _provider_cells(p: dict[str, Any]) -> dict[str, Text]:
    load = p.get("load_ratio")
    long_slots = p.get("long_context_slots")
    # What the runtime's API offers when the node could tell, else what config declares.
    flags = p.get("discovered_lifecycle") or p.get("lifecycle") or {}
    lifecycle = [
        name.removesuffix("_models").removesuffix("_model") for name, on in flags.items() if on
    ]
    health = p.get("health", "unknown")
    if p.get("cooling_down"):
        health = f"{health} (cooldown)"
    return {
        "provider": _cell(p["id"]),
        "node": _cell(p.get("node_id", "")),
        "type": _cell(p.get("type", "")),
        "category": _cell(p.get("category", "")),
        "enabled": _yes(p.get("enabled")),
        "connected": _yes(p.get("connected")),
        "health": _health(health),
        "in_flight/capacity": _cell(f"{p.get('in_flight', 0)}/{p.get('capacity', 0)}"),
        "load": _cell("-" if load is None else f"{load:.2f}"),
        "long": _cell("-" if long_slots is None else f"{p.get('long_in_flight', 0)}/{long_slots}"),
        "queued": _cell(p.get("queued", 0)),
        "priority": _cell(p.get("priority", "")),
        "models": _cell(", ".join(p.get("models", []))),
        "lifecycle": _cell(", ".join(lifecycle) or "-"),
    }


def _fitting_columns(rows: list[dict[str, Text]], width: int) -> list[str]:
    """The columns to show: every essential one, then optional ones while they fit."""
    needed = {
        name: max([len(name), *(row[name].cell_len for row in rows)]) + _COLUMN_FRAME
        for name, _ in _PROVIDER_COLUMNS
    }
    shown = [name for name, essential in _PROVIDER_COLUMNS if essential]
    used = sum(needed[name] for name in shown) + 1
    for name, essential in _PROVIDER_COLUMNS:  # essential ones lead, so order is kept
        if not essential and used + needed[name] <= width:
            shown.append(name)
            used += needed[name]
    return shown


def render_catalog(console: Console, catalog: dict[str, Any]) -> None:
    rows = [_provider_cells(p) for p in catalog.get("providers", [])]
    columns = _fitting_columns(rows, console.width)
    providers = Table(title=f"Providers (revision {catalog.get('revision')})", title_justify="left")
    for column in columns:
        providers.add_column(column, overflow="fold")
    for row in rows:
        providers.add_row(*(row[column] for column in columns))
    models = Table(title="Models", title_justify="left")
    for column in ("model", "display name", "providers (served name)", "queued"):
        models.add_column(column, overflow="fold")
    for m in catalog.get("models", []):
        mapping = ", ".join(
            f"{pid} -> {served}" for pid, served in (m.get("providers") or {}).items()
        )
        models.add_row(
            _cell(m["id"]),
            _cell(m.get("display_name") or ""),
            _cell(mapping),
            str(m.get("queued", 0)),
        )
    console.print(models)
    console.print(providers)


def render_refresh_report(console: Console, report: dict[str, Any], status: int) -> None:
    outcome = report.get("outcome", "?")
    style = {"applied": "green", "no_change": "cyan", "dry_run": "cyan"}.get(outcome, "red")
    console.print(
        Text.assemble(
            ("refresh ", "bold"),
            (f"{report.get('mode')}: ", "bold"),
            (outcome, f"bold {style}"),
            f"  (HTTP {status}, revision {report.get('base_revision')}"
            f" -> {report.get('revision')})",
        )
    )
    errors = report.get("errors") or []
    if errors:
        console.print("[bold red]errors:[/]")
        for error in errors:
            console.print(_cell(f"  {error['path']}: {error['message']}"))
    changes = report.get("changes") or []
    if not changes:
        console.print("no changes")
    else:
        table = Table(title="changes", title_justify="left")
        table.add_column("path", overflow="fold")
        table.add_column("class")
        for change in changes:
            cls = change.get("class", "")
            table.add_row(
                _cell(change["path"]), Text(cls, style="green" if cls == "live" else "yellow")
            )
        console.print(table)
    for key in ("changed_models", "changed_providers", "changed_nodes", "pending_restart"):
        values = report.get(key) or []
        if values:
            console.print(_cell(f"{key.replace('_', ' ')}: {', '.join(values)}"))
    nodes = report.get("nodes") or []
    if nodes:
        table = Table(title="nodes", title_justify="left")
        for column in ("node", "status", "revision", "detail"):
            table.add_column(column, overflow="fold")
        for node in nodes:
            table.add_row(
                _cell(node["id"]),
                _cell(node.get("status", "")),
                str(node.get("revision") or "-"),
                _cell(node.get("detail") or ""),
            )
        console.print(table)
    render_replicas(console, report.get("replicas") or [])


def render_replicas(console: Console, replicas: list[dict[str, Any]]) -> None:
    """The Edge processes sharing the ledger, when there is more than this one; those on
    another config stand out (refresh them too)."""
    if len(replicas) < 2:
        return
    table = Table(title="replicas (sharing this ledger)", title_justify="left")
    for column in ("instance", "state", "revision", "config", "admin"):
        table.add_column(column, overflow="fold")
    for replica in replicas:
        same = replica.get("same_config", True)
        mark = " (this one)" if replica.get("current") else ""
        table.add_row(
            _cell(f"{replica.get('instance', '')}{mark}"),
            _cell(replica.get("state", "")),
            str(replica.get("revision", "-")),
            Text(
                str(replica.get("config_sha256", ""))[:12] + ("" if same else "  other config"),
                style="" if same else "bold yellow",
            ),
            _cell(replica.get("admin_url", "")),
        )
    console.print(table)


def render_usage(console: Console, report: dict[str, Any]) -> None:
    columns = list(report.get("group_by") or [])
    table = Table(title="Usage", title_justify="left")
    for column in [*columns, "requests", "prompt tokens", "completion tokens"]:
        table.add_column(column, justify="left" if column in columns else "right")
    for row in report.get("rows", []):
        table.add_row(
            *(str(row.get(column) or "") for column in columns),
            str(row.get("requests", 0)),
            str(row.get("prompt_tokens", 0)),
            str(row.get("completion_tokens", 0)),
        )
    console.print(table)
