"""Daily budgets reserved against a ledger that replicas share (design §15, limits Rule 7).

`PrincipalLimiter` asks `SharedBudgets.reserve` once per admitted request of a principal
with a `tokens_per_day`, after its own checks and before the request queues; `settle`
hands back what the run reserved with what it used when it ends. The store
(`metering.usage_ledger.budgets_postgres`) keeps the counters; this module runs it from Trio:

1. A reservation is one short transaction in a worker thread (at most `CONNECTIONS` at
   once, each on its own connection): the request waits for it, nothing else does.
2. Settlements never wait: they are added up per (principal, day) and written by one
   task (`run`) as soon as it is free, in one transaction. A write that fails is kept
   and tried again after `RETRY_S`; what is kept is bounded by the principals with a
   budget, not by the requests.
3. A store that cannot be reached does not refuse anyone: the request is admitted on
   this Edge's own view of the budget (limits Rule 3), its ticket not reserved in the
   store (nothing to settle there), and the log says so once until the store answers
   again.
4. Every `RELEASE_S`, the holds of replicas that are gone are given back (a killed
   Edge's reservations do not spend a budget for the rest of the day).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Final, Protocol

import trio

__all__ = ["CONNECTIONS", "BudgetStore", "SharedBudgets"]

log = logging.getLogger(__name__)

#: Reservations in flight at once (worker threads, each with its connection).
CONNECTIONS: Final = 4
#: How long a failed settlement waits before it is written again.
RETRY_S: Final = 1.0
#: How often the holds of replicas that are gone are given back.
RELEASE_S: Final = 10.0
#: How long the last settlements may take to be written when the Edge stops.
FINAL_FLUSH_S: Final = 2.0


class BudgetStore(Protocol):
    """Counters shared by replicas (`budgets_postgres.PostgresBudgets`); blocking."""

    def reserve(self, principal: str, day: int, tokens: int, budget: int) -> bool: ...

    def settle(self, settlements: Mapping[tuple[str, int], tuple[int, int]]) -> None: ...

    def release_stale(self, now: float) -> None: ...

    def close(self) -> None: ...


class SharedBudgets:
    """Reservations in a `BudgetStore` (see the module rules)."""

    def __init__(self, store: BudgetStore, *, wall: Callable[[], float] = time.time) -> None:
        self._store = store
        self._wall = wall
        self._threads = trio.CapacityLimiter(CONNECTIONS)
        self._pending: dict[tuple[str, int], tuple[int, int]] = {}
        """Per (principal, day): reserved tokens to release, used tokens to add (Rule 2)."""
        self._wake = trio.Event()
        self._failing = False

    async def reserve(self, principal: str, day: int, tokens: int, budget: int) -> bool | None:
        """True: reserved; False: the budget is spent across the replicas; None: the store
        cannot be reached, nothing was reserved (Rule 3)."""
        try:
            reserved = await trio.to_thread.run_sync(
                self._store.reserve, principal, day, tokens, budget, limiter=self._threads
            )
        except Exception as exc:  # an unreachable ledger must not refuse callers
            self._unavailable(exc)
            return None
        self._available()
        return reserved

    def settle(self, principal: str, day: int, released: int, used: int) -> None:
        """A run reserved in the store ended (Rule 2); never waits."""
        key = (principal, day)
        was_released, was_used = self._pending.get(key, (0, 0))
        self._pending[key] = (was_released + released, was_used + used)
        self._wake.set()

    @property
    def pending(self) -> int:
        """Settlements not written yet (principal-days)."""
        return len(self._pending)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write settlements and give back the holds of replicas that are gone (Rules 2,
        4). Owned by the Edge's nursery; the last settlements are written when it is
        cancelled (bounded by `FINAL_FLUSH_S`), and the store is closed."""
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._release_stale)
                while True:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    if not await self._flush():
                        await trio.sleep(RETRY_S)
                        self._wake.set()
        finally:
            with trio.move_on_after(FINAL_FLUSH_S, shield=True):
                await self._flush(abandon_on_cancel=True)
            with trio.move_on_after(FINAL_FLUSH_S, shield=True):
                await trio.to_thread.run_sync(self._store.close, abandon_on_cancel=True)

    async def _flush(self, *, abandon_on_cancel: bool = False) -> bool:
        batch, self._pending = self._pending, {}
        if not batch:
            return True
        try:
            await trio.to_thread.run_sync(
                self._store.settle,
                batch,
                limiter=self._threads,
                abandon_on_cancel=abandon_on_cancel,
            )
        except Exception as exc:
            self._put_back(batch)
            self._unavailable(exc)
            return False
        except BaseException:
            # Cut before its thread ran (waiting for one), so the final flush writes it.
            if not abandon_on_cancel:
                self._put_back(batch)
            raise
        self._available()
        return True

    def _put_back(self, batch: dict[tuple[str, int], tuple[int, int]]) -> None:
        """Settlements not written wait with those that came since."""
        for key, (released, used) in batch.items():
            was_released, was_used = self._pending.get(key, (0, 0))
            self._pending[key] = (was_released + released, was_used + used)

    async def _release_stale(self) -> None:
        while True:
            try:
                await trio.to_thread.run_sync(
                    self._store.release_stale, self._wall(), limiter=self._threads
                )
            except Exception as exc:
                self._unavailable(exc)
            await trio.sleep(RELEASE_S)

    def _unavailable(self, exc: Exception) -> None:
        if not self._failing:
            self._failing = True
            log.error(
                "principal budgets: the shared ledger does not answer (%s); budgets count "
                "this Edge's view until it does",
                exc,
            )

    def _available(self) -> None:
        if self._failing:
            self._failing = False
            log.info("principal budgets: the shared ledger answers again")
