"""`iop-edge`: the parser built from one module per command group, and `main`.

- `serving`: serve, demo (an Edge in this process)
- `control`: refresh, restart; `views`: catalog, usage; `models`: models (the admin client
  commands, through `admin_client`)
- `config_tools`: check-config, config-schema, init, example, hash-token (no Edge needed)

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
import os
import sys

from iop_edge import __version__
from iop_edge.cli import config_lookup as lookup
from iop_edge.cli.admin_client import add_admin
from iop_edge.cli.config_tools import (
    add_check_config_parser,
    add_config_schema_parser,
    add_example_parser,
    add_hash_token_parser,
    add_init_parser,
)
from iop_edge.cli.control import add_refresh_parser, add_restart_parser
from iop_edge.cli.errors import EXIT_BROKEN_PIPE, EXIT_FAILURE, CliError
from iop_edge.cli.models import add_models_parser, cmd_models
from iop_edge.cli.serving import add_demo_parser, add_serve_parser
from iop_edge.cli.views import add_catalog_parser, add_usage_parser
from iop_edge.core.exception_groups import sole_exception


def build_parser() -> argparse.ArgumentParser:
    """The `iop-edge` parser: each command's options come from the module that runs it."""
    parser = argparse.ArgumentParser(
        prog="iop-edge",
        description="IOP Edge: one OpenAI-compatible endpoint over a provider pool.",
        epilog="`iop-edge COMMAND --help` describes a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"iop-edge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(sub)
    add_demo_parser(sub)
    add_check_config_parser(sub)
    add_refresh_parser(sub)
    add_restart_parser(sub)
    add_catalog_parser(sub)
    add_usage_parser(sub)
    add_models_parser(sub, add_admin).set_defaults(func=cmd_models)
    add_hash_token_parser(sub)
    add_init_parser(sub)
    add_example_parser(sub)
    add_config_schema_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lookup.forget_announced()  # each command says which default config it uses, once
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
