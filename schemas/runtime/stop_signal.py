"""The exit status of an Edge or a Node stopped by a signal, the same for both commands.

A shell reports a command that Ctrl-C interrupted as 128 + SIGINT = 130, and scripts rely
on it (`iop-edge demo && next-step` must not run the next step after a Ctrl-C). SIGTERM is
how service managers stop a service: a stop they asked for, so a clean one, 0.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Final

__all__ = ["EXIT_INTERRUPTED", "StopSignal"]

#: What a process stopped by Ctrl-C exits with, as a shell reports an interrupted command.
EXIT_INTERRUPTED: Final = 128 + signal.SIGINT


@dataclass
class StopSignal:
    """Which stop signal a process received; `exit_status` follows from it."""

    signum: signal.Signals | None = None

    def received(self, signum: int) -> None:
        """Note a stop signal: once Ctrl-C was pressed, the process was interrupted."""
        if self.signum is None or signum == signal.SIGINT:
            self.signum = signal.Signals(signum)

    @property
    def exit_status(self) -> int:
        """130 after Ctrl-C (SIGINT), else 0 (SIGTERM, or no signal)."""
        return EXIT_INTERRUPTED if self.signum == signal.SIGINT else 0
