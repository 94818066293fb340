"""The answer to `POST /restart` (admin API) and `iop-edge restart` (design §13).

A zero-downtime restart starts a new Edge process beside the running one, hands it the
listening sockets and the Nodes, and lets the old one drain and exit. The report says how
that went: `handed_over` (the successor serves; this process finishes its in-flight runs
and exits), `failed` (the successor did not take over; this process serves on, unchanged)
or `refused` (a restart or stop is already under way, or this Edge cannot restart itself).
"""

from __future__ import annotations

from typing import Literal

import msgspec

RestartOutcome = Literal["handed_over", "failed", "refused"]


class RestartReport(msgspec.Struct, frozen=True, kw_only=True):
    outcome: RestartOutcome
    pid: int
    """This (the old) process."""
    successor_pid: int | None = None
    revision: int | None = None
    """The config revision the successor runs (the old one's + 1), once handed over."""
    detail: str | None = None
    """Why it failed or was refused; what happens next when handed over."""
