"""`iop-edge refresh` and `iop-edge restart`: the admin client commands that change the
running Edge (a config refresh, design §5; a zero-downtime restart, design §13)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from iop_edge.cli.admin_client import (
    add_admin,
    admin_call,
    admin_get,
    piped_console,
    server_message,
)
from iop_edge.cli.arguments import Subcommands
from iop_edge.cli.errors import EXIT_FAILURE, fail

#: Refresh request fields, as the flags that set them (Rule 2).
FIELD_FLAGS = {
    "if_revision": "--if-revision",
    "allow_restart_required": "--allow-restart-required",
    "config_yaml": "--candidate",
}


def _check_refresh_source(args: argparse.Namespace) -> str:
    """Without --candidate the Edge re-reads *its own* config file: make sure that is the
    file the operator named with --config, rather than silently comparing another. Returns
    that file's path."""
    status = admin_get(args, "/status")
    running = status.get("config_file")
    if running is None:
        fail(
            "this Edge runs without a config file, so there is nothing to re-read: pass "
            "--candidate FILE"
        )
    if args.config is not None and Path(args.config).resolve() != Path(running):
        fail(
            f"the Edge runs {running}, not {args.config}: --config only locates the Edge "
            f"(its admin.listen), and a refresh without --candidate re-reads the Edge's own "
            f"file. To refresh from {args.config}, run: iop-edge refresh --candidate "
            f"{args.config} [--apply]"
        )
    return str(running)


def cmd_refresh(args: argparse.Namespace) -> int:
    from iop_edge.cli.console import render_refresh_report

    body: dict[str, Any] = {"mode": "apply" if args.apply else "dry_run"}
    if args.candidate:
        try:
            body["config_yaml"] = Path(args.candidate).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            fail(f"cannot read the candidate {args.candidate} (--candidate): {reason}")
        source = str(args.candidate)
    else:
        source = _check_refresh_source(args)
    if args.if_revision is not None:
        body["if_revision"] = args.if_revision
    if args.allow_restart_required:
        body["allow_restart_required"] = True
    status, report = admin_call(args, "POST", "/refresh", body)
    if args.json:
        print(json.dumps(report, indent=2))
    elif isinstance(report, dict) and "outcome" in report:
        render_refresh_report(piped_console(), report, status, source=source, flags=FIELD_FLAGS)
    else:
        fail(f"the admin API answered HTTP {status}: {server_message(report)}")
    return 0 if status == 200 else EXIT_FAILURE


def cmd_restart(args: argparse.Namespace) -> int:
    status, report = admin_call(args, "POST", "/restart")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if status == 200 else 1
    outcome = report.get("outcome") if isinstance(report, dict) else None
    if outcome == "handed_over":
        print(
            f"restarted: the new Edge (pid {report.get('successor_pid')}, config revision "
            f"{report.get('revision')}) serves; the old one (pid {report.get('pid')}) finishes "
            "its in-flight runs and exits"
        )
        return 0
    detail = report.get("detail") if isinstance(report, dict) else None
    fail(
        f"restart {outcome or 'failed'} (the admin API answered HTTP {status}): "
        f"{detail or server_message(report)}"
    )


def add_refresh_parser(sub: Subcommands) -> None:
    """`iop-edge refresh`."""
    refresh = sub.add_parser(
        "refresh",
        help="dry-run (default) or apply a config refresh",
        description="Show (default) or apply what a config refresh changes. Without "
        "--candidate the Edge re-reads its own config file.",
    )
    add_admin(refresh)
    refresh.add_argument("--apply", action="store_true", help="apply instead of a dry run")
    refresh.add_argument(
        "--candidate",
        metavar="FILE",
        help="a candidate config to compare or apply; applied, it replaces the Edge's config "
        "file (the old one kept as .prev). Default: the Edge's own file, re-read",
    )
    refresh.add_argument(
        "--if-revision",
        type=int,
        default=None,
        metavar="N",
        help="refuse unless N is still the running revision (see iop-edge catalog)",
    )
    refresh.add_argument(
        "--allow-restart-required",
        action="store_true",
        help="apply the live changes now; list the rest as pending until a restart",
    )
    refresh.set_defaults(func=cmd_refresh)


def add_restart_parser(sub: Subcommands) -> None:
    """`iop-edge restart`."""
    restart = sub.add_parser(
        "restart",
        help="zero-downtime restart: a new Edge process takes over, the old one drains",
        description="Start a new Edge process (the config file re-read, so restart-required "
        "changes apply) that takes over the ports and Nodes; the old process finishes its "
        "in-flight runs and exits. Callers see no error.",
    )
    add_admin(restart)
    restart.set_defaults(func=cmd_restart)
