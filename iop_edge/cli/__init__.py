"""`iop-edge`: serve, demo, check-config, refresh, catalog, usage, restart, hash-token,
init, example.

Rules for every command:
1. An error is one `iop-edge: error: ...` line (or a few) on stderr saying what is wrong
   and what to do next, and a non-zero exit: 1 for a failure, 2 for a usage error. No
   traceback, no Python dict: an admin API error prints the server's message.
2. Errors name command-line flags (`--candidate`), never the HTTP fields behind them.
3. Output piped into a program that stops reading (`| head`) ends quietly.
4. `--admin` defaults to the `admin.listen` of `--config` (for `refresh`, of `--candidate`
   when no `--config` is given), else of `serve`'s default config (`config_lookup`).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shlex
import sys
import typing
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlencode

import trio
from rich.console import Console

from iop_edge import __version__
from iop_edge.cli import config_lookup as lookup
from iop_edge.cli.models import add_models_parser, run_models
from iop_edge.core.catalog_query import MAX_LIMIT as CATALOG_MAX_LIMIT
from iop_edge.core.config import ConfigInvalid, format_errors, load_config
from iop_edge.core.config_reference import json_schema
from iop_edge.core.exception_groups import sole_exception
from iop_edge.core.exposure import exposure_warnings
from iop_edge.core.listen import parse_listen_address
from iop_edge.core.principals import describe_limits
from iop_edge.core.tokens import hash_token
from schemas.config import ConfigError, EdgeSection, PrincipalLimits
from schemas.log_lines import LOG_FORMATS, LOG_LEVELS
from schemas.wire import Health

EXIT_FAILURE = 1
EXIT_USAGE = 2
#: What a shell reports for a program stopped by SIGPIPE (`| head`).
EXIT_BROKEN_PIPE = 141
#: Groups `iop-edge usage` shows at once (the admin API returns at most `MAX_USAGE_ROWS`).
DEFAULT_USAGE_ROWS = 100
MAX_USAGE_ROWS = 10_000

#: Refresh request fields, as the flags that set them (Rule 2).
FIELD_FLAGS = {
    "if_revision": "--if-revision",
    "allow_restart_required": "--allow-restart-required",
    "config_yaml": "--candidate",
}


class CliError(Exception):
    """Printed as `iop-edge: error: <message>`, exit code 1 (Rule 1)."""


def _fail(message: str) -> NoReturn:
    raise CliError(message)


# --- finding and calling the admin API ------------------------------------------------------


def _config_for_admin(args: argparse.Namespace) -> Path:
    """Which config's `admin.listen` locates the Edge (Rule 4)."""
    if args.config is not None:
        return Path(args.config)
    candidate = getattr(args, "candidate", None)
    if candidate and _loads(Path(candidate)):
        return Path(candidate)
    return lookup.config_or_default(
        None, needed_by="cannot find the admin API: ", advice=lookup.FOR_ADMIN
    )


def _loads(path: Path) -> bool:
    try:
        load_config(path)
    except ConfigInvalid:
        return False
    return True


def _admin_url(args: argparse.Namespace) -> str:
    if args.admin:
        url = str(args.admin).rstrip("/")
        if not url.startswith(("http://", "https://")):
            _fail(f"--admin must be a URL like http://127.0.0.1:7701, got {args.admin!r}")
        return url
    path = _config_for_admin(args)
    try:
        listen = load_config(path).config.admin.listen
    except ConfigInvalid as exc:
        _fail(
            f"cannot find the admin API from {path} (its admin.listen):\n"
            f"{format_errors(exc.errors)}\n"
            "Fix the file, or pass --admin http://HOST:PORT"
        )
    address = parse_listen_address(listen)
    if address.port == 0:
        _fail(
            f"{path} has admin.listen {listen}: the Edge picked a free port when it started. "
            "Pass --admin with the URL it logged ('admin API listening on http://...')"
        )
    return f"http://{address}"


def _admin_call(
    args: argparse.Namespace, method: str, path: str, body: Any = None, *, timeout: float = 120
) -> tuple[int, Any]:
    import httpx2

    base = _admin_url(args)
    try:
        with httpx2.Client(timeout=timeout) as client:
            response = client.request(method, base + path, json=body)
    except httpx2.TransportError as exc:
        _fail(
            f"cannot reach the admin API at {base} ({exc}). Is the Edge running? "
            "Pass --admin with the URL it logged ('admin API listening on ...')"
        )
    try:
        return response.status_code, response.json()
    except ValueError:
        _fail(
            f"the admin API at {base} answered HTTP {response.status_code}: {response.text[:300]}"
        )


