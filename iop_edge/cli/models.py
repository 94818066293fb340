"""`iop-edge models`: each served model's load state per provider, and the operator's
loads, unloads and pins (design §10, §18), through the admin API (`GET /models`,
`POST /models/load|unload|pin|unpin`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from iop_edge.cli.admin_client import admin_call, piped_console
from iop_edge.cli.fitted_table import ALIGNED_ROWS, Column, aligned

__all__ = ["AdminCall", "add_models_parser", "cmd_models", "run_models"]

AdminCall = Callable[..., tuple[int, Any]]
"""`(method, path, body=None, *, timeout=...)` to the admin API: its status and JSON."""

#: How long `load` waits for the Edge's answer: the runtime's load (up to the provider's
#: `adapter.load_timeout_s`, 300 s by default) and then some.
LOAD_WAIT_S = 660.0


def add_models_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    add_admin: Callable[[argparse.ArgumentParser], None],
) -> argparse.ArgumentParser:
    """The `models` command and its `list`, `load`, `unload`, `pin` and `unpin` actions."""
    models = sub.add_parser(
        "models",
        help="models' load states per provider; load, unload, pin or unpin one",
        description="Without an action, each catalog model and, per provider serving it, "
        "the load state its runtime reports. `load MODEL` loads it on a provider (one that "
        "holds it already, else one with room, else the least busy; --provider picks one); "
        "`unload MODEL` unloads it from every provider holding it (or --provider's). `pin "
        "MODEL` loads it (on --provider, else where a config pin would go: a holder, else room, "
        "else the model's rendezvous order) and keeps it loaded "
        "there until `unpin MODEL` or the Edge restarts. Each command waits until the "
        "runtimes did it, and is audited.",
    )
    add_admin(models)
    models.add_argument(
        "action",
        nargs="?",
        choices=("list", "load", "unload", "pin", "unpin"),
        default="list",
        help="list (the default) the states, or load, unload, pin or unpin MODEL",
    )
    models.add_argument("model", nargs="?", metavar="MODEL", help="a catalog model id")
    models.add_argument("--provider", metavar="ID", help="the provider to act on")
    return models


def cmd_models(args: argparse.Namespace) -> int:
    return run_models(args, partial(admin_call, args), piped_console())


def run_models(args: argparse.Namespace, call: AdminCall, console: Console) -> int:
    """Run `iop-edge models`; the exit status."""
    if args.action == "list":
        status, document = call("GET", "/models")
        return _answer(args, console, status, document, _render_list)
    if not args.model:
        console.print(f"iop-edge models {args.action}: name the MODEL", markup=False)
        return 2
    body = {"model": args.model, "provider": args.provider}
    status, report = call("POST", f"/models/{args.action}", body, timeout=LOAD_WAIT_S)
    return _answer(args, console, status, report, _render_report)


def _answer(
    args: argparse.Namespace,
    console: Console,
    status: int,
    document: Any,
    render: Callable[[Console, dict[str, Any]], None],
) -> int:
    if args.json:
        print(json.dumps(document, indent=2))
    elif isinstance(document, dict) and "error" in document and "outcome" not in document:
        console.print(f"the admin API answered HTTP {status}: {document['error']}", markup=False)
    else:
        render(console, document)
    return 0 if status == 200 else 1


def _render_list(console: Console, document: dict[str, Any]) -> None:
    rows: list[tuple[str, str, str, str, str]] = []
    for model in document.get("models", []):
        for provider in model.get("providers", []):
            state = provider.get("state") or "(not reported)"
            if not provider.get("connected"):
                state = "(node disconnected)"
            elif provider.get("reason"):
                state = f"{state}: {provider['reason']}"
            if provider.get("pinned"):
                state = f"{state}, pinned"
            held = provider.get("max_loaded")
            rows.append(
                (
                    model["model"],
                    provider["provider"],
                    provider["served_model"],
                    state,
                    "-" if held is None else str(held),
                )
            )
    names = ("model", "provider", "served as", "state", "holds at once")
    title = "Models by provider"
    if len(rows) > ALIGNED_ROWS:  # a fleet's (fitted_table Rule 4)
        cells = [[Text(row[index]) for row in rows] for index in range(len(names))]
        columns = [Column(name, cells[i]) for i, name in enumerate(names)]
        console.print(aligned(columns, title=title), crop=False)
        return
    table = Table(title=title)
    for name in names:
        table.add_column(name)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _render_report(console: Console, report: dict[str, Any]) -> None:
    action, model = report.get("action", "?"), report.get("model", "?")
    if report.get("error"):
        console.print(f"{action} of {model}: {report['error']}", markup=False)
        return
    for result in report.get("results", []):
        where = f"{result['provider']} ({result['served_model']})"
        if result.get("ok"):
            console.print(f"{action} of {model} on {where}: done", markup=False)
        else:
            console.print(f"{action} of {model} on {where}: {result.get('error')}", markup=False)
