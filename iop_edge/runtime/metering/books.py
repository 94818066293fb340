"""The books of ended requests: what a request's end updates that its caller does not wait for.

A run's end is billed at once (`Metering.bill`: the usage ledger's journal holds the
record before the caller's last byte, and the provider's cached share counts it). Its
other traces, the metrics (`Metering.count`), the access line and the pool page's
activity, are entered here, a batch at a time; so are the access line and the activity
of a request refused before it became a run (its metrics are counted at once, by the
HTTP layer: a refusal is rare, and a counter is all it costs).

Why a batch: entering one run runs a few hundred lines of metrics, logging and activity
code. Done at each run's end, between two requests' worth of other code, that code and
its data are cold in the CPU's caches every time; done for a batch at once, they are
warm after the first run. Measured at one request at a time, entering runs one by one
took about 5 % of the Edge's CPU per request (85 µs of 1.5 ms); in batches, about half
of that.

Rules:
1. `add` keeps a finished run, `refused` a refused request, with the wall time it ended;
   nothing else happens on the request path. Without `run` (tests, tools: no task to
   wait for) it is entered at once.
2. While `run` runs (the Edge owns it), what is kept is entered together, in the order
   it ended, at most `HOLD_S` after the first of it, or as soon as `MAX_KEPT` wait (a
   burst holds the loop for one batch, not for all of it).
3. Every reader of what the books feed settles them first (`settle`): `/metrics` and the
   pool page's activity never miss a run that ended before they asked. The access log
   is written `HOLD_S` after the request at most.
4. An entry carries the time its request ended: its access line and its activity bucket
   are the end's, not the batch's.
5. What is kept when `run` ends is entered then: a stopping Edge loses no line and no
   count. A run that cannot be counted (a defect) is logged, left out of the access lines
   and costs no other request its entry; the Edge goes on.
"""

from __future__ import annotations

import logging
import time
from typing import Final

import trio

from iop_edge.runtime.metering.access_log import AccessLog, Ended, RefusedRequest
from iop_edge.runtime.metering.activity import Activity
from iop_edge.runtime.metering.metering import Metering, RunRecord

__all__ = ["HOLD_S", "MAX_KEPT", "RunBooks"]

log = logging.getLogger(__name__)

#: How long an ended request may wait to be entered with the next ones (Rule 2).
HOLD_S: Final = 0.05
#: How many ended requests may wait to be entered (Rule 2).
MAX_KEPT: Final = 64


class RunBooks:
    """Enters ended requests in batches (see the module docstring)."""

    def __init__(
        self,
        metering: Metering,
        access_log: AccessLog,
        activity: Activity,
        *,
        hold_s: float = HOLD_S,
    ) -> None:
        self._metering = metering
        self._access_log = access_log
        self._activity = activity
        self._hold_s = hold_s
        self._kept: list[Ended] = []
        """Ended requests not yet entered, with the wall time each ended (Rule 4)."""
        self._keeping = False
        """`run` runs: requests may be kept (Rule 2)."""
        self._waiting = trio.Event()
        """Set once a request is kept and not yet entered."""

    def add(self, record: RunRecord) -> None:
        """A run ended (Rule 1)."""
        self._keep(record)

    def refused(self, request: RefusedRequest) -> None:
        """A request was refused before it became a run (Rule 1)."""
        self._keep(request)

    def _keep(self, request: RunRecord | RefusedRequest) -> None:
        kept = self._kept
        kept.append((request, time.time()))
        if not self._keeping or len(kept) >= MAX_KEPT:
            self.settle()
        elif len(kept) == 1:
            self._waiting.set()

    def settle(self) -> None:
        """Enter everything kept now (Rule 3)."""
        kept, self._kept = self._kept, []
        if not kept:
            return
        metering, activity = self._metering, self._activity
        entered: list[Ended] = []
        for entry in kept:
            request, ended = entry
            try:
                if isinstance(request, RunRecord):
                    metering.count(request)
                    activity.run_finished(request, at=ended)
                else:
                    activity.record(request.status, at=ended)
            except Exception:  # Rule 5
                log.exception("request %s could not be counted", request.request_id)
            else:
                entered.append(entry)
        try:
            self._access_log.write(entered)
        except Exception:  # Rule 5
            log.exception("the access lines of %d request(s) could not be written", len(entered))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owned by the Edge's nursery: lets requests be kept, and enters them at most
        `hold_s` after the first of them (Rule 2); what is kept when it ends is entered."""
        self._keeping = True
        task_status.started()
        try:
            while True:
                await self._waiting.wait()
                await trio.sleep(self._hold_s)
                self._waiting = trio.Event()
                self.settle()
        finally:
            self._keeping = False
            self.settle()  # Rule 5
