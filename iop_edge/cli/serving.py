"""`iop-edge serve` and `iop-edge demo`: the commands that run an Edge in this process."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import trio

from iop_edge.cli import config_lookup as lookup
from iop_edge.cli.arguments import (
    Subcommands,
    add_logging,
    listen_address,
    loopback_listen_address,
)
from iop_edge.cli.errors import fail
from iop_edge.core.configuration.config import ConfigInvalid, format_errors
from iop_edge.core.exception_groups import sole_exception


def cmd_serve(args: argparse.Namespace) -> int:
    from iop_edge.edge import EdgeStartupError, ListenerUnavailable
    from iop_edge.main import serve_edge, setup_logging
    from iop_edge.runtime.metering.usage_ledger.usage_store import LedgerUnavailable

    node_listen, admin_listen = args.node_listen, args.admin_listen
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
                fail(f"{args.config}: invalid config\n{format_errors(exc.errors)}")
            case ListenerUnavailable() as exc:
                where = (
                    f"pass another to {exc.config_key}"
                    if exc.config_key.startswith("--")
                    else f"set another port in {exc.config_key} of {args.config}"
                )
                fail(
                    f"{exc}. Stop whatever holds that port, or {where} (port 0 picks a free "
                    "one; the Edge logs the port it got)"
                )
            case EdgeStartupError() | LedgerUnavailable() as exc:
                fail(f"{args.config}: cannot start: {exc}")
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
                fail(f"invalid demo config\n{format_errors(exc.errors)}")
            case DemoError() as exc:
                fail(str(exc))
            case ListenerUnavailable() as exc:
                fail(
                    f"{exc}. Is another demo or Edge running? Rerun with --ephemeral-ports to "
                    f"use free ports, or change {exc.config_key} in a copy of the demo config "
                    "(--config)"
                )
            case _:
                raise


def add_serve_parser(sub: Subcommands) -> None:
    """`iop-edge serve`."""
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
    add_logging(serve, "info")
    serve.add_argument(
        "--node-listen",
        type=listen_address,
        metavar="HOST:PORT",
        help="this process's node listener instead of edge.listen (each replica on a host "
        "needs its own)",
    )
    serve.add_argument(
        "--admin-listen",
        type=loopback_listen_address,
        metavar="HOST:PORT",
        help="this process's admin listener instead of admin.listen (loopback; each replica "
        "on a host needs its own)",
    )
    serve.set_defaults(func=cmd_serve)


def add_demo_parser(sub: Subcommands) -> None:
    """`iop-edge demo`."""
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
    add_logging(demo, "warning")
    demo.set_defaults(func=cmd_demo)
