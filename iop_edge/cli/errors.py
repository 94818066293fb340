"""How an `iop-edge` command fails: one line on stderr and an exit status (Rule 1 of the
package docstring). A command raises `CliError` (or calls `fail`); `main` prints it."""

from __future__ import annotations

from typing import NoReturn

EXIT_FAILURE = 1
EXIT_USAGE = 2
#: What a shell reports for a program stopped by SIGPIPE (`| head`).
EXIT_BROKEN_PIPE = 141


class CliError(Exception):
    """Printed as `iop-edge: error: <message>`, exit code 1 (Rule 1)."""


def fail(message: str) -> NoReturn:
    raise CliError(message)
