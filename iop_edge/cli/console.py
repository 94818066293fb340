"""Terminal rendering of admin API answers (rich tables), from their JSON form.

The CLI talks to a running Edge over HTTP, so it renders the JSON documents the admin API
returns rather than importing server-side objects.

Every value from the Edge goes out as a `Text`, never as a plain string: rich reads
`[...]` in a string as markup, and would silently drop the keys of a config path such as
`nodes[gpu1].providers[gpu1-vllm].capacity`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from iop_edge.cli.fitted_table import Column, fitted_table, left_out_note


def _cell(value: object) -> Text:
    """A table cell or line showing `value` literally (no markup)."""
    return Text(str(value))


def _yes(value: object) -> Text:
    return Text("yes", style="green") if value else Text("no", style="red")


#: Colour of each health state (design §4, §12): up, alive but generating, on its way out,
#: not known yet, down.
_HEALTH_STYLES = {
    "available": "green",
    "busy": "cyan",
    "draining": "yellow",
    "unknown": "yellow",
    "unavailable": "red",
}


def _health(provider: dict[str, Any]) -> Text:
    """Health, and why the provider is not (fully) in the pool: a disconnected Node and a
    down upstream read differently even when no other column fits."""
    health = provider.get("health", "unknown") if provider.get("connected") else "unavailable"
    label = health
    if provider.get("cooling_down"):
        label = f"{health} (cooldown)"
    elif provider.get("rate_limited_s") is not None:
        label = f"{health} (rate-limited)"
    text = Text(label, style=_HEALTH_STYLES.get(health, "yellow"))
    reason = provider.get("health_reason")
    if reason:
        text.append(f": {reason}", style="dim")
    return text


#: The providers table's columns, in display order: the essential ones first (always
#: shown), then the others by importance, each shown if it still fits the terminal, so an
#: 80-column terminal gets a readable table (a note names what was left out; `--json` has
#: everything). A provider's waiting requests are its models' queues, shown once per
#: model in the models table.
_PROVIDER_COLUMNS: tuple[tuple[str, bool], ...] = (
    ("provider", True),
    ("in_flight/capacity", True),
    ("health", True),
    ("node", False),
    ("connected", False),
    ("models", False),
    ("load", False),
    ("long", False),
    ("type", False),
    ("protocols", False),
    ("enabled", False),
    ("priority", False),
    ("category", False),
    ("lifecycle", False),
)
#: The health cell folds (it carries the reason); it is planned at this width at most.
_HEALTH_PLAN_WIDTH = 28


#: A served name the provider's Node does not serve yet, as the catalog says why.
_UNAPPLIED: Final = {"pending": "not applied by its node yet", "refused": "refused by its node"}


def _models_held(p: dict[str, Any]) -> str:
    """The provider's served models, each with its load state where the runtime reports
    one (design §18: `smol-a (loaded), smol-b (unloaded)`), or why its Node does not
    serve it yet (design §5 step 6), and how many it holds at once."""
    states = {s["name"]: s for s in p.get("model_states") or ()}
    unapplied = p.get("unapplied") or {}
    cells = []
    for name in p.get("models", []):
        state = states.get(name)
        if name in unapplied:
            cells.append(f"{name} ({_UNAPPLIED.get(unapplied[name], unapplied[name])})")
        elif state is None:
            cells.append(name if not states else f"{name} (not listed)")
        elif state.get("reason"):
            cells.append(f"{name} ({state['state']}: {state['reason']})")
        else:
            cells.append(f"{name} ({state['state']})")
    held = p.get("max_loaded")
    return ", ".join(cells) + (f"; holds {held} at once" if held else "")


def _provider_cells(p: dict[str, Any]) -> dict[str, Text]:
    load = p.get("load_ratio")
    long_slots = p.get("long_context_slots")
    # What the runtime's API offers when the node could tell, else what config declares.
    flags = p.get("discovered_lifecycle") or p.get("lifecycle") or {}
    lifecycle = [
        name.removesuffix("_models").removesuffix("_model") for name, on in flags.items() if on
    ]
    return {
        "provider": _cell(p["id"]),
        "node": _cell(p.get("node_id", "")),
        "type": _cell(p.get("type", "")),
        # Spoken natively; the Node translates the others (design §14).
        "protocols": _cell(", ".join(p.get("protocols", [])) or "-"),
        "category": _cell(p.get("category", "")),
        "enabled": _yes(p.get("enabled")),
        "connected": _yes(p.get("connected")),
        "health": _health(p),
        "in_flight/capacity": _cell(f"{p.get('in_flight', 0)}/{p.get('capacity', 0)}"),
        "load": _cell("-" if load is None else f"{load:.2f}"),
        "long": _cell("-" if long_slots is None else f"{p.get('long_in_flight', 0)}/{long_slots}"),
        "priority": _cell(p.get("priority", "")),
        "models": _cell(_models_held(p)),
        "lifecycle": _cell(", ".join(lifecycle) or "-"),
    }


#: A model's providers the models table names; the rest are counted (`--model M` lists
#: them all as rows of the providers table).
MODEL_PROVIDERS_SHOWN = 8


def catalog_view(catalog: dict[str, Any], width: int) -> Group:
    """The models table, the providers table and, when columns were left out, a note."""
    rows = [_provider_cells(p) for p in catalog.get("providers", [])]
    models = Table(title="Models", title_justify="left")
    for column in ("model", "display name", "providers (served name)", "queued"):
        models.add_column(column, overflow="fold")
    for m in catalog.get("models", []):
        entries = list((m.get("providers") or {}).items())
        mapping = ", ".join(f"{pid} -> {served}" for pid, served in entries[:MODEL_PROVIDERS_SHOWN])
        if len(entries) > MODEL_PROVIDERS_SHOWN:  # a fleet's model: thousands of providers
            mapping += f" and {len(entries) - MODEL_PROVIDERS_SHOWN} more"
        models.add_row(
            _cell(m["id"]),
            _cell(m.get("display_name") or ""),
            _cell(mapping),
            str(m.get("queued", 0)),
        )
    columns = [
        Column(
            name,
            [row[name] for row in rows],
            essential=essential,
            folds_at=_HEALTH_PLAN_WIDTH if name == "health" else None,
        )
        for name, essential in _PROVIDER_COLUMNS
    ]
    providers, left_out = fitted_table(
        columns, width, title=f"Providers (revision {catalog.get('revision')})"
    )
    parts: list[Any] = [models, providers]
    if left_out:
        parts.append(left_out_note(left_out, width))
    return Group(*parts)


def render_catalog(console: Console, catalog: dict[str, Any]) -> None:
    console.print(catalog_view(catalog, console.width), crop=False)  # fitted_table Rule 4


def watch_catalog(
    console: Console, fetch: Callable[[], dict[str, Any]], *, interval_s: float
) -> None:
    """Redraw the catalog in place every `interval_s` until Ctrl-C (`catalog --watch`)."""
    with Live(console=console, auto_refresh=False, screen=False) as live:
        while True:
            catalog = fetch()
            stamp = Text(f"{time.strftime('%H:%M:%S')}  every {interval_s:g}s, Ctrl-C stops")
            live.update(Group(stamp, catalog_view(catalog, console.width)), refresh=True)
            time.sleep(interval_s)


def _headline(report: dict[str, Any], status: int, source: str) -> Text:
    outcome = report.get("outcome", "?")
    base, revision = report.get("base_revision"), report.get("revision")
    changes = len(report.get("changes") or [])
    live = len(report.get("live_paths") or [])
    restart = len(report.get("restart_required_paths") or [])
    split = f" ({live} live, {restart} need a restart)" if changes else ""
    if outcome == "dry_run":
        what = f"{changes} path(s) would change{split}" if changes else "no changes"
        text = f"dry run of {source}: {what}; revision {base} stays"
        style = "cyan"
    elif outcome == "applied":
        text = f"applied {source}: {changes} path(s) changed{split}; revision {base} -> {revision}"
        style = "green"
    elif outcome == "no_change":
        text = f"applied {source}: no changes; revision {base} -> {revision}"
        style = "cyan"
    else:
        text = f"refused {source} (HTTP {status}): nothing was applied; revision {base} stays"
        style = "red"
    return Text(text, style=f"bold {style}")


def _with_flags(text: str, flags: dict[str, str]) -> str:
    """A server message or path with the request fields named as the CLI's flags."""
    for field, flag in flags.items():
        text = text.replace(f"with {field}", f"with {flag}").replace(
            f"send {field}", f"pass {flag}"
        )
        if text == field:
            text = flag
    return text


