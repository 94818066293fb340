"""A run's hold on a provider slot: what `Scheduler.acquire()` hands out (design §4).

A lease is its own module because everything downstream of admission holds one (dispatch,
revival, the metering of a run) and needs only this: which provider and Node, the served
name to use upstream, and `release()`, which gives the slot back exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import trio

from iop_edge.core.principals import ANONYMOUS_PRINCIPAL


class Lease:
    """One run's hold on a provider slot (and a long slot, for a long run).

    Release it exactly once, whatever happens to the run; `release()` is idempotent,
    so cleanup paths may call it freely. `with lease:` releases on exit.
    """

    __slots__ = (
        "_limiters",
        "_on_release",
        "_released",
        "long",
        "node_id",
        "principal",
        "provider_id",
        "queued_s",
        "run_id",
        "target",
    )

    def __init__(
        self,
        *,
        run_id: str,
        provider_id: str,
        node_id: str,
        target: str,
        long: bool,
        queued_s: float,
        limiters: tuple[trio.CapacityLimiter, ...],
        on_release: Callable[[Lease], None],
        principal: str = ANONYMOUS_PRINCIPAL,
    ) -> None:
        self.run_id = run_id
        self.principal = principal
        """Who the run is for (counted against its `max_concurrent`)."""
        self.provider_id = provider_id
        self.node_id = node_id
        self.target = target
        """The served model name the run must use upstream (`models[M].providers[pid]`)."""
        self.long = long
        self.queued_s = queued_s
        """Seconds the request spent in the model's queue before this lease."""
        self._limiters = limiters
        self._on_release = on_release
        self._released = False

    def release(self) -> None:
        """Give the slot(s) back and wake waiters; later calls do nothing."""
        if self._released:
            return
        self._released = True
        for limiter in self._limiters:
            limiter.release_on_behalf_of(self)
        self._on_release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        kind = "long" if self.long else "regular"
        return f"<Lease {self.run_id!r} {kind} on {self.provider_id!r}>"