def _server_message(document: Any) -> str:
    """The message of an admin API error body (`{"error": {"message": ...}}`)."""
    if isinstance(document, dict):
        error = document.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    return json.dumps(document)


def _get(args: argparse.Namespace, path: str) -> Any:
    status, document = _admin_call(args, "GET", path)
    if status != 200:
        _fail(f"the admin API answered HTTP {status}: {_server_message(document)}")
    return document


# --- commands ---------------------------------------------------------------------------------


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
    from iop_edge.edge import EdgeStartupError, ListenerUnavailable
    from iop_edge.main import serve_edge, setup_logging
    from iop_edge.runtime.metering.usage_store import LedgerUnavailable

    node_listen = _listen_override("--node-listen", args.node_listen)
    admin_listen = _listen_override("--admin-listen", args.admin_listen, loopback=True)
    args.config = lookup.config_or_default(args.config, advice=lookup.FOR_SERVE)
    setup_logging(args.log_level, args.log_format)
    try:
        return trio.run(
            partial(
                serve_edge,
                args.config,
                node_listen=node_listen,
                admin_listen=admin_listen,
                # How to start this very Edge again (`iop-edge restart`, SIGUSR2).
                successor_argv=sys.orig_argv,
            )
        )
    except BaseException as raised:
        match sole_exception(raised):
            case ConfigInvalid() as exc:
                _fail(f"{args.config}: invalid config\n{format_errors(exc.errors)}")
            case ListenerUnavailable() as exc:
                _fail(
                    f"{exc}. Stop whatever holds that port, or set another port in "
                    f"{exc.config_key} of {args.config} (port 0 picks a free one; the Edge "
                    "logs the port it got)"
                )
            case EdgeStartupError() | LedgerUnavailable() as exc:
                _fail(f"{args.config}: cannot start: {exc}")
            case _:
                raise


def cmd_demo(args: argparse.Namespace) -> int:
    from iop_edge.demo import DemoError, load_demo_config, run_demo
    from iop_edge.edge import ListenerUnavailable
    from iop_edge.main import setup_logging

    setup_logging(args.log_level, args.log_format)
    try:
        demo = load_demo_config(args.config)
        return trio.run(
            partial(
                run_demo,
                demo,
                once=args.once,
                no_request=args.no_request,
                ephemeral_ports=args.ephemeral_ports,
            )
        )
    except BaseException as raised:
        match sole_exception(raised):
            case ConfigInvalid() as exc:
                _fail(f"invalid demo config\n{format_errors(exc.errors)}")
            case DemoError() as exc:
                _fail(str(exc))
            case ListenerUnavailable() as exc:
                _fail(
                    f"{exc}. Is another demo or Edge running? Rerun with --ephemeral-ports to "
                    f"use free ports, or change {exc.config_key} in a copy of the demo config "
                    "(--config)"
                )
            case _:
                raise


def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        parsed = load_config(args.path)
        if not args.offline:
            _check_ledger(parsed.config.edge)
    except ConfigInvalid as exc:
        print(f"{args.path}: {len(exc.errors)} error(s)", file=sys.stderr)
        print(format_errors(exc.errors), file=sys.stderr)
        return EXIT_FAILURE
    for warning in [*parsed.warnings, *exposure_warnings(parsed.config)]:
        print(f"warning: {warning}", file=sys.stderr)
    config = parsed.config
    providers = sum(len(node.providers) for node in config.nodes)
    print(
        f"{args.path}: OK — {len(config.models)} model(s), {len(config.nodes)} node(s), "
        f"{providers} provider(s); sha256 {parsed.sha256[:12]}"
    )
    _print_principal_limits(config.principals)
    return 0


def _check_ledger(edge: EdgeSection) -> None:
    """What `serve` checks of the ledger before it serves, changing nothing: room in
    `state_dir`, and a PostgreSQL ledger's package, password variable and server (it is
    connected to, not set up). Raises `ConfigInvalid` naming each problem's setting."""
    from iop_edge.runtime.metering.ledger import choose_ledger
    from iop_edge.runtime.metering.usage_store import LedgerUnavailable

    try:
        choice = choose_ledger(edge)
    except LedgerUnavailable as exc:
        raise ConfigInvalid([ConfigError(path="edge.ledger", message=str(exc))]) from None
    problems = choice.inspect()
    if problems:
        raise ConfigInvalid(problems)