def render_refresh_report(
    console: Console,
    report: dict[str, Any],
    status: int,
    *,
    source: str = "the config",
    flags: dict[str, str] | None = None,
) -> None:
    flags = flags or {}
    console.print(_headline(report, status, source), soft_wrap=True)
    errors = report.get("errors") or []
    if errors:
        title = "an apply would be refused:" if report.get("outcome") == "dry_run" else "errors:"
        console.print(Text(title, style="bold red"))
        for error in errors:
            where = _with_flags(error.get("path") or "", flags)
            message = _with_flags(error["message"], flags)
            console.print(_cell(f"  {where}: {message}" if where else f"  {message}"))
    changes = report.get("changes") or []
    if changes:
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
    hint = restart_hint(report)
    if hint:
        console.print(Text(hint, style="yellow"), soft_wrap=True)
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


def restart_hint(report: dict[str, Any]) -> str | None:
    """How the changes that need a restart get applied, when a report has any: a restart
    with no downtime, not a stop and a start."""
    waiting = set(report.get("restart_required_paths") or []) | set(
        report.get("pending_restart") or []
    )
    if not waiting:
        return None
    return (
        f"{len(waiting)} change(s) need a restart: `iop-edge restart` applies them with no "
        "downtime (a new Edge process reads the config file and takes over the ports and the "
        "Nodes; runs in flight finish on the old one)"
    )


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


