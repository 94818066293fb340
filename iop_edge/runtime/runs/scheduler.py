"""Admission for the Edge: provider slots, per-model FIFO queues, cooldowns (design §4).

`Scheduler.acquire()` turns "run model M" into a `Lease` on one provider slot, or an
`AdmissionError` the HTTP layer maps to a status code (`admission_errors`).

Its parts live beside it: what it keeps of each provider (`provider_state`), a request
parked in a queue (`waiter`), a run's hold on a slot (`lease`), and its read side, the
statistics and the catalog's records (`observation`).

How the pieces fit:

- Every decision ("which provider, or wait, or refuse?") is made by the pure functions
  in `iop_edge.core.routing.pool` over fresh `ProviderView`s; this module only keeps the mutable
  state those views are built from and acts on the answers.
- Each provider's run slots are a `trio.CapacityLimiter(capacity)`, plus a second one
  for long-context runs (`long_context_slots`, or unlimited when that is null, so long
  runs are always counted). Provider state is keyed by provider id and outlives
  snapshots: a refresh resizes `total_tokens` in place and never replaces a limiter,
  or concurrency could briefly double.
- Slots are taken at selection, synchronously, with `acquire_on_behalf_of_nowait`,
  and given back by `Lease.release()` exactly once. The borrower is the `Lease` object
  itself rather than the run id, so the accounting never depends on run ids being
  unique. The limiters' own blocking `acquire` is never used: a request may be served
  by any of several providers, so waiting happens in our per-model FIFO queue.
- A queued request is woken by whoever changes something it might be waiting for (a
  lease released, a node (dis)connected, a status received, a cooldown ending, a
  refresh): that code walks the queues of every model that could use what changed, in
  arrival order across those models, and settles every waiter it can, granting a slot
  or failing it with `NoProvider`. Arrival order is global (one sequence number for all
  waiters) because models share providers: walking the queues one model after another
  would let a busy model that happens to be listed first starve the others. Each queue
  is FIFO, so the walk is a merge of the queues by sequence number. A waiter that
  cannot use what was freed (a long run, say) stays put without blocking those behind
  it. Nothing polls; `Scheduler.run()` sleeps until the earliest cooldown ends.
- Within one model's queue, requests are offered slots in fair order between
  principals (`fair_queue`: per-principal FIFO lanes, weighted fair queueing, design
  §15); across the models of one walk, the request each queue offers next is taken in
  arrival order. With one principal that is the plain arrival order. A principal at its
  `max_concurrent` (split between the Edge replicas) is passed over, never granted a
  slot: its requests wait, and its own lease releases wake the queues it waits in.
- A model a refresh adds to a provider does not go there until the provider's Node has
  applied the refresh (`unapplied_models`); the Node's ack wakes the queue.
- Several Edges may share a Node (design §13). A provider's load is what this Edge holds
  (its limiter) plus what the Node reports the *other* Edges hold (`provider_load`);
  decisions see the sum, and a report that frees slots wakes the queue like a release.
  A `busy` answer from the Node (another Edge won the race for the last slot) marks the
  provider full in this Edge's eyes (`provider_saturated`) until the Node's next load
  report, which follows every `busy`, says how full it really is.
- A run asks in a caller protocol (chat, Anthropic Messages, OpenAI Responses: design
  §14). A provider speaks it natively when its Node's last `status` says so, or, before
  any such report (or from a Node that does not say), when its config does
  (`adapter.protocols`, or the type's default). The pool ranks native providers first
  (`core.routing.pool` Rule 4); the others take the run, translated on their Node, only when no
  native one has a free slot. Waiters asking in different protocols get different
  answers, so the queue walk keys its answers by protocol too.
- A run may come with its `Affinity` (`core.routing.affinity`: its session, chain or prompt
  key, and its prompt's blocks). Where the model's `routing.affinity` is on, the
  decision prefers the provider holding the longest prefix of the prompt that this Edge
  sent (`core.routing.prefix_index`), else the key's rendezvous choice, within the model's
  `routing.load_bound` (`core.routing.pool` Rule 7); every grant records where the prompt went.
  A prompt sent again unchanged without a session id (one many send: a health check,
  a benchmark, a shared prompt) is no conversation going on: it is ranked by load alone,
  so it spreads over the providers, each of which then holds it.
  Affinity only chooses among providers with a free slot, so a queue walk's `Wait` and
  `Refuse` answers hold for every waiter of a kind, whatever its affinity; a grant is
  decided for the waiter it goes to.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial

import trio

from iop_edge.core.principals import ANONYMOUS_PRINCIPAL, concurrency_share
from iop_edge.core.routing.affinity import Affinity
from iop_edge.core.routing.cache_share import CacheShares
from iop_edge.core.routing.placement import choose_load, holders_of
from iop_edge.core.routing.pool import (
    Decision,
    Grant,
    Preference,
    Refuse,
    Wait,
    decide,
)
from iop_edge.core.routing.prefix_index import PrefixIndex
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.runs.admission_errors import (
    RETRY_AFTER_BUSY_S,
    RETRY_AFTER_LOADING_S,
    AdmissionError,
    ConcurrencyLimited,
    ModelLoading,
    NoProvider,
    QueueFull,
    QueueTimeout,
    UnknownModel,
)
from iop_edge.runtime.runs.fair_queue import FairQueue, FairWalk
from iop_edge.runtime.runs.lease import Lease
from iop_edge.runtime.runs.observation import PoolObservation
from iop_edge.runtime.runs.provider_state import MAX_REST_S, Lookups, ProviderState
from iop_edge.runtime.runs.unapplied_models import UnappliedModels
from iop_edge.runtime.runs.waiter import Waiter
from schemas.config import LifecycleFlag, RoutingPolicy
from schemas.protocols import CallerProtocol
from schemas.wire import Health, ModelState

logger = logging.getLogger(__name__)


class Scheduler(PoolObservation):
    """The Edge's provider pool: admission, per-model queues and passive health.

    `clock` is the time source for queue waits and cooldowns. It must share Trio's time
    base whenever anything awaits (the default); tests of the synchronous surface may
    pass a fake.
    """

    def __init__(
        self, snapshot: Snapshot, *, clock: Callable[[], float] = trio.current_time
    ) -> None:
        self._snapshot = snapshot
        self._clock = clock
        self._states: dict[str, ProviderState] = {}
        self._pinned: frozenset[str] = frozenset()  # the providers last given pins
        self._reporting: dict[str, None] | None = None  # the models `reports` serves
        self._lookups = Lookups(snapshot)
        self._held: dict[str, list[ProviderState]] = {}
        """Per node id: the states of its providers removed from config, kept until their
        last lease is released (`_states_on`)."""
        self._connected: set[str] = set()
        self._unapplied = UnappliedModels()
        self._queues: dict[str, FairQueue[Waiter]] = {}
        self._stating: set[str] = set()
        """Providers whose runtime reports its models' load states (pool Rule 8)."""
        self._arrivals = itertools.count()
        self._running: dict[str, int] = {}
        """Per principal: the leases it holds (this Edge's runs in flight)."""
        self._replicas = 1
        """Live Edge replicas sharing the principals' concurrency limits."""
        self._last_pick: dict[str, str] = {}
        self._models_of: dict[str, tuple[str, ...]] = {}
        self._rivals: dict[str, tuple[str, ...]] = {}
        """Per model: the models sharing a provider with it, itself included."""
        self._reschedule = trio.Event()
        self._changed = trio.lowlevel.ParkingLot()  # `wait_changed`'s observers
        self._prefixes = PrefixIndex()
        """Where this Edge sent which prompts (`core.routing.prefix_index`)."""
        self.cache_shares = CacheShares()
        """Each provider's recent cached share of its prompts (the catalog's
        `cached_share`), fed by metering."""
        self.apply_snapshot(snapshot)

    # -- service ------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Wake waiters when cooldowns and rests end. Owned by the Edge's nursery; runs
        forever.

        Sleeps until the earliest end; anything that starts a cooldown or a rest sets
        `_reschedule` so the sleep is recomputed.
        """
        task_status.started()
        while True:
            self._reschedule = wake = trio.Event()
            expiry = self._next_cooldown_end()
            with trio.move_on_at(math.inf if expiry is None else expiry):
                await wake.wait()
            if expiry is not None and self._clock() >= expiry:
                self._serve(list(self._queues))

    async def wait_changed(self) -> None:
        """Return at the next change of slots, queues, health, cooldowns or config.

        For observers (catalog watchers, tests) that would otherwise have to poll.
        """
        await self._changed.park()

    def pin_models(self, pins: Mapping[str, frozenset[str]]) -> None:
        """The served names pinned on each provider (`core.lifecycle` Rule 4): only those
        pinned before or now are touched (a fleet's swap tells the pins, mostly none)."""
        told, self._pinned = self._pinned, frozenset(pins)
        for state in filter(None, map(self._states.get, told | self._pinned)):
            state.holdings.pinned = pins.get(state.id, frozenset())

    def _notify_changed(self) -> None:
        if self._changed:  # wake the observers waiting now (nothing to do for none)
            self._changed.unpark_all()

    def _next_cooldown_end(self) -> float | None:
        """The first end of a cooldown or a rest (pool Rules 6, 9) still to come."""
        now = self._clock()
        ends = [
            until
            for state in self._states.values()
            for until in (state.passive.cooldown_until, state.rest_until)
            if until is not None and until > now
        ]
        return min(ends, default=None)

    # -- inputs from config and nodes --------------------------------------------

    def apply_snapshot(self, snapshot: Snapshot) -> None:
        """Adopt a new snapshot: synchronous, so no request sees a half-applied pool.

        The snapshot brings its lookups worked out (`Snapshot.build`, off the event loop
        in a refresh), and the provider states read their config and Node through them
        (`Lookups`): what is left here is proportional to the providers added and
        removed, found by comparing the ids (a fleet's swap must not hold the loop)."""
        self._unapplied.swapped(self._snapshot, snapshot)
        self._snapshot = snapshot
        states, providers = self._states, snapshot.providers
        same_ids = states.keys() == providers.keys()  # a refresh of their configs
        for provider_id in () if same_ids else states.keys() - providers.keys():
            state = states[provider_id]
            if state.removed:
                continue  # held since an earlier snapshot
            state.retire()
            self.cache_shares.forget(provider_id)
            if state.idle:
                del states[provider_id]
            else:  # until its last lease is released
                self._held.setdefault(state.node_id, []).append(state)
        self._lookups.adopt(snapshot)  # every other state's config and Node, at once
        back = [state for held in self._held.values() for state in held if state.id in providers]
        for state in back:  # back in config while its last leases ran
            self._let_go(state)
            state.removed = False
        for provider_id in () if same_ids else providers.keys() - states.keys():
            states[provider_id] = ProviderState(provider_id, self._lookups)
        self._models_of = snapshot.provider_models
        self._rivals = snapshot.rivals
        for model_id in [m for m in self._queues if m not in snapshot.models]:
            for waiter in self._queues.pop(model_id):
                self._settle(waiter, error=UnknownModel(f"model {model_id!r} was removed"))
        for model_id in [m for m in self._last_pick if m not in snapshot.models]:
            del self._last_pick[model_id]
        for model_id, queue in self._queues.items():
            timeout_s = snapshot.queue_policy(model_id).queue_timeout_s
            for waiter in queue:
                waiter.retime(timeout_s)
        self._reschedule.set()
        self._serve(list(self._queues))

    def config_applied(self, node_id: str, revision: int) -> None:
        """The node runs config `revision` (it acked its push, or was welcomed with it)."""
        self._serve(self._models_serving(self._unapplied.applied(node_id, revision)))

    def config_refused(self, node_id: str, revision: int) -> None:
        """The node refused config `revision`: the models it added are not its providers'."""
        self._serve(self._models_serving(self._unapplied.refused(node_id, revision)))

    def node_connected(self, node_id: str) -> None:
        """The node's providers are `unknown` until its first status says otherwise."""
        self._connected.add(node_id)
        self._set_node_health(node_id, "unknown")

    def node_disconnected(self, node_id: str) -> None:
        """The node's providers become unavailable; waiters nobody else can serve fail."""
        self._connected.discard(node_id)
        self._set_node_health(node_id, "unavailable")

    def _states_on(self, node_id: str) -> list[ProviderState]:
        """The states of the node's providers, removed ones with leases out too. Worked
        out when asked (a node connects or goes): kept up to date, a fleet's swap would
        rebuild it for every node."""
        states = self._states
        on = [states[provider_id] for provider_id in self._snapshot.node_providers.get(node_id, ())]
        return on + self._held.get(node_id, [])

    def _let_go(self, state: ProviderState) -> None:
        """`state` is no longer held (released, or back in config)."""
        held = self._held.get(state.node_id)
        if held is not None and state in held:
            held.remove(state)
            if not held:
                del self._held[state.node_id]

    def _set_node_health(self, node_id: str, health: Health) -> None:
        affected = self._states_on(node_id)
        for state in affected:
            state.health = health
            state.forget_others()
            state.detail = None
            state.discovered = []
            state.discovered_lifecycle = None
            state.holdings.forget()
            self._stating.discard(state.id)
            state.reported_protocols = None
        self._serve(self._models_serving(state.id for state in affected))

    def provider_status(
        self,
        provider_id: str,
        health: Health,
        models: list[str],
        lifecycle: Sequence[LifecycleFlag] | None = None,
        detail: str | None = None,
        *,
        protocols: Sequence[CallerProtocol] | None = None,
        model_states: Sequence[ModelState] | None = None,
        max_loaded: int | None = None,
    ) -> None:
        """A provider's health (and the Node's reason for it), discovered models,
        lifecycle operations, native protocols and models' load states, from its node's
        `status` message (`protocols` None: the Node does not say; the config's count)."""
        state = self._states.get(provider_id)
        if state is None or state.removed:
            return
        state.health = health
        state.detail = detail
        if state.discovered != models:  # the same again: the old lists, long frozen, stay
            state.discovered = list(models)
        state.discovered_lifecycle = None if lifecycle is None else list(lifecycle)
        state.reported_protocols = None if protocols is None else frozenset(protocols)
        state.holdings.report(model_states, max_loaded)
        if model_states is None:
            self._stating.discard(provider_id)
        else:
            self._stating.add(provider_id)
        self._serve(self._models_serving((provider_id,)))

    def provider_load(self, provider_id: str, in_flight: int, long_in_flight: int) -> None:
        """What the other Edges hold on the provider, from its node's `load` report: at
        most its capacity (more would fill it no more, and would show as nonsense)."""
        state = self._states.get(provider_id)
        if state is None:
            return
        capacity = state.config.capacity
        others, others_long = (min(max(n, 0), capacity) for n in (in_flight, long_in_flight))
        freed = others < state.others or others_long < state.others_long or state.saturated
        state.others, state.others_long = others, others_long
        state.saturated = False
        if freed:
            self._serve(self._models_serving((provider_id,)))
        else:
            self._notify_changed()

    def speaks(self, provider_id: str, protocol: CallerProtocol) -> bool:
        """Whether the provider speaks `protocol` natively, as far as the Edge knows now
        (an unknown provider: no)."""
        state = self._states.get(provider_id)
        return state is not None and state.speaks(protocol)

    def provider_saturated(self, provider_id: str) -> None:
        """The node answered `busy`: count the provider full until its next load report."""
        state = self._states.get(provider_id)
        if state is not None and not state.saturated:
            state.saturated = True
            self._notify_changed()

    # -- passive health ------------------------------------------------------------

    def record_success(self, provider_id: str) -> None:
        """A run on the provider succeeded: resets its failure count, ends a trial."""
        state = self._states.get(provider_id)
        if state is None:
            return
        after = state.passive.after_success(now=self._clock())
        if after != state.passive:
            if state.passive.cooldown_until is not None:
                logger.info("provider %s is back in the pool after a successful trial", state.id)
            state.passive = after
            state.trial = None
            self._serve(self._models_serving((provider_id,)))

    def record_failure(self, provider_id: str) -> None:
        """A health failure (node lost, connect error, upstream 5xx); may start a cooldown."""
        state = self._states.get(provider_id)
        if state is None:
            return
        policy = self._snapshot.config.dispatch.cooldown
        before = state.passive
        state.passive = before.after_failure(
            now=self._clock(), threshold=policy.failures, seconds=policy.seconds
        )
        if state.passive.cooldown_until != before.cooldown_until:
            logger.warning(
                "provider %s cooling down for %gs after %d consecutive failures",
                state.id,
                policy.seconds,
                state.passive.consecutive_failures,
            )
            state.trial = None  # a trial's verdict is in
            self._reschedule.set()
            self._serve(self._models_serving((provider_id,)))

    def record_capacity_signal(self, provider_id: str, retry_after_s: float | None = None) -> None:
        """An upstream 429/503: the provider is busy, not broken. The breaker is left
        alone (no failure, no success either): the run fails over with `exclude`, and a
        trial run that ends so is inconclusive (its release lets another be the trial).
        With `retry_after_s`, its upstream's Retry-After, it rests (pool Rule 9)."""
        state = self._states.get(provider_id)
        if state is None or retry_after_s is None or not retry_after_s > 0:
            return
        if state.rest(retry_after_s, self._clock()):
            rest = min(retry_after_s, MAX_REST_S)
            logger.info("provider %s rests %gs: its upstream said Retry-After", state.id, rest)
            self._reschedule.set()  # the rest's end wakes the queues
            self._notify_changed()

    # -- admission -----------------------------------------------------------------

    async def acquire(
        self,
        model_id: str,
        run_id: str,
        *,
        long: bool,
        exclude: frozenset[str] = frozenset(),
        protocol: CallerProtocol = "chat",
        principal: str = ANONYMOUS_PRINCIPAL,
        work: int = 1,
        affinity: Affinity | None = None,
    ) -> Lease:
        """A slot on the best provider of `model_id`, waiting in its queue if busy, or
        while `principal` holds its `max_concurrent` runs; `work` is the run's estimated
        tokens, its share of the queue's fairness (`core.routing.run_work`).

        `exclude` names providers already tried for this run (failover); `protocol` is
        the caller's, which native providers speak (ranked first); `affinity` where the
        run would rather go (`core.routing.pool` Rule 7). Raises an
        `AdmissionError` subclass when the request is not admitted. Cancellation while
        waiting leaves nothing behind. The caller owns the returned lease and releases
        it in every path (`with lease:`). A slot granted at once is granted without a
        yield to the scheduler (a cancelled caller still stops at the start): the run
        starts in the same step, and waits for its first event right after.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if model_id not in self._snapshot.models:
            raise UnknownModel(f"model {model_id!r} is not in the catalog")
        queue = self._queues.setdefault(model_id, FairQueue())
        rivals = self._rivals[model_id]
        if any(self._queues.get(rival) for rival in rivals):
            # Earlier arrivals choose first, on this model or any model sharing a
            # provider with it: no barging. Only time (a cooldown ending before `run()`
            # noticed) can have freed a slot they have not been offered yet.
            self._serve(rivals)
        match self._decide(
            model_id, long=long, exclude=exclude, protocol=protocol, affinity=affinity
        ):
            case Grant(provider=view) if self._may_run(principal):
                lease = self._grant(
                    model_id,
                    view.id,
                    run_id,
                    long=long,
                    queued_s=0.0,
                    principal=principal,
                    affinity=affinity,
                )
                self._notify_changed()
                return lease  # no yield: the caller's next await (the run's start) yields
            case Refuse(reason=reason, retry_after_s=retry_after_s):
                raise NoProvider(reason, retry_after_s=retry_after_s)
            case Grant() | Wait():
                pass  # no slot, or none for this principal now: it waits
        policy = self._snapshot.queue_policy(model_id)
        if len(queue) >= policy.max_queue:
            raise QueueFull(
                f"the queue of model {model_id!r} is full ({policy.max_queue} waiting)",
                retry_after_s=RETRY_AFTER_BUSY_S,
            )
        # A model being loaded: its runs wait for the load too (design §18.4)
        load_s = self._load_wait_s(model_id)
        waiter = Waiter(
            seq=next(self._arrivals),
            model_id=model_id,
            run_id=run_id,
            long=long,
            exclude=exclude,
            enqueued_at=self._clock(),
            timeout_s=policy.queue_timeout_s + load_s,
            protocol=protocol,
            principal=principal,
            work=work,
            affinity=affinity,
        )
        queue.append(waiter)
        self._notify_changed()
        with waiter.scope:
            try:
                await waiter.event.wait()
            except BaseException:
                # Cancelled (our deadline or the caller's), possibly after a slot was
                # already granted to us in the same instant: give everything back.
                self._abandon(waiter)
                raise
        if waiter.scope.cancelled_caught:
            if not self._may_run(principal):
                raise ConcurrencyLimited(
                    f"{principal!r} already has its max_concurrent runs in flight; this "
                    f"request waited {waiter.timeout_s:g}s for one of them to end",
                    retry_after_s=RETRY_AFTER_BUSY_S,
                )
            if load_s and not self._reported_loaded(model_id):
                raise ModelLoading(
                    f"model {model_id!r} is still loading: no slot came free within "
                    f"{waiter.timeout_s:g}s (the queue's wait and the load's); retry",
                    retry_after_s=RETRY_AFTER_LOADING_S,
                )
            why = self._unloadable(model_id)
            raise QueueTimeout(
                f"no slot for model {model_id!r} came free within {waiter.timeout_s:g}s"
                + ("" if why is None else f"; no provider holds it or could load it: {why}"),
                retry_after_s=RETRY_AFTER_BUSY_S,
            )
        if waiter.error is not None:
            raise waiter.error
        assert waiter.lease is not None, "a waiter is woken with a lease or an error"
        return waiter.lease

    def _load_wait_s(self, model_id: str) -> float:
        """How much longer a run of `model_id` may wait in its queue because a runtime is
        loading the model: the longest `load_timeout_s` of such providers (0: none is)."""
        served = self._snapshot.models[model_id].providers
        if self._stating.isdisjoint(served):
            return 0.0
        now = self._clock()
        loading = [
            state.config.adapter.load_timeout_s
            for provider_id in self._stating.intersection(served)
            if (state := self._states.get(provider_id)) is not None
            and state.holdings.loading(served[provider_id], now)
        ]
        return max(loading, default=0.0)

    def _unloadable(self, model_id: str) -> str | None:
        """Why no runtime of `model_id` could load it, when none holds it (each provider's
        reason: `placement.choose_load`, its pinned models among them), or None: what a
        queue timeout names, since waiting did not help."""
        served = self._snapshot.models[model_id].providers
        if self._stating.isdisjoint(served):  # no runtime reports its models: no loads
            return None
        records = [(record, served[record.id]) for record in self.catalog_providers(served)]
        if holders_of(records):
            return None
        return choose_load(records).reason

    def _reported_loaded(self, model_id: str) -> bool:
        """Whether some runtime's last report says `model_id` is loaded."""
        served = self._snapshot.models[model_id].providers
        return any(
            (state := self._states.get(provider_id)) is not None
            and state.holdings.reported_loaded(served[provider_id])
            for provider_id in self._stating.intersection(served)
        )

    def _decide(
        self,
        model_id: str,
        *,
        long: bool,
        exclude: frozenset[str],
        protocol: CallerProtocol = "chat",
        affinity: Affinity | None = None,
    ) -> Decision:
        model = self._snapshot.models[model_id]
        rotation = tuple(model.providers)
        served = model.providers
        now = self._clock()
        state_of = self._states.get
        connected = self._connected
        unapplied = self._unapplied or None  # mostly empty: nothing to ask per provider
        views = {
            provider_id: state.view(
                config,
                now,
                protocol,
                served=(name := served[provider_id]),
                connected=node_id in connected,
                applied="applied"
                if unapplied is None
                else unapplied.state(node_id, provider_id, name),
            )
            for provider_id, config, node_id in self._snapshot.rotations[model_id]
            if (state := state_of(provider_id)) is not None and not state.removed
        }
        return decide(
            model_id,
            rotation,
            views,
            long=long,
            exclude=exclude,
            last=self._last_pick.get(model_id),
            preference=self._preference(affinity, model.routing, now),
            waiting=len(self._queues.get(model_id) or ()),
            placing=not self._stating.isdisjoint(served),
        )

    def _preference(
        self, affinity: Affinity | None, routing: RoutingPolicy, now: float
    ) -> Preference | None:
        """Where a run with `affinity` would rather go (`core.routing.pool` Rule 7), or None when
        it has none or its model routes by load alone."""
        if affinity is None or not routing.affinity:
            return None
        back, holders = self._prefixes.lookup(affinity.blocks, now)
        if back == 0 and affinity.source != "session":
            return None  # the very prompt again, no conversation going on: Rule 4 spreads it
        return Preference(key=affinity.key, holders=holders, bound=routing.load_bound)

    def _grant(
        self,
        model_id: str,
        provider_id: str,
        run_id: str,
        *,
        long: bool,
        queued_s: float,
        principal: str,
        affinity: Affinity | None = None,
    ) -> Lease:
        """Take the slot(s) `decide()` found free: synchronous, so nobody can interleave.
        The prompt of a run with `affinity` is recorded as sent to the provider."""
        state = self._states[provider_id]
        state.fit_limiters()
        limiters = (state.limiter, state.long_limiter) if long else (state.limiter,)
        lease = Lease(
            run_id=run_id,
            provider_id=provider_id,
            node_id=state.node_id,
            target=self._snapshot.models[model_id].providers[provider_id],
            long=long,
            queued_s=queued_s,
            limiters=limiters,
            on_release=partial(self._released, state),
            principal=principal,
        )
        for limiter in limiters:
            limiter.acquire_on_behalf_of_nowait(lease)
        self._running[principal] = self._running.get(principal, 0) + 1
        now = self._clock()
        if state.passive.breaker(now=now, probing=state.trial is not None) == "half_open":
            state.trial = lease
        self._last_pick[model_id] = provider_id
        if affinity is not None and self._snapshot.models[model_id].routing.affinity:
            self._prefixes.record(provider_id, affinity.blocks, now)
        # a load it makes, or a model it keeps in use (Rule 8)
        load_timeout_s = state.config.adapter.load_timeout_s
        state.holdings.started(lease.target, now, load_timeout_s=load_timeout_s)
        return lease

    def _released(self, state: ProviderState, lease: Lease) -> None:
        if state.trial is lease:
            state.trial = None  # ended without a verdict: another run may be the trial
        state.holdings.ended(lease.target)
        if state.removed and state.idle and self._states.get(state.id) is state:
            del self._states[state.id]
            self._let_go(state)
        principal = lease.principal
        running = self._running[principal] - 1
        if running:
            self._running[principal] = running
        else:
            del self._running[principal]
        models = self._models_serving((state.id,))
        if self._snapshot.policies.of(principal).max_concurrent is not None:
            # Below its limit again: its requests may wait on models of other providers.
            models += [m for m, queue in self._queues.items() if queue.waiting(principal)]
        self._serve(models)

    def _abandon(self, waiter: Waiter) -> None:
        queue = self._queues.get(waiter.model_id)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self._notify_changed()
        if waiter.lease is not None:
            lease, waiter.lease = waiter.lease, None
            lease.release()

    def _settle(
        self, waiter: Waiter, *, lease: Lease | None = None, error: AdmissionError | None = None
    ) -> None:
        waiter.lease = lease
        waiter.error = error
        waiter.event.set()

    @contextmanager
    def reports(self) -> Iterator[None]:
        """A Node's status: its providers' reports, then the waiters served once."""
        self._reporting = models = dict[str, None]()
        try:
            yield
        finally:
            self._reporting = None
            if models:
                self._serve(models)

    def _serve(self, model_ids: Iterable[str]) -> None:
        """Offer what is free to the waiters of `model_ids`.

        Each model's queue offers its waiters in fair order between principals
        (`fair_queue`), passing over principals at their `max_concurrent`; across the
        models, the waiter each queue offers next is asked in arrival order, so a model
        listed first in the config gets no head start. Every waiter is settled if it can
        be: granted a slot, refused with `NoProvider`, or left in place (`Wait`) without
        holding up the waiters behind it. Waiters asking the same thing (same model, same
        `long`, same `exclude`, same protocol: their `kind`) get the same answer until a
        grant changes the pool, and a queue is left as soon as every kind waiting in it
        was told to wait, so a long queue costs a decision or two per kind of request,
        not one per waiter. Every caller has just changed something, so observers are
        notified here.
        """
        if self._reporting is not None:  # `reports`: served once, at its end
            self._reporting.update(dict.fromkeys(model_ids))
            return
        self._notify_changed()
        walks = [
            queue.walk(self._may_run)
            for model_id in dict.fromkeys(model_ids)
            if (queue := self._queues.get(model_id)) and model_id in self._snapshot.models
        ]
        try:
            self._walk(walks)
        finally:
            for walk in walks:
                walk.close()

    def _walk(self, walks: list[FairWalk[Waiter]]) -> None:
        """`_serve`'s walk over the queues of one set of models (see there)."""
        answers: dict[Hashable, Decision] = {}
        waiting: set[Hashable] = set()
        """The kinds answered `Wait` since the pool last changed: a queue whose every kind
        is among them has nothing more to grant in this walk."""
        while True:
            walk = waiter = None
            for candidate_walk in walks:
                if waiting and candidate_walk.queue.kinds() <= waiting:
                    continue
                candidate = candidate_walk.peek()
                if candidate is not None and (waiter is None or candidate.seq < waiter.seq):
                    walk, waiter = candidate_walk, candidate
            if walk is None or waiter is None:
                return
            model_id = waiter.model_id
            key = waiter.kind
            answer = answers.get(key)
            if answer is None:
                # a grant is decided for this waiter (its affinity); it is never reused
                answer = answers[key] = self._decide(
                    model_id,
                    long=waiter.long,
                    exclude=waiter.exclude,
                    protocol=waiter.protocol,
                    affinity=waiter.affinity,
                )
            match answer:
                case Grant(provider=view):
                    answers.clear()  # the pool changed
                    waiting.clear()
                    principal = waiter.principal
                    self._queues[model_id].served(waiter, self._weight(principal))
                    queued_s = self._clock() - waiter.enqueued_at
                    lease = self._grant(
                        model_id,
                        view.id,
                        waiter.run_id,
                        long=waiter.long,
                        queued_s=queued_s,
                        principal=principal,
                        affinity=waiter.affinity,
                    )
                    self._settle(waiter, lease=lease)
                case Refuse(reason=reason, retry_after_s=retry_after_s):
                    self._queues[model_id].remove(waiter)
                    self._settle(waiter, error=NoProvider(reason, retry_after_s=retry_after_s))
                case Wait():
                    waiting.add(key)
            walk.advance()

    def _may_run(self, principal: str) -> bool:
        """Whether `principal` is below its `max_concurrent` (this replica's share)."""
        limit = self._snapshot.policies.of(principal).max_concurrent
        if limit is None:
            return True
        return self._running.get(principal, 0) < concurrency_share(limit, self._replicas)

    def _weight(self, principal: str) -> float:
        return self._snapshot.policies.of(principal).weight

    def set_replicas(self, replicas: int) -> None:
        """The number of live Edge replicas changed: concurrency shares change with it."""
        replicas = max(1, replicas)
        if replicas != self._replicas:
            self._replicas = replicas
            self._serve(list(self._queues))

    def _models_serving(self, provider_ids: Iterable[str]) -> list[str]:
        models: dict[str, None] = {}
        for provider_id in provider_ids:
            models.update(dict.fromkeys(self._models_of.get(provider_id, ())))
        return list(models)
