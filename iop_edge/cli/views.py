"""`iop-edge catalog` and `iop-edge usage`: the admin client commands that show the running
Edge's pool (design §6) and its metered usage (design §7), as tables or `--json`."""

from __future__ import annotations

import argparse
import json
import shlex
import typing
from typing import Any
from urllib.parse import urlencode

from iop_edge.cli.admin_client import add_admin, admin_flags, admin_get, piped_console
from iop_edge.cli.arguments import Subcommands, page_size, positive_seconds
from iop_edge.cli.errors import CliError
from iop_edge.core.catalog_query import MAX_LIMIT as CATALOG_MAX_LIMIT
from schemas.wire import Health

#: Groups `iop-edge usage` shows at once (the admin API returns at most `MAX_USAGE_ROWS`).
DEFAULT_USAGE_ROWS = 100
MAX_USAGE_ROWS = 10_000


def _catalog_path(args: argparse.Namespace) -> str:
    """`/catalog` with the command's filters and page (`core.catalog_query`)."""
    query = {
        name: str(value)
        for name in ("model", "node", "health", "limit", "cursor")
        if (value := getattr(args, name)) is not None
    }
    return f"/catalog?{urlencode(query)}" if query else "/catalog"


def _next_page_hint(args: argparse.Namespace, catalog: dict[str, Any]) -> str | None:
    """How to ask for the page after this one, when there is one."""
    following = catalog.get("next")
    if not following:
        return None
    flags = [
        f"--{name} {shlex.quote(str(value))}"
        for name in ("model", "node", "health", "limit")
        if (value := getattr(args, name)) is not None
    ]
    flags += [*admin_flags(args), f"--cursor {shlex.quote(following)}"]
    return "more: iop-edge catalog " + " ".join(flags)


def cmd_catalog(args: argparse.Namespace) -> int:
    from iop_edge.cli.console import render_catalog, watch_catalog

    path = _catalog_path(args)
    if args.watch:
        if args.json:
            raise CliError("--watch redraws a table; it does not combine with --json")
        watch_catalog(piped_console(), lambda: admin_get(args, path), interval_s=args.interval)
        return 0
    catalog = admin_get(args, path)
    if args.json:
        print(json.dumps(catalog, indent=2))
        return 0
    console = piped_console()
    render_catalog(console, catalog)
    hint = _next_page_hint(args, catalog)
    if hint is not None:
        console.print(hint, soft_wrap=True, markup=False)
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    from iop_edge.cli.console import render_usage

    query = {"group_by": args.group_by}
    if args.since:
        query["since"] = args.since
    if args.until:
        query["until"] = args.until
    page = {"limit": str(args.limit), **({"after": args.after} if args.after else {})}
    report = admin_get(args, "/usage?" + urlencode({**query, **page}))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    by_status = admin_get(args, "/usage?" + urlencode({**query, "group_by": "status"}))
    render_usage(piped_console(), report, by_status, next_page=_next_usage_page(args, report))
    return 0


def _next_usage_page(args: argparse.Namespace, report: dict[str, Any]) -> str | None:
    """The command for the groups after this page, when more follow."""
    following = report.get("next")
    if not report.get("truncated") or not following:
        return None
    flags = [
        f"--{name.replace('_', '-')} {shlex.quote(str(value))}"
        for name in ("since", "until", "group_by", "limit")
        if (value := getattr(args, name))
    ]
    flags += [*admin_flags(args), f"--after {shlex.quote(str(following))}"]
    return "iop-edge usage " + " ".join(flags)


def add_catalog_parser(sub: Subcommands) -> None:
    """`iop-edge catalog`."""
    catalog = sub.add_parser(
        "catalog",
        help="show models and providers with live load",
        description="Models (with their queues) and providers (health and why, load). The "
        "provider table fits the terminal and names the columns it left out.",
    )
    add_admin(catalog)
    catalog.add_argument("--model", metavar="ID", help="only the providers of this model")
    catalog.add_argument("--node", metavar="ID", help="only the providers of this Node")
    catalog.add_argument(
        "--health",
        choices=typing.get_args(Health),
        help="only the providers whose health is this",
    )
    catalog.add_argument(
        "--limit",
        type=page_size(CATALOG_MAX_LIMIT),
        metavar="N",
        help=f"a page of at most N providers (1..{CATALOG_MAX_LIMIT}); the command then "
        "prints how to ask for the next page",
    )
    catalog.add_argument(
        "--cursor", metavar="ID", help="start after this provider id (a page's `next`)"
    )
    catalog.add_argument(
        "--watch", action="store_true", help="redraw in place as the pool changes (Ctrl-C stops)"
    )
    catalog.add_argument(
        "--interval",
        type=positive_seconds,
        default=1.0,
        metavar="S",
        help="seconds between redraws with --watch (default: 1)",
    )
    catalog.set_defaults(func=cmd_catalog)


def add_usage_parser(sub: Subcommands) -> None:
    """`iop-edge usage`."""
    usage = sub.add_parser(
        "usage",
        help="metered usage from the ledger, aggregated",
        description="Requests and tokens from the usage ledger, grouped, with totals and "
        "a breakdown by HTTP status.",
    )
    add_admin(usage)
    usage.add_argument("--since", metavar="TIME", help="ISO 8601 time or unix seconds")
    usage.add_argument("--until", metavar="TIME", help="ISO 8601 time or unix seconds")
    usage.add_argument(
        "--group-by",
        default="principal_ref,token_ref,model",
        metavar="COLUMNS",
        help="comma-separated: principal_ref, token_ref, model, provider, node, usage_source, "
        "status, protocol (default: principal_ref,token_ref,model)",
    )
    usage.add_argument(
        "--limit",
        type=page_size(MAX_USAGE_ROWS),
        default=DEFAULT_USAGE_ROWS,
        metavar="N",
        help=f"groups to show, 1 to 10000 (default: {DEFAULT_USAGE_ROWS}); the totals "
        "cover them all, and the last line says how to see the next ones",
    )
    usage.add_argument(
        "--after",
        metavar="CURSOR",
        help="show the groups after a previous page (the cursor it printed)",
    )
    usage.set_defaults(func=cmd_usage)