#: Counts every usage row has; any other key it carries is a grouping column. The
#: `estimated_*` counts say how much of a row IOP estimated because the provider reported
#: no usage (`usage_source: estimated`); `cached_tokens` how much of the prompt tokens the
#: runtimes reported taking from their prefix cache.
_USAGE_COUNTS = (
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "estimated_requests",
    "estimated_tokens",
)


def _window(report: dict[str, Any]) -> str:
    def when(value: float | None, default: str) -> str:
        if value is None:
            return default
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(value))

    return f"{when(report.get('since'), 'the start')} to {when(report.get('until'), 'now')}"


def render_usage(
    console: Console,
    report: dict[str, Any],
    by_status: dict[str, Any] | None = None,
    *,
    next_page: str | None = None,
) -> None:
    """The grouped rows with a totals row, then requests by HTTP status, then each
    principal against its limits. Columns the server adds to its rows (e.g.
    `usage_source`) are shown as they come."""
    rows = report.get("rows") or []
    if not rows:
        console.print(f"no usage recorded from {_window(report)}")
        _render_principals(console, report.get("principals"))
        return
    columns = list(report.get("group_by") or [])
    for row in rows:
        for key in row:
            if key not in columns and key not in _USAGE_COUNTS:
                columns.append(key)
    # The window's totals, every page's, when the server sends them (a page is a part).
    whole = report.get("totals")
    totals = {
        count: int(whole.get(count) or 0)
        if whole
        else sum(int(row.get(count) or 0) for row in rows)
        for count in _USAGE_COUNTS
    }
    # Rows are told apart by their groups: those always show; the counts while they fit.
    table_columns = [
        Column(
            column,
            [_cell("" if row.get(column) is None else row[column]) for row in rows],
            essential=True,
            footer="total" if index == 0 else "",
        )
        for index, column in enumerate(columns)
    ]
    table_columns += [
        Column(
            count.replace("_", " "),
            [Text(str(row.get(count, 0))) for row in rows],
            essential=count == "requests",
            justify="right",
            footer=str(totals[count]),
        )
        for count in _USAGE_COUNTS
    ]
    table, left_out = fitted_table(
        table_columns,
        console.width,
        title=f"Usage from {_window(report)}",
        show_footer=True,
    )
    console.print(table, crop=False)  # fitted_table Rule 4
    if left_out:
        console.print(left_out_note(left_out, console.width))
    if report.get("truncated"):
        console.print(
            _cell(
                f"{len(rows)} groups shown, more follow (the total covers them all); the "
                f"next page: {next_page or 'iop-edge usage --after ' + str(report.get('next'))}"
            ),
            soft_wrap=True,
        )
    statuses = sorted(
        (row for row in (by_status or {}).get("rows") or [] if row.get("status") is not None),
        key=lambda row: int(row["status"]),
    )
    if statuses:
        parts = [f"{row['status']}: {row.get('requests', 0)}" for row in statuses]
        console.print(_cell(f"requests by status: {', '.join(parts)}"))
    _render_principals(console, report.get("principals"))


