"""The commands that need no running Edge: `check-config`, `config-schema`, `init`,
`example` and `hash-token` (writing, checking and describing config files, and the token
hashes they hold)."""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from pathlib import Path

from iop_edge.cli.arguments import Subcommands
from iop_edge.cli.errors import EXIT_FAILURE, EXIT_USAGE, fail
from iop_edge.core.configuration.config import ConfigInvalid, format_errors
from iop_edge.core.configuration.config_reference import json_schema
from iop_edge.core.configuration.exposure import exposure_warnings
from iop_edge.core.configuration.tokens import hash_token
from iop_edge.core.principals import describe_limits
from iop_edge.runtime.refresh.config_file import load_config
from schemas.config import EdgeSection, PrincipalLimits


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
    """What `serve` checks of the ledger (`ledger_problems`); raises `ConfigInvalid`."""
    from iop_edge.runtime.metering.ledger import ledger_problems

    problems = ledger_problems(edge)
    if problems:
        raise ConfigInvalid(problems)


#: `check-config` lists each principal's limits up to this many entries, then counts.
_LIMITS_SHOWN = 20


def _print_principal_limits(entries: list[PrincipalLimits]) -> None:
    for entry in entries[:_LIMITS_SHOWN]:
        print(f"  principal {entry.ref}: {describe_limits(entry)}")
    if len(entries) > _LIMITS_SHOWN:
        print(f"  ... and {len(entries) - _LIMITS_SHOWN} more principal limit entries")


def cmd_init(args: argparse.Namespace) -> int:
    from iop_edge.cli.starter import StarterError, report, write_starter

    try:
        starter = write_starter(args.dir, node_id=args.node_id, force=args.force)
    except StarterError as exc:
        fail(str(exc))
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
        fail(f"no example {args.name!r}; there are: {', '.join(EXAMPLES)}")
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


def cmd_config_schema(args: argparse.Namespace) -> int:
    """`iop-edge config-schema`: the JSON Schema on stdout."""
    print(json.dumps(json_schema(), indent=2))
    return 0


def add_check_config_parser(sub: Subcommands) -> None:
    """`iop-edge check-config`."""
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


def add_hash_token_parser(sub: Subcommands) -> None:
    """`iop-edge hash-token`."""
    hash_cmd = sub.add_parser(
        "hash-token",
        help="read a token (prompted, or on stdin), print its sha256 hex",
        description="Print the sha256 hex of a token, for token_hash_sha256 in the Edge "
        "config. At a terminal it prompts without echo; otherwise it reads one line of "
        "stdin. The token is never printed.",
    )
    hash_cmd.set_defaults(func=cmd_hash_token)


def add_init_parser(sub: Subcommands) -> None:
    """`iop-edge init`."""
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


def add_example_parser(sub: Subcommands) -> None:
    """`iop-edge example`."""
    example = sub.add_parser(
        "example",
        help="print a file the package ships (configs, a systemd unit); none: list them",
        description="Print one of the files the package ships: the commented Edge config, "
        "the demo's config, a systemd unit. Without NAME, list them.",
    )
    example.add_argument("name", nargs="?", metavar="NAME", help="the file to print")
    example.set_defaults(func=cmd_example)


def add_config_schema_parser(sub: Subcommands) -> None:
    """`iop-edge config-schema`."""
    schema_cmd = sub.add_parser(
        "config-schema",
        help="print the Edge config's JSON Schema (for editors' YAML validation)",
        description="Print the JSON Schema of the Edge config, generated from the schema "
        "IOP validates with. Point an editor's YAML language server at it; `check-config` "
        "still applies the cross-reference rules a schema cannot express.",
    )
    schema_cmd.set_defaults(func=cmd_config_schema)
