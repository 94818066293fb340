"""`iop-edge`: serve, demo, check-config, refresh, catalog, usage, restart, hash-token."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import trio
from rich.console import Console

from iop_edge.core.config import ConfigInvalid, format_errors, load_config
from iop_edge.core.listen import parse_listen_address
from iop_edge.core.tokens import hash_token

DEFAULT_CONFIG = Path("configs/edge.yaml")


def _admin_url(args: argparse.Namespace) -> str:
    if args.admin:
        return str(args.admin).rstrip("/")
    try:
        listen = load_config(args.config).config.admin.listen
    except ConfigInvalid as exc:
        raise SystemExit(
            f"cannot find the admin API from {args.config}:\n{format_errors(exc.errors)}"
        ) from None
    return f"http://{listen}"


def _admin_call(
    args: argparse.Namespace, method: str, path: str, body: Any = None
) -> tuple[int, Any]:
    import httpx2

    url = _admin_url(args) + path
    try:
        with httpx2.Client(timeout=120) as client:
            response = client.request(method, url, json=body)
    except httpx2.TransportError as exc:
        raise SystemExit(f"cannot reach the admin API at {url}: {exc}") from None
    try:
        return response.status_code, response.json()
    except ValueError:
        raise SystemExit(
            f"admin API answered HTTP {response.status_code}: {response.text[:500]}"
        ) from None


def _listen_override(flag: str, value: str | None, *, loopback: bool = False) -> str | None:
    if value is None:
        return None
    try:
        address = parse_listen_address(value)
    except ValueError as exc:
        raise SystemExit(f"{flag} {value}: {exc}") from None
    if loopback and not address.is_loopback:
        raise SystemExit(f"{flag} {value}: the admin API listens on loopback addresses only")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    from iop_edge.edge import EdgeStartupError
    from iop_edge.main import serve_edge, setup_logging

    node_listen = _listen_override("--node-listen", args.node_listen)
    admin_listen = _listen_override("--admin-listen", args.admin_listen, loopback=True)
    setup_logging(args.log_level)
    try:
        trio.run(
            partial(
                serve_edge,
                args.config,
                node_listen=node_listen,
                admin_listen=admin_listen,
                # How to start this very Edge again (`iop-edge restart`, SIGUSR2).
                successor_argv=sys.orig_argv,
            )
        )
    except ConfigInvalid as exc:
        print(f"{args.config}: invalid config\n{format_errors(exc.errors)}", file=sys.stderr)
        return 1
    except EdgeStartupError as exc:
        print(f"cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from iop_edge.demo import run_demo
    from iop_edge.main import setup_logging

    setup_logging(args.log_level)
    return trio.run(run_demo, args.config, args.once, args.no_request, args.ephemeral_ports)


def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        parsed = load_config(args.path)
    except ConfigInvalid as exc:
        print(f"{args.path}: {len(exc.errors)} error(s)", file=sys.stderr)
        print(format_errors(exc.errors), file=sys.stderr)
        return 1
    config = parsed.config
    providers = sum(len(node.providers) for node in config.nodes)
    for warning in parsed.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"{args.path}: OK — {len(config.models)} model(s), {len(config.nodes)} node(s), "
        f"{providers} provider(s); sha256 {parsed.sha256[:12]}"
    )
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    from iop_edge.cli.console import render_refresh_report

    body: dict[str, Any] = {"mode": "apply" if args.apply else "dry_run"}
    if args.candidate:
        try:
            body["config_yaml"] = Path(args.candidate).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"cannot read the candidate {args.candidate}: {exc}") from None
    if args.if_revision is not None:
        body["if_revision"] = args.if_revision
    if args.allow_restart_required:
        body["allow_restart_required"] = True
    status, report = _admin_call(args, "POST", "/refresh", body)
    if args.json:
        print(json.dumps(report, indent=2))
    elif "outcome" in report:
        render_refresh_report(Console(), report, status)
    else:
        print(f"HTTP {status}: {report}", file=sys.stderr)
    return 0 if status == 200 else 1


def _show(args: argparse.Namespace, path: str, render: Callable[[Console, Any], None]) -> int:
    """GET an admin document and print it as JSON (`--json`) or as rich tables."""
    status, document = _admin_call(args, "GET", path)
    if status != 200:
        print(f"HTTP {status}: {document}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        render(Console(), document)
    return 0


def cmd_catalog(args: argparse.Namespace) -> int:
    from iop_edge.cli.console import render_catalog

    return _show(args, "/catalog", render_catalog)


def cmd_usage(args: argparse.Namespace) -> int:
    from iop_edge.cli.console import render_usage

    query = {"group_by": args.group_by}
    if args.since:
        query["since"] = args.since
    if args.until:
        query["until"] = args.until
    return _show(args, "/usage?" + urlencode(query), render_usage)


def cmd_restart(args: argparse.Namespace) -> int:
    status, report = _admin_call(args, "POST", "/restart")
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
    message = detail or (
        report.get("error", {}).get("message") if isinstance(report, dict) else None
    )
    print(f"restart {outcome or 'failed'} (HTTP {status}): {message or report}", file=sys.stderr)
    return 1


def cmd_hash_token(args: argparse.Namespace) -> int:
    token = sys.stdin.readline().strip()
    if not token:
        print("no token on stdin", file=sys.stderr)
        return 2
    print(hash_token(token))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iop-edge",
        description="IOP Edge: one OpenAI-compatible endpoint over a provider pool.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the Edge (SIGHUP = refresh apply, SIGUSR2 = restart, SIGTERM/SIGINT = drain "
        "and stop)",
    )
    serve.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    serve.add_argument("--log-level", default="INFO")
    serve.add_argument(
        "--node-listen",
        metavar="HOST:PORT",
        help="this process's node listener instead of edge.listen (each replica on a host "
        "needs its own)",
    )
    serve.add_argument(
        "--admin-listen",
        metavar="HOST:PORT",
        help="this process's admin listener instead of admin.listen (loopback; each replica "
        "on a host needs its own)",
    )
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser(
        "demo", help="Edge + an in-process Node + sim providers (configs/demo.yaml)"
    )
    demo.add_argument(
        "--config", type=Path, default=None, help="demo config (default: configs/demo.yaml)"
    )
    demo.add_argument("--once", action="store_true", help="exit after the example request")
    demo.add_argument("--no-request", action="store_true", help="do not send the example request")
    demo.add_argument(
        "--ephemeral-ports",
        action="store_true",
        help="listen on free ports instead of the config's (CI, busy machines)",
    )
    demo.add_argument("--log-level", default="WARNING")
    demo.set_defaults(func=cmd_demo)

    check = sub.add_parser("check-config", help="validate a config; every error with its path")
    check.add_argument("path", type=Path)
    check.set_defaults(func=cmd_check_config)

    for name, func, helptext in (
        ("refresh", cmd_refresh, "dry-run (default) or apply a config refresh"),
        ("catalog", cmd_catalog, "show models and providers with live load"),
        ("usage", cmd_usage, "metered usage from the ledger, aggregated"),
        (
            "restart",
            cmd_restart,
            "zero-downtime restart: a new Edge process (the config file re-read) takes over "
            "the ports and Nodes, the old one drains and exits",
        ),
    ):
        command = sub.add_parser(name, help=helptext)
        command.add_argument("--admin", help="admin API URL (default: admin.listen of --config)")
        command.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
        command.add_argument("--json", action="store_true", help="print the JSON document")
        command.set_defaults(func=func)
        if name == "usage":
            command.add_argument("--since", help="ISO 8601 time or unix seconds")
            command.add_argument("--until", help="ISO 8601 time or unix seconds")
            command.add_argument(
                "--group-by",
                default="principal_ref,token_ref,model",
                help="comma-separated: principal_ref, token_ref, model, provider, node",
            )
        if name == "refresh":
            command.add_argument("--apply", action="store_true", help="apply instead of dry-run")
            command.add_argument(
                "--candidate", help="candidate config file (default: the Edge's own file)"
            )
            command.add_argument("--if-revision", type=int, default=None)
            command.add_argument(
                "--allow-restart-required",
                action="store_true",
                help="apply the live subset; list the rest as pending restart",
            )

    hash_cmd = sub.add_parser("hash-token", help="read a token on stdin, print its sha256 hex")
    hash_cmd.set_defaults(func=cmd_hash_token)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