#: The principals table's optional columns, most telling first; `principal` and `in
#: flight` always show.
_PRINCIPAL_PRIORITY = (
    "principal",
    "in flight",
    "tokens today",
    "requests/min",
    "tokens/min",
    "queued",
    "refused",
    "limits",
    "models",
)


def _render_principals(console: Console, standing: dict[str, Any] | None) -> None:
    """Each principal against its limits (design §15): `used/limit` per limit, blank
    where none is set. Columns that do not fit are left out whole, and named."""
    principals = (standing or {}).get("principals") or []
    if not principals:
        return
    replicas = standing.get("replicas", 1) if standing else 1
    title = "Principals against their limits"
    if replicas > 1:
        title += f" (per-minute and concurrency: this replica's share of {replicas})"

    def against(limit: int | None, remaining: int | None) -> str:
        return (
            ""
            if limit is None
            else f"{remaining if remaining is not None else '?'} left of {limit}"
        )

    cells: dict[str, list[Text]] = {name: [] for name in _PRINCIPAL_PRIORITY}
    for row in principals:
        concurrent = row.get("max_concurrent")
        budget = row.get("tokens_per_day")
        today = row.get("tokens_today", 0)
        refused = ", ".join(
            f"{limit} {count}" for limit, count in sorted((row.get("rejected") or {}).items())
        )
        values = {
            "principal": row["principal_ref"],
            "limits": row.get("limited_by") or "",
            "models": ", ".join(row["models"]) if row.get("models") else "all",
            "in flight": f"{row.get('in_flight', 0)}" + (f"/{concurrent}" if concurrent else ""),
            "queued": row.get("queued", 0),
            "requests/min": against(row.get("requests_per_minute"), row.get("requests_remaining")),
            "tokens/min": against(row.get("tokens_per_minute"), row.get("tokens_remaining")),
            "tokens today": f"{today}" + (f" of {budget}" if budget is not None else ""),
            "refused": refused,
        }
        for name, value in values.items():
            cells[name].append(_cell(value))
    left = ("principal", "limits", "models", "refused")
    display = (
        "principal",
        "limits",
        "models",
        "in flight",
        "queued",
        "requests/min",
        "tokens/min",
        "tokens today",
        "refused",
    )
    columns = [
        Column(
            name,
            cells[name],
            essential=name in ("principal", "in flight"),
            justify="left" if name in left else "right",
        )
        for name in display
    ]
    table, left_out = fitted_table(
        columns, console.width, priority=_PRINCIPAL_PRIORITY, title=title
    )
    console.print(table, crop=False)  # fitted_table Rule 4
    if left_out:
        console.print(left_out_note(left_out, console.width))
