"""Probes on demand: before callers are refused because every provider of their model is
down, the providers' Nodes look again (design §4 item 11).

A Node probes each provider every `health_interval_s`; between two probes a runtime that
came back (a restarted `llama-server`) stays `unavailable` to the Edge, and every caller
gets an instant 503 it need not have got. So when the scheduler refuses a request with
`NoProvider`, `Revival.acquire` asks the Nodes of the model's `unavailable` providers to
probe them now (`wire.Probe`), waits for the answer (a `status` naming them in `probed`),
and asks the scheduler once more: a provider the probe found back takes the request.

Rules:
1. Only a provider that could serve but for its health is probed: its Node connected
   and speaking `FEATURE_PROBE`, the provider enabled, `unavailable`, not already tried
   by this request. A model with none is refused at once, as before.
2. Per provider, at most one probe in flight (callers that come while it is share its
   answer) and at most one asked per `PROBE_GAP_S`: a caller that comes within that of
   the last answer waits for the gap to pass and asks then (or shares the probe another
   caller asked meanwhile). A storm of refused callers costs a runtime one probe a
   second, no more; the Node enforces the same bound on its side.
3. A caller waits for the answers at most `PROBE_WAIT_S` (the gap included), and less
   when a provider is back or every probe has answered. A probe that no answer came back for within
   `PROBE_LOST_S` (its Node went away) no longer holds later callers: they ask again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Final

import trio

from iop_edge.core.routing.affinity import Affinity
from iop_edge.runtime.nodes.hub import NodeHub
from iop_edge.runtime.nodes.session import SessionClosed
from iop_edge.runtime.runs.admission_errors import NoProvider
from iop_edge.runtime.runs.lease import Lease
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas import wire
from schemas.protocols import CallerProtocol

__all__ = ["PROBE_GAP_S", "PROBE_LOST_S", "PROBE_WAIT_S", "Revival"]

log = logging.getLogger(__name__)

#: The least time between two probes of one provider that callers cause (Rule 2).
PROBE_GAP_S: Final = 1.0
#: The longest a caller waits for the probes' answers (Rule 3): a Node's probe is
#: bounded by its probe timeout, 5 s unless configured otherwise.
PROBE_WAIT_S: Final = 5.0
#: A probe unanswered this long was lost with its Node (Rule 3).
PROBE_LOST_S: Final = 30.0


@dataclass(slots=True)
class _Asked:
    """One provider's last probe on demand."""

    at: float
    answered: trio.Event


class Revival:
    """Probes on demand for one Edge's dispatcher (module docstring)."""

    def __init__(
        self, scheduler: Scheduler, hub: NodeHub, *, clock: Callable[[], float] = trio.current_time
    ) -> None:
        self._scheduler = scheduler
        self._hub = hub
        self._clock = clock
        """Trio's time, or a clock that keeps it (the gap is slept with `sleep_until`)."""
        self._asked: dict[str, _Asked] = {}
        self._heard = trio.Event()
        """Set (and replaced) whenever a Node answers a probe."""

    async def acquire(
        self,
        model_id: str,
        run_id: str,
        *,
        long: bool,
        exclude: frozenset[str],
        protocol: CallerProtocol,
        principal: str,
        work: int = 1,
        affinity: Affinity | None = None,
    ) -> Lease:
        """`Scheduler.acquire`, but a refusal because every provider is down is
        `NoProvider` only once a probe has confirmed it (Rules 1-3)."""
        admit = partial(
            self._scheduler.acquire,
            model_id,
            run_id,
            long=long,
            exclude=exclude,
            protocol=protocol,
            principal=principal,
            work=work,
            affinity=affinity,
        )
        try:
            return await admit()
        except NoProvider:
            if not await self._revive(model_id, exclude):
                raise
        return await admit()

    def answered(self, provider_ids: Iterable[str]) -> None:
        """A Node's `status` answered the probes of `provider_ids` (after the scheduler
        took the status in)."""
        heard = False
        for provider_id in provider_ids:
            asked = self._asked.get(provider_id)
            if asked is not None and not asked.answered.is_set():
                asked.answered.set()
                heard = True
        if heard:
            self._heard.set()
            self._heard = trio.Event()

    async def _revive(self, model_id: str, exclude: frozenset[str]) -> bool:
        """Probe the model's down providers; True once one of them is back (Rule 3)."""
        down = self._down(model_id, exclude)
        if not down:
            return False
        with trio.move_on_after(PROBE_WAIT_S):
            answers = [await self._ask(provider_id, node_id) for provider_id, node_id in down]
            waiting = [answered for answered in answers if answered is not None]
            if not waiting:
                return False
            while not self._back(down) and not all(event.is_set() for event in waiting):
                await self._heard.wait()
        back = self._back(down)
        log.info("model %s: %s on demand", model_id, "a provider is back" if back else "still down")
        return back

    def _down(self, model_id: str, exclude: frozenset[str]) -> list[tuple[str, str]]:
        """The model's providers that could serve but for their health, with their Node
        (Rule 1)."""
        model = self._scheduler.snapshot.models.get(model_id)
        if model is None:
            return []
        down = []
        for provider_id in model.providers:
            record = self._scheduler.catalog_provider(provider_id)
            if (
                record is not None
                and provider_id not in exclude
                and record.connected
                and record.enabled
                and record.health == "unavailable"
            ):
                down.append((provider_id, record.node_id))
        return down

    def _back(self, down: list[tuple[str, str]]) -> bool:
        return any(
            self._scheduler.catalog_health(provider_id) not in (None, "unavailable")
            for provider_id, _ in down
        )

    async def _ask(self, provider_id: str, node_id: str) -> trio.Event | None:
        """The event its probe's answer sets: the one in flight, or a new probe's, asked
        `PROBE_GAP_S` after the last one at the earliest; None when the Node cannot be
        asked (Rule 2)."""
        asked = self._asked.get(provider_id)
        while asked is not None:
            now = self._clock()
            if not asked.answered.is_set() and now - asked.at < PROBE_LOST_S:
                return asked.answered
            if now - asked.at >= PROBE_GAP_S:
                break
            await trio.sleep_until(asked.at + PROBE_GAP_S)
            asked = self._asked.get(provider_id)  # another caller may have asked since
        now = self._clock()
        session = self._hub.session(node_id)
        if session is None or wire.FEATURE_PROBE not in session.features:
            return None
        try:
            session.send_nowait(wire.Probe(providers=[provider_id]))
        except (trio.WouldBlock, SessionClosed):
            return None
        self._asked[provider_id] = fresh = _Asked(at=now, answered=trio.Event())
        return fresh.answered
