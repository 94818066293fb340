"""One request parked in a model's queue until the scheduler grants or refuses it.

A waiter carries what it asks for (`kind`: model, long, exclusions, protocol), the event
that wakes it and the cancel scope that holds its queue deadline; the scheduler's queue
walk settles it with a lease or an `AdmissionError` (design §4).
"""

from __future__ import annotations

import trio

from iop_edge.core.routing.affinity import Affinity
from iop_edge.runtime.runs.admission_errors import AdmissionError
from iop_edge.runtime.runs.lease import Lease
from iop_edge.runtime.runs.provider_state import ProviderState
from schemas.protocols import CallerProtocol


class Waiter:
    """One request parked in a model's queue."""

    __slots__ = (
        "affinity",
        "enqueued_at",
        "error",
        "event",
        "exclude",
        "kind",
        "lease",
        "long",
        "model_id",
        "principal",
        "protocol",
        "run_id",
        "scope",
        "seq",
        "timeout_s",
        "work",
    )

    def __init__(
        self,
        *,
        seq: int,
        model_id: str,
        run_id: str,
        long: bool,
        exclude: frozenset[str],
        enqueued_at: float,
        timeout_s: float,
        protocol: CallerProtocol,
        principal: str,
        work: int = 1,
        affinity: Affinity | None = None,
    ) -> None:
        self.seq = seq
        self.affinity = affinity
        self.principal = principal
        """Arrival order across all models' queues (a clock reading could tie)."""
        self.work = work
        """Its estimated tokens: what serving it charges its principal (`fair_queue`)."""
        self.model_id = model_id
        self.run_id = run_id
        self.long = long
        self.exclude = exclude
        self.protocol = protocol
        self.kind = (model_id, long, exclude, protocol)
        """What it asks for: the same kind gets the same answer until the pool changes."""
        self.enqueued_at = enqueued_at
        self.timeout_s = timeout_s
        self.event = trio.Event()
        self.scope = trio.CancelScope(deadline=enqueued_at + timeout_s)
        self.lease: Lease | None = None
        self.error: AdmissionError | None = None

    def retime(self, timeout_s: float) -> None:
        """Apply a refreshed queue timeout, counted from when the request arrived."""
        self.timeout_s = timeout_s
        self.scope.deadline = self.enqueued_at + timeout_s

    def could_use(self, state: ProviderState) -> bool:
        return state.id not in self.exclude and not (
            self.long and state.config.long_context_slots == 0
        )
