"""The argparse pieces several commands share: value types and the logging options."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeAlias

from iop_edge.core.configuration.listen import parse_listen_address
from schemas.runtime.log_lines import LOG_FORMATS, LOG_LEVELS

Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""The parser's `add_subparsers()`: each command module adds its commands to it."""


def _log_level(value: str) -> str:
    level = value.lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid log level {value!r}; choose from {', '.join(LOG_LEVELS)}"
        )
    return level


def page_size(largest: int) -> Callable[[str], int]:
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


def listen_address(value: str) -> str:
    """The argparse type of a listener's `HOST:PORT` (`--node-listen`)."""
    try:
        parse_listen_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value}: {exc}") from None
    return value


def loopback_listen_address(value: str) -> str:
    """The argparse type of the admin listener's `HOST:PORT`: a loopback one."""
    try:
        address = parse_listen_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value}: {exc}") from None
    if not address.is_loopback:
        raise argparse.ArgumentTypeError(
            f"{value}: the admin API listens on loopback addresses only"
        )
    return value


def positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {value!r}")
    return seconds


def add_logging(command: argparse.ArgumentParser, default: str) -> None:
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
