"""Pins and preloads (design §18.4, `core.lifecycle` Rules 2-5): the Edge's side of the
models' lifecycle policy. (Idle unloads are the Nodes', `iop_node.idle_keeper`.)

The keeper runs for the Edge's life. At every change it acts on (a Node's report, a
Node connected or gone, a refresh: `look`; a run's start or end is none) it works out
which copies are pinned (the config's `keep_loaded` and the operator's pins) and which
preloads are still owed, and acts with the existing `model_command`s
(`commands.ModelCommands`, audited with source `lifecycle`):

1. Every pinned copy is told to its Node once per connection (`pin`, to a Node naming
   `FEATURE_PINS`: the Node keeps it from idle unloads, and loads it); a copy its runtime
   does not hold is loaded again (`pin`, or `load` to an older Node). A copy that stops
   being pinned is told `unpin`. A `keep_loaded` copy whose provider cannot hold it now
   (down, or its Node away) stays pinned there, and is sent nothing, for `MOVE_AFTER_S`
   before the pin moves to another provider (`core.lifecycle` Rule 3).
2. A preload owed loads its copies (`load`), each provider once (`core.lifecycle` Rule 5).
3. The scheduler hears the pins (`Scheduler.pin_models`): placement never unloads a
   pinned copy to make room (`core.routing.holdings` Rule 4).
4. One command per copy at a time; a failed one is tried again after `RETRY_S` (a model
   a runtime cannot load is not asked for in a loop), or at once when its Node has
   connected again since (the failure may have been the session's end, not the
   runtime's). A preload's failed load is owed again: another provider is asked at once
   if one can take it, the same one after `RETRY_S`.

The operator's `pin` and `unpin` (`POST /models/pin|unpin`) come here too (a pin whose
load failed is not kept: the answer says why); `load` and `unload` go on to
`ModelCommands`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final, NamedTuple

import trio

from iop_edge.core.lifecycle import Copy, choose_copies, copy_of, wanted_copies
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.models.commands import CommandSession, ModelCommands
from schemas import wire
from schemas.catalog import (
    CatalogProvider,
    ModelCommandAction,
    ModelCommandReport,
    ModelCommandRequest,
)
from schemas.config import ModelLifecycle

__all__ = ["MOVE_AFTER_S", "RETRY_S", "ModelKeeper"]

log = logging.getLogger(__name__)

#: How long after a failed pin or preload load the copy is asked for again.
RETRY_S: Final = 30.0
#: How long a `keep_loaded` copy keeps its provider after the provider stops being able
#: to hold it (`core.lifecycle` Rule 3) before the pin moves to another.
MOVE_AFTER_S: Final = 30.0
#: The audit log's `source` of the keeper's own commands.
SOURCE: Final = "lifecycle"

Pair = tuple[str, str]
"""(provider id, served name)."""


class _Retry(NamedTuple):
    """When a copy whose command failed is asked again (Rule 4)."""

    at: float
    session: CommandSession | None
    """The Node's session the command failed on: a new one may be asked at once."""