#: `check-config` lists each principal's limits up to this many entries, then counts.
_LIMITS_SHOWN = 20


def _print_principal_limits(entries: list[PrincipalLimits]) -> None:
    for entry in entries[:_LIMITS_SHOWN]:
        print(f"  principal {entry.ref}: {describe_limits(entry)}")
    if len(entries) > _LIMITS_SHOWN:
        print(f"  ... and {len(entries) - _LIMITS_SHOWN} more principal limit entries")


def _check_refresh_source(args: argparse.Namespace) -> str:
    """Without --candidate the Edge re-reads *its own* config file: make sure that is the
    file the operator named with --config, rather than silently comparing another. Returns
    that file's path."""
    status = _get(args, "/status")
    running = status.get("config_file")
    if running is None:
        _fail(
            "this Edge runs without a config file, so there is nothing to re-read: pass "
            "--candidate FILE"
        )
    if args.config is not None and Path(args.config).resolve() != Path(running):
        _fail(
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
            _fail(f"cannot read the candidate {args.candidate} (--candidate): {reason}")
        source = str(args.candidate)
    else:
        source = _check_refresh_source(args)
    if args.if_revision is not None:
        body["if_revision"] = args.if_revision
    if args.allow_restart_required:
        body["allow_restart_required"] = True
    status, report = _admin_call(args, "POST", "/refresh", body)
    if args.json:
        print(json.dumps(report, indent=2))
    elif isinstance(report, dict) and "outcome" in report:
        render_refresh_report(_console(), report, status, source=source, flags=FIELD_FLAGS)
    else:
        _fail(f"the admin API answered HTTP {status}: {_server_message(report)}")
    return 0 if status == 200 else EXIT_FAILURE


class _PipedConsole(Console):
    """rich's Console, leaving a closed pipe to `main` (Rule 3): rich's own handling exits
    with 1, which a shell script reads as a failure; `main` exits 141, as a program
    stopped by SIGPIPE does."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more is written, not even at exit
        raise BrokenPipeError


def _console() -> Console:
    return _PipedConsole(highlight=False)


def _show(args: argparse.Namespace, path: str, render: Callable[[Console, Any], None]) -> int:
    """GET an admin document and print it as JSON (`--json`) or as rich tables."""
    document = _get(args, path)
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        render(_console(), document)
    return 0


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
    return "more: iop-edge catalog " + " ".join([*flags, f"--cursor {shlex.quote(following)}"])


def cmd_catalog(args: argparse.Namespace) -> int:
    from iop_edge.cli.console import render_catalog, watch_catalog

    path = _catalog_path(args)
    if args.watch:
        if args.json:
            raise CliError("--watch redraws a table; it does not combine with --json")
        watch_catalog(_console(), lambda: _get(args, path), interval_s=args.interval)
        return 0
    catalog = _get(args, path)
    if args.json:
        print(json.dumps(catalog, indent=2))
        return 0
    console = _console()
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
    report = _get(args, "/usage?" + urlencode({**query, **page}))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    by_status = _get(args, "/usage?" + urlencode({**query, "group_by": "status"}))
    render_usage(_console(), report, by_status)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    return run_models(args, partial(_admin_call, args), _console())


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
    _fail(
        f"restart {outcome or 'failed'} (the admin API answered HTTP {status}): "
        f"{detail or _server_message(report)}"
    )


def cmd_init(args: argparse.Namespace) -> int:
    from iop_edge.cli.starter import StarterError, report, write_starter

    try:
        starter = write_starter(args.dir, node_id=args.node_id, force=args.force)
    except StarterError as exc:
        _fail(str(exc))
    print(report(starter), end="")
    return 0


def cmd_example(args: argparse.Namespace) -> int:
    from iop_edge.examples import EXAMPLES, read_example

    if args.name is None:
        width = max(map(len, EXAMPLES))
        for name, what in EXAMPLES.items():
            print(f"{name:<{width}}  {what}")
        print("\n`iop-edge example NAME > FILE` writes one; `iop-node example` lists the Node's.")
        return 0
    try:
        text = read_example(args.name)
    except KeyError:
        _fail(f"no example {args.name!r}; there are: {', '.join(EXAMPLES)}")
    sys.stdout.write(text)
    return 0


def cmd_hash_token(args: argparse.Namespace) -> int:
    """Read a token (prompted without echo at a terminal, else a line of stdin); print its
    sha256. The token itself is never printed."""
    if sys.stdin.isatty():
        try:
            token = getpass.getpass("token (not echoed): ")
        except EOFError:
            token = ""
    else:
        token = sys.stdin.readline()
    token = token.strip()
    if not token:
        print(
            "iop-edge: error: no token: type it at the prompt, or pipe it in "
            "(iop-edge hash-token < node.token)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print(hash_token(token))
    return 0


# --- the parser -------------------------------------------------------------------------------


def _log_level(value: str) -> str:
    level = value.lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid log level {value!r}; choose from {', '.join(LOG_LEVELS)}"
        )
    return level


def _page_size(largest: int) -> Callable[[str], int]:
    """The argparse type of a page size: a whole number from 1 to `largest` (what the
    admin API answers at most)."""

    def parse(value: str) -> int:
        try:
            size = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{value}' is not a whole number") from None
        if not 1 <= size <= largest:
            raise argparse.ArgumentTypeError(f"{size} is not between 1 and {largest}")
        return size

    return parse


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {value!r}")
    return seconds


def _add_logging(command: argparse.ArgumentParser, default: str) -> None:
    command.add_argument(
        "--log-level",
        type=_log_level,
        default=default,
        metavar="{" + ",".join(LOG_LEVELS) + "}",
        help=f"least severe log lines to print (default: {default}); access log lines are info",
    )
    command.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: readable lines; json: one JSON object per line (default: text)",
    )


def _add_admin(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--admin",
        metavar="URL",
        help="the Edge's admin API, e.g. http://127.0.0.1:7701 (default: admin.listen of "
        f"--config, else of {lookup.describe_defaults()})",
    )
    command.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="an Edge config whose admin.listen locates the Edge (only that is read)",
    )
    command.add_argument(
        "--json", action="store_true", help="print the admin API's JSON document as it is"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iop-edge",
        description="IOP Edge: one OpenAI-compatible endpoint over a provider pool.",
        epilog="`iop-edge COMMAND --help` describes a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"iop-edge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the Edge (SIGHUP = refresh apply, SIGUSR2 = restart, SIGTERM/SIGINT = drain "
        "and stop)",
        description="Run the Edge. SIGHUP applies the config file again (a live refresh); "
        "SIGUSR2 restarts it with no downtime (a new process takes over the ports and Nodes); "
        "SIGTERM/SIGINT drain in-flight requests and stop, a second one stops at once.",
    )
    serve.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"the Edge config (default: {lookup.describe_defaults()}, the first that "
        "exists); its relative paths (state_dir, tls files) are relative to the current "
        "directory",
    )
    _add_logging(serve, "info")
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
        "demo",
        help="Edge + an in-process Node + sim providers (`iop-edge example demo.yaml`)",
        description="An Edge and an in-process Node serving simulated providers, then one "
        "real streamed request. Needs no GPU, network or secret.",
    )
    demo.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="the demo config (default: the built-in one, `iop-edge example demo.yaml`); "
        "a copy you edit can be "
        "applied while the demo runs with `iop-edge refresh --config FILE --apply`",
    )
    demo.add_argument("--once", action="store_true", help="exit after the example request")
    demo.add_argument("--no-request", action="store_true", help="do not send the example request")
    demo.add_argument(
        "--ephemeral-ports",
        action="store_true",
        help="listen on free ports instead of the config's (CI, busy machines); the demo "
        "prints the URLs",
    )
    _add_logging(demo, "warning")
    demo.set_defaults(func=cmd_demo)

    check = sub.add_parser(
        "check-config",
        help="validate a config; every error with its path",
        description="Validate an Edge config with every rule `serve` applies (including "
        "the TLS files, state_dir and its room on this machine, and a PostgreSQL ledger's "
        "server, connected to but not changed): exit 0 and a summary, or 1 and every "
        "error with its path.",
    )
    check.add_argument("path", type=Path, metavar="FILE", help="the Edge config to check")
    check.add_argument(
        "--offline",
        action="store_true",
        help="check the file only: not the room in state_dir, nor a PostgreSQL ledger's "
        "server (for a machine that will not run the Edge)",
    )
    check.set_defaults(func=cmd_check_config)

    refresh = sub.add_parser(
        "refresh",
        help="dry-run (default) or apply a config refresh",
        description="Show (default) or apply what a config refresh changes. Without "
        "--candidate the Edge re-reads its own config file.",
    )
    _add_admin(refresh)
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

    restart = sub.add_parser(
        "restart",
        help="zero-downtime restart: a new Edge process takes over, the old one drains",
        description="Start a new Edge process (the config file re-read, so restart-required "
        "changes apply) that takes over the ports and Nodes; the old process finishes its "
        "in-flight runs and exits. Callers see no error.",
    )
    _add_admin(restart)
    restart.set_defaults(func=cmd_restart)

    catalog = sub.add_parser(
        "catalog",
        help="show models and providers with live load",
        description="Models (with their queues) and providers (health and why, load). The "
        "provider table fits the terminal and names the columns it left out.",
    )
    _add_admin(catalog)
    catalog.add_argument("--model", metavar="ID", help="only the providers of this model")
    catalog.add_argument("--node", metavar="ID", help="only the providers of this Node")
    catalog.add_argument(
        "--health",
        choices=typing.get_args(Health),
        help="only the providers whose health is this",
    )
    catalog.add_argument(
        "--limit",
        type=_page_size(CATALOG_MAX_LIMIT),
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
        type=_positive_seconds,
        default=1.0,
        metavar="S",
        help="seconds between redraws with --watch (default: 1)",
    )
    catalog.set_defaults(func=cmd_catalog)

    usage = sub.add_parser(
        "usage",
        help="metered usage from the ledger, aggregated",
        description="Requests and tokens from the usage ledger, grouped, with totals and "
        "a breakdown by HTTP status.",
    )
    _add_admin(usage)
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
        type=_page_size(MAX_USAGE_ROWS),
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

    add_models_parser(sub, _add_admin).set_defaults(func=cmd_models)

    hash_cmd = sub.add_parser(
        "hash-token",
        help="read a token (prompted, or on stdin), print its sha256 hex",
        description="Print the sha256 hex of a token, for token_hash_sha256 in the Edge "
        "config. At a terminal it prompts without echo; otherwise it reads one line of "
        "stdin. The token is never printed.",
    )
    hash_cmd.set_defaults(func=cmd_hash_token)

    init = sub.add_parser(
        "init",
        help="write a starter Edge config with a fresh node token",
        description="Write DIR/edge.yaml: an Edge on loopback addresses with one Node "
        "serving the built-in simulated engine, ready for `serve`. The node's token is "
        "made now and printed once; the file keeps only its sha256. Then prints the next "
        "commands.",
    )
    init.add_argument(
        "dir",
        type=Path,
        nargs="?",
        default=Path(),
        metavar="DIR",
        help="the folder to write edge.yaml in, made if missing (default: this one)",
    )
    init.add_argument(
        "--node-id",
        default="node-1",
        metavar="ID",
        help="the node's id, for `iop-node run --node-id` (default: node-1)",
    )
    init.add_argument("--force", action="store_true", help="replace an existing DIR/edge.yaml")
    init.set_defaults(func=cmd_init)

    example = sub.add_parser(
        "example",
        help="print a file the package ships (configs, a systemd unit); none: list them",
        description="Print one of the files the package ships: the commented Edge config, "
        "the demo's config, a systemd unit. Without NAME, list them.",
    )
    example.add_argument("name", nargs="?", metavar="NAME", help="the file to print")
    example.set_defaults(func=cmd_example)

    schema_cmd = sub.add_parser(
        "config-schema",
        help="print the Edge config's JSON Schema (for editors' YAML validation)",
        description="Print the JSON Schema of the Edge config, generated from the schema "
        "IOP validates with. Point an editor's YAML language server at it; `check-config` "
        "still applies the cross-reference rules a schema cannot express.",
    )
    schema_cmd.set_defaults(func=cmd_config_schema)
    return parser


def cmd_config_schema(args: argparse.Namespace) -> int:
    """`iop-edge config-schema`: the JSON Schema on stdout."""
    print(json.dumps(json_schema(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (CliError, lookup.NoConfig) as exc:
        print(f"iop-edge: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:
        # Rule 3: the reader went away (`| head`); anything still buffered goes nowhere,
        # so Python's exit-time flush does not complain either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except BaseException as raised:
        if isinstance(sole_exception(raised), KeyboardInterrupt):  # Ctrl-C, perhaps in a nursery
            return 130
        raise


if __name__ == "__main__":
    sys.exit(main())