class ModelKeeper:
    """Keeps the pinned copies loaded and makes the preloads (see the module rules)."""

    def __init__(
        self,
        *,
        snapshot: Callable[[], Snapshot],
        providers: Callable[[Sequence[str]], list[CatalogProvider]],
        session_of: Callable[[str], CommandSession | None],
        commands: ModelCommands,
        pin_models: Callable[[Mapping[str, frozenset[str]]], None],
    ) -> None:
        self._snapshot = snapshot
        self._providers = providers
        self._session_of = session_of
        self._commands = commands
        self._pin_models = pin_models
        self._operator: dict[tuple[str, str], None] = {}
        """(model id, provider id) the operator pinned, in order."""
        self._config_copies: dict[str, list[str]] = {}
        """A `keep_loaded` model's chosen providers (kept while they can, Rule 3)."""
        self._out_since: dict[tuple[str, str], float] = {}
        """(model id, provider) of a chosen copy that cannot be held now: since when."""
        self._preloads: dict[str, tuple[ModelLifecycle, set[str]]] = {}
        """A preloading model's lifecycle and the providers asked (Rule 5)."""
        self._busy: set[Pair] = set()
        self._retry_at: dict[Pair, _Retry] = {}
        self._told: dict[str, tuple[CommandSession, set[Pair]]] = {}
        """Per Node: the session told, and the pins it was told."""
        self._wake = trio.Event()
        self._managed_of: Snapshot | None = None
        self._managed: list[str] = []
        """The models of `_managed_of` with copies to keep or make (Rule 2)."""
        self._applied: dict[str, frozenset[str]] | None = None
        """The pins the scheduler was last told."""

    def look(self) -> None:
        """Something the keeper acts on changed: a Node connected or went away, a
        refresh, an operator's pin. (Runs starting and ending do not wake it.)"""
        self._wake.set()
        self._wake = trio.Event()

    def reported(self, provider_ids: Iterable[str]) -> None:
        """A Node reported on these providers: a look if one of them serves a model the
        keeper keeps (a lifecycle to keep, an operator's pin), or a snapshot it has not
        looked at yet. A fleet's statuses about everything else change nothing it does,
        and ten thousand Nodes acking a refresh would wake it for each."""
        if self._managed_of is not self._snapshot():
            self.look()
            return
        kept = {*self._managed, *(model_id for model_id, _ in self._operator)}
        if not kept:
            return
        models_of = self._managed_of.provider_models
        if any(m in kept for p in provider_ids for m in models_of.get(p, ())):
            self.look()

    # --- the operator ------------------------------------------------------------------

    async def command(
        self, action: ModelCommandAction, request: ModelCommandRequest, *, source: str
    ) -> ModelCommandReport:
        """An operator's `load`, `unload`, `pin` or `unpin`."""
        if action in ("load", "unload"):
            return await self._commands.run(action, request, source=source)
        snapshot = self._snapshot()
        model = snapshot.models.get(request.model)
        if model is None or (
            request.provider is not None and request.provider not in model.providers
        ):
            what = (
                f"no model {request.model!r}"
                if model is None
                else f"provider {request.provider!r} does not serve {request.model!r}"
            )
            return ModelCommandReport(
                action=action, model=request.model, outcome="unknown", error=what
            )
        served = model.providers
        if action == "unpin":
            pins = [
                (model.id, provider)
                for model_id, provider in self._operator
                if model_id == model.id and request.provider in (None, provider)
            ]
            if not pins:
                return ModelCommandReport(
                    action=action,
                    model=model.id,
                    outcome="no_provider",
                    error=f"{model.id!r} has no pin set by the operator"
                    + ("" if request.provider is None else f" on {request.provider!r}")
                    + " (a keep_loaded pin lasts while the config says so)",
                )
            for pin in pins:
                del self._operator[pin]
            self.look()
            return await self._send(
                snapshot, "unpin", model.id, [(p, served[p]) for _, p in pins], source
            )
        provider = request.provider
        if provider is None:
            records = self._providers(list(served))
            chosen = [p for m, p in self._operator if m == model.id]
            choice = choose_copies(
                model.id, [copy_of(r, served[r.id]) for r in records], 1, chosen=chosen
            )
            if not choice:
                return ModelCommandReport(
                    action=action,
                    model=model.id,
                    outcome="no_provider",
                    error=f"no provider can load {model.id!r} now",
                )
            provider = choice[0]
        pin = (model.id, provider)
        self._operator[pin] = None
        self.look()
        report = await self._send(snapshot, "pin", model.id, [(provider, served[provider])], source)
        if report.outcome != "done":  # the operator hears why, and may try again
            self._operator.pop(pin, None)
            self.look()
        return report

    async def _send(
        self,
        snapshot: Snapshot,
        action: ModelCommandAction,
        model_id: str,
        pairs: list[Pair],
        source: str,
    ) -> ModelCommandReport:
        """Send `action` to `pairs` (one command per copy at a time, Rule 4)."""
        sessions = {p: self._session_of(snapshot.provider_node.get(p, "")) for p, _ in pairs}
        self._busy.update(pairs)
        try:
            report = await self._commands.send(snapshot, action, model_id, pairs, source=source)
        finally:
            self._busy.difference_update(pairs)
        now = trio.current_time()
        for result in report.results:
            pair = (result.provider, result.served_model)
            told = self._told_of(snapshot.provider_node.get(result.provider))
            if told is not None and action in ("pin", "unpin"):
                (told.add if action == "pin" else told.discard)(pair)
            if result.ok:
                self._retry_at.pop(pair, None)
            else:
                self._retry_at[pair] = _Retry(now + RETRY_S, sessions.get(result.provider))
                if action == "load" and model_id in self._preloads:  # owed again (Rule 4)
                    self._preloads[model_id][1].discard(result.provider)
                log.warning(
                    "%s of %s on %s failed: %s", action, model_id, result.provider, result.error
                )
        self.look()
        return report

    def _told_of(self, node_id: str | None) -> set[Pair] | None:
        """The pins the Node's current session was told (forgotten with the session)."""
        if node_id is None:
            return None
        session = self._session_of(node_id)
        if session is None:
            self._told.pop(node_id, None)
            return None
        entry = self._told.get(node_id)
        if entry is None or entry[0] is not session:
            entry = self._told[node_id] = (session, set())
        return entry[1]

    # --- the keeper --------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the pins and make the preloads for as long as the Edge runs."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                wake = self._wake  # taken before the look: a change during it wakes us
                retry = self._reconcile(nursery)
                with trio.move_on_at(retry):
                    await wake.wait()

    def _reconcile(self, nursery: trio.Nursery) -> float:
        """One look at the pool (Rules 1-4); returns when to look again at the latest (a
        retry's time, or a waiting copy's `MOVE_AFTER_S`).

        It runs at every Node report, so it looks only at the models with a lifecycle to
        keep (worked out once per snapshot) and the operator's pins."""
        snapshot = self._snapshot()
        now = trio.current_time()
        if snapshot is not self._managed_of:
            self._managed_of = snapshot
            self._managed = [m.id for m in snapshot.models.values() if wanted_copies(m.lifecycle)]
            self._operator = {pin: None for pin in self._operator if pin[0] in snapshot.models}
            self._applied = None  # a refresh may have added providers: tell the scheduler
        operator: dict[str, list[str]] = {}
        for model_id, provider in self._operator:
            if provider in snapshot.models[model_id].providers:
                operator.setdefault(model_id, []).append(provider)
        pins: dict[str, set[str]] = {}
        to_pin: list[tuple[str, Pair, bool]] = []  # (model, pair, held)
        config_copies: dict[str, list[str]] = {}
        out_since: dict[tuple[str, str], float] = {}
        look_at = math.inf
        for model_id in dict.fromkeys([*self._managed, *operator]):
            model = snapshot.models[model_id]
            lifecycle = model.lifecycle
            served = model.providers
            copies = {
                record.id: copy_of(record, served[record.id])
                for record in self._providers(list(served))
            }
            pinned = list(operator.get(model_id, ()))
            waiting: set[str] = set()
            if lifecycle.keep_loaded:
                before = self._config_copies.get(model_id, ())
                for provider in before:  # Rule 3: a chosen copy out of reach waits a while
                    copy = copies.get(provider)
                    if provider not in served or (copy and (copy.holds or copy.can_take)):
                        continue
                    since = self._out_since.get((model_id, provider), now)
                    if now < since + MOVE_AFTER_S:
                        out_since[model_id, provider] = since
                        waiting.add(provider)
                        look_at = min(look_at, since + MOVE_AFTER_S)
                chosen = config_copies[model_id] = choose_copies(
                    model_id,
                    list(copies.values()),
                    wanted_copies(lifecycle),
                    chosen=before,
                    waiting=waiting,
                )
                pinned += [p for p in chosen if p not in pinned]
            elif lifecycle.preload:
                self._preload(snapshot, model_id, lifecycle, copies, nursery)
            for provider in pinned:
                copy = copies.get(provider)
                if copy is not None and (copy.holds or copy.can_take):
                    pins.setdefault(provider, set()).add(served[provider])
                    to_pin.append((model_id, (provider, served[provider]), copy.holds))
                elif provider in waiting:  # still pinned there; nothing is sent to it
                    pins.setdefault(provider, set()).add(served[provider])
        self._config_copies = config_copies
        self._out_since = out_since
        self._preloads = {
            m: entry
            for m, entry in self._preloads.items()
            if m in snapshot.models and snapshot.models[m].lifecycle.preload
        }
        applied = {p: frozenset(names) for p, names in pins.items()}
        if applied != self._applied:  # Rule 3, told only when it changed
            self._applied = applied
            self._pin_models(applied)
        for model_id, pair, held in to_pin:
            node_id = snapshot.provider_node.get(pair[0], "")
            told = self._told_of(node_id)
            session = self._session_of(node_id)
            speaks_pins = session is not None and wire.FEATURE_PINS in session.features
            owed = not held or (speaks_pins and told is not None and pair not in told)
            if owed and pair not in self._busy and self._may_ask(snapshot, pair, now):
                self._busy.add(pair)  # `_send` takes it back
                nursery.start_soon(self._send, snapshot, "pin", model_id, [pair], SOURCE)
        self._unpin_stale(snapshot, pins, nursery)
        # a retry whose time came was made above, or is owed no more (Rule 4)
        self._retry_at = {
            pair: retry
            for pair, retry in self._retry_at.items()
            if not self._may_ask(snapshot, pair, now)
        }
        return min([look_at, *(retry.at for retry in self._retry_at.values())])

    def _may_ask(self, snapshot: Snapshot, pair: Pair, now: float) -> bool:
        """Rule 4: no failed command on `pair` waits for its retry (its time came, or
        its Node is connected on a session newer than the one it failed on)."""
        retry = self._retry_at.get(pair)
        if retry is None or retry.at <= now:
            return True
        session = self._session_of(snapshot.provider_node.get(pair[0], ""))
        return session is not None and session is not retry.session

    def _preload(
        self,
        snapshot: Snapshot,
        model_id: str,
        lifecycle: ModelLifecycle,
        copies: Mapping[str, Copy],
        nursery: trio.Nursery,
    ) -> None:
        """Rule 2: load the copies a preload still owes."""
        entry = self._preloads.get(model_id)
        if entry is None or entry[0] != lifecycle:
            entry = self._preloads[model_id] = (lifecycle, set())
        asked = entry[1]
        served = snapshot.models[model_id].providers
        done = asked | {p for p, copy in copies.items() if copy.holds}
        if len(done) >= lifecycle.preload:
            return
        now = trio.current_time()
        candidates = [  # a provider whose load failed waits for its retry (Rule 4)
            copy
            for provider, copy in copies.items()
            if provider in done or self._may_ask(snapshot, (provider, served[provider]), now)
        ]
        chosen = choose_copies(model_id, candidates, lifecycle.preload, chosen=sorted(done))
        for provider in [p for p in chosen if p not in done][: lifecycle.preload - len(done)]:
            asked.add(provider)
            pair = (provider, served[provider])
            self._busy.add(pair)
            nursery.start_soon(self._send, snapshot, "load", model_id, [pair], SOURCE)

    def _unpin_stale(
        self, snapshot: Snapshot, pins: Mapping[str, set[str]], nursery: trio.Nursery
    ) -> None:
        """Rule 1: a copy no longer pinned is told `unpin` (the operator's unpins are
        sent by `command`)."""
        for node_id, (session, told) in list(self._told.items()):
            if self._session_of(node_id) is not session:
                del self._told[node_id]
                continue
            for pair in [pair for pair in told if pair[1] not in pins.get(pair[0], ())]:
                if pair in self._busy:
                    continue
                model_id = next(
                    (
                        m
                        for m in snapshot.provider_models.get(pair[0], ())
                        if snapshot.models[m].providers.get(pair[0]) == pair[1]
                    ),
                    pair[1],
                )
                self._busy.add(pair)
                nursery.start_soon(self._send, snapshot, "unpin", model_id, [pair], SOURCE)
