"""The provider pool's decisions, as pure functions (design §4 steps 2-4 and 9).

Nothing here awaits, reads a clock, or mutates anything: the scheduler describes each
provider as an immutable `ProviderView`, asks `decide()`, and acts on the answer. That
keeps every dispatch rule in one place, readable top to bottom, and testable without
Trio. The rules:

Rule 1. Everything a decision depends on is in the views and arguments. A view is a
        snapshot of one provider at one instant; the caller builds fresh views for every
        decision, so a decision can never act on stale counts.

Rule 2. Eligibility is "could this provider take this run at all right now?". A
        provider is *ineligible* when it was already tried for this run (`exclude`),
        is not configured, its node is disconnected, it is disabled, its health is
        `unavailable` or `draining`, it is cooling down after failures, it rests
        because its upstream asked (Rule 9), the run is
        long and it has `long_context_slots: 0`, or its Node refused the config that
        gave it the run's model (`applied` is `refused`, see Rule 3). When every
        provider of a model is ineligible the answer is `Refuse`, with a reason naming
        why: waiting could not help.

Rule 3. An eligible provider is *admissible* when it has a free slot for this run:
        health `available` or `busy` (busy is alive: generating, too busy to answer a
        probe); a provider whose node just connected is `unknown` until its first
        status: eligible, so requests wait for it, but not admissible;
        `in_flight < capacity` (a capacity shrunk below `in_flight` admits nothing
        until enough runs finish); for a long run with `long_context_slots` set, also
        `long_in_flight < long_context_slots` (null: a long run needs only a regular
        slot); and its breaker is `closed`, or `half_open` (exactly one trial run).
        A provider `probing` (its trial run is still in flight) is eligible but not
        admissible. So is one whose Node has not yet applied the refresh that gave it
        the run's model (`applied` is `pending`, design §5 step 6): a run sent to it
        meanwhile would reach a Node that does not serve the model yet, so the run
        goes to another provider or waits for the Node's ack.

Rule 4. Rank admissible providers: first those that speak the run's caller protocol
        natively (`native`, design §14), then by lowest load ratio `in_flight / capacity`
        (exact fractions: 1/3 beats 2/3, 1/3 ties 2/6), then lower `priority`, then
        round-robin: the provider next after the model's last pick in the model's
        provider order. Among providers that are equally native, one with a higher load
        ratio is never preferred, and N identical idle providers take turns instead of
        one absorbing all the traffic.

        Native first means a Messages or Responses run goes to a provider that would
        have to translate it (on its Node, to chat completions) only when no native
        provider has a free slot now, even if the translating one is idler or has the
        better priority: the runtime's own implementation of the protocol is the more
        faithful one. The run does not wait for a native slot either: a translating
        provider with a free slot takes it at once. Every provider speaks chat, so for
        chat, completions and embeddings the first key is always equal and the ranking
        is load ratio, priority, round-robin.

Rule 5. The answer is `Grant(best)` when any provider is admissible, else `Wait` when
        any is eligible (busy, or health not yet known), else `Refuse(reason)`.

Rule 6. Passive health is a small circuit breaker per provider (`PassiveHealth`):
        `closed` counts consecutive failures and opens at the threshold; `open` keeps
        the provider out of the pool until `cooldown_until` (outcomes that arrive
        meanwhile come from runs admitted earlier and change nothing); then
        `half_open` admits one trial run, `probing` while it runs. A success closes
        the breaker and resets the count; a failure after the cooldown reopens it.
        Capacity signals (upstream 429/503) never reach the breaker (Rule 9).

Rule 7. Affinity (`core.routing.affinity`): a run may come with a `Preference`, its rendezvous
        key and the providers holding the longest known prefix of its prompt
        (`core.routing.prefix_index`). Of the admissible providers as native as Rule 4's first
        choice and of its priority, those *within the bound* are the ones whose load
        ratio exceeds the first choice's (the lowest) by at most `bound` (the model's
        `routing.load_bound`, default 0.25: on four-slot providers, one run ahead of the
        idlest). The run goes to, in order: the holder of its longest prefix within the
        bound (several, as for a prompt many sent: the first of them by Rule 4, so they
        take turns), else the provider the key ranks first among those within the bound
        (rendezvous, `core.routing.affinity` Rule 4). So a conversation stays where its prefix
        is cached, on every Edge alike, while that provider is not much busier than
        another with a free slot; beyond the bound it moves to its next choice,
        consistently (and its prefix with it: it stays there). A key shared by many
        runs (one hot prompt) spreads: its first choice is never more than the bound
        ahead of the idlest provider, and once several hold the prompt, they share it
        as Rule 4 shares runs without a preference. A run never waits for its
        preferred provider: only admissible providers are considered, and with none the
        answer is Rule 5's. Affinity chooses among equals (replicas of one priority): it
        never sends a run to a worse priority or to a translating provider that Rule 4
        would not have chosen; round-robin does not apply to a run with a preference.

Rule 8. Models on demand (design §18.4): a view says whether its runtime `holds` the
        run's model (`held`: loaded, loading, or a load this Edge placed there is on its
        way; a runtime that reports no states holds everything), must load it first
        (`cold`), or `failed` to load it (ineligible, Rule 2). A run goes to a holder
        when one is admissible (Rules 4 and 7 choose among the holders). When holders
        exist but none has a free slot, the run waits for one (Rule 5) rather than
        loading a second copy, unless the model's waiting runs already outnumber the
        holders' slots (demand needs another copy). When no provider holds the model,
        one load is placed: among the admissible cold providers that can take a load
        (`can_load`: room for one more model, an idle one to unload, or the model asleep
        there), native first, then one where the model sleeps (a wake-up takes seconds,
        a cold load up to minutes), then one with room (nothing is unloaded for it), then
        the model's rendezvous choice (`core.routing.affinity`: every Edge places the same model
        on the same provider), then Rule 4.

Rule 9. An upstream's 429 or 503 says it is busy, not broken: the run fails over, and
        the provider stays in the pool. When the answer says for how long (`Retry-After`
        in seconds or as a date, or OpenAI's `retry-after-ms`), the provider *rests*
        that long, at most `MAX_REST_S` (60 s; `runtime.runs.provider_state`): it is
        ineligible (Rule 2, `rate_limited`), so no run is sent where the upstream would
        refuse it, and a refusal of the model tells the caller when the first provider
        is back (`Retry-After`). A rest only ever grows, and ends by itself: no failure
        is counted, and the first run after it is an ordinary one.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import msgspec

from iop_edge.core.routing.affinity import GOLDEN as _GOLDEN
from iop_edge.core.routing.affinity import MASK as _MASK
from iop_edge.core.routing.affinity import SEEDS, placement_key, provider_seed, rendezvous_score
from schemas.catalog import Unapplied
from schemas.wire import Health

Breaker = Literal["closed", "open", "half_open", "probing"]
Holding = Literal["held", "cold", "failed"]
Applied = Literal["applied"] | Unapplied
"""Whether a provider's Node runs the config that gives it a model (Rules 2, 3)."""

Ineligible = Literal[
    "excluded",
    "not_configured",
    "disconnected",
    "disabled",
    "unavailable",
    "draining",
    "cooling_down",
    "rate_limited",
    "no_long_runs",
    "model_failed",
    "not_applied",
]

#: Short per-provider explanations, used when the providers of a model fail differently.
INELIGIBLE_DETAIL: dict[Ineligible, str] = {
    "excluded": "already tried",
    "not_configured": "not configured",
    "disconnected": "node disconnected",
    "disabled": "disabled",
    "unavailable": "unavailable",
    "draining": "draining",
    "cooling_down": "cooling down after failures",
    "rate_limited": "rate-limited by its upstream",
    "no_long_runs": "takes no long-context runs",
    "model_failed": "its runtime failed to load the model",
    "not_applied": "its node refused the config that gives it the model",
}

#: One sentence per cause, used when every provider of a model fails the same way.
_ALL_INELIGIBLE: dict[Ineligible, str] = {
    "excluded": "every provider of model {model!r} was already tried",
    "not_configured": "no provider of model {model!r} is configured",
    "disconnected": "no provider of model {model!r} is connected",
    "disabled": "every provider of model {model!r} is disabled",
    "unavailable": "no provider of model {model!r} is available",
    "draining": "every provider of model {model!r} is draining",
    "cooling_down": "every provider of model {model!r} is cooling down after failures",
    "rate_limited": "every provider of model {model!r} is rate-limited by its upstream",
    "no_long_runs": "no provider of model {model!r} accepts long-context runs",
    "model_failed": "every provider of model {model!r} failed to load it",
    "not_applied": "every provider of model {model!r} is on a node that refused the config "
    "that gives it the model",
}


@dataclass(frozen=True, slots=True)
class PassiveHealth:
    """One provider's failure record: consecutive failures and the cooldown end, if any."""

    consecutive_failures: int = 0
    cooldown_until: float | None = None

    def breaker(self, *, now: float, probing: bool) -> Breaker:
        """The breaker state at `now`; `probing` says whether a trial run is in flight."""
        if self.cooldown_until is None:
            return "closed"
        if now < self.cooldown_until:
            return "open"
        return "probing" if probing else "half_open"

    def after_failure(self, *, now: float, threshold: int, seconds: float) -> PassiveHealth:
        """Record one health failure (never a capacity signal)."""
        if self.cooldown_until is not None:
            if now < self.cooldown_until:
                return self  # open: a late outcome of a run admitted before the cooldown
            # the trial (or any run) failed after the cooldown: out again
            return PassiveHealth(
                consecutive_failures=self.consecutive_failures + 1,
                cooldown_until=now + seconds,
            )
        failures = self.consecutive_failures + 1
        if failures >= threshold:
            return PassiveHealth(consecutive_failures=failures, cooldown_until=now + seconds)
        return PassiveHealth(consecutive_failures=failures)

    def after_success(self, *, now: float) -> PassiveHealth:
        """Record one success: closes the breaker, unless it is still cooling down."""
        if self.cooldown_until is not None and now < self.cooldown_until:
            return self
        return _HEALTHY


_HEALTHY = PassiveHealth()

#: Health states that take runs (Rule 3).
_ADMITTING: frozenset[Health] = frozenset({"available", "busy"})


class ProviderView(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One provider at one instant, as far as dispatch cares.

    A decision looks at every provider of the model, thousands in a fleet, each seen
    afresh: a Struct is made several times faster than a frozen dataclass, and it is
    never tracked by the cycle collector."""

    id: str
    capacity: int
    in_flight: int = 0
    priority: int = 100
    long_context_slots: int | None = None
    long_in_flight: int = 0
    connected: bool = True
    enabled: bool = True
    health: Health = "available"
    breaker: Breaker = "closed"
    cooldown_remaining_s: float | None = None
    """Seconds until the cooldown ends, while the breaker is `open`."""
    rest_remaining_s: float | None = None
    """Seconds until the rest its upstream asked for ends, while it rests (Rule 9)."""
    native: bool = True
    """It speaks the run's caller protocol natively (Rule 4); False: its Node translates."""
    holds: Holding = "held"
    """Whether its runtime holds the run's model (Rule 8)."""
    can_load: bool = True
    """It could load the model for this run: room for one more, or an idle one to unload
    (Rule 8; only read when it does not hold it)."""
    room: bool = True
    """It holds fewer models than it can: a load there unloads nothing (Rule 8)."""
    asleep: bool = False
    """Its runtime holds the model asleep (vLLM's sleep mode): a wake-up, not a cold load
    (Rule 8)."""
    applied: Applied = "applied"
    """Whether its Node runs the config that gives it the run's model: `pending` while
    the refresh that added the model to it awaits the Node's ack (Rule 3), `refused`
    when the Node refused that config (Rule 2)."""


def ineligibility(view: ProviderView, *, long: bool) -> Ineligible | None:
    """Why `view` cannot take this run at all right now (Rule 2), or None if it could."""
    if not view.connected:
        return "disconnected"
    if not view.enabled:
        return "disabled"
    if view.health == "unavailable":
        return "unavailable"
    if view.health == "draining":
        return "draining"
    if view.breaker == "open":
        return "cooling_down"
    if view.rest_remaining_s is not None:
        return "rate_limited"
    if long and view.long_context_slots == 0:
        return "no_long_runs"
    if view.holds == "failed":
        return "model_failed"
    if view.applied == "refused":
        return "not_applied"
    return None


def is_admissible(view: ProviderView, *, long: bool) -> bool:
    """Whether an eligible `view` has a free slot for this run now (Rule 3)."""
    if view.health not in _ADMITTING or view.breaker not in ("closed", "half_open"):
        return False
    if view.applied != "applied":
        return False
    if view.in_flight >= view.capacity:
        return False
    if long and view.long_context_slots is not None:
        return view.long_in_flight < view.long_context_slots
    return True


_RankKey = tuple[bool, int, int, int, str]


def _rank_key(
    candidates: Sequence[ProviderView], *, rotation: Sequence[str], last: str | None
) -> Callable[[ProviderView], _RankKey]:
    """The sort key of Rule 4 for this set of `candidates`: smaller ranks first.

    `rotation` is the model's provider order and `last` the provider the model picked
    last time; among otherwise equal providers the one following `last` wins. Load
    ratios are compared exactly but without building a `Fraction` per candidate per
    decision: each `in_flight / capacity` is scaled to the candidates' common
    denominator (the lcm of their capacities), which turns it into an integer numerator,
    so 1/3 and 2/6 tie and 1/3 beats 2/3 with plain integer comparison.
    """
    position = {provider_id: index for index, provider_id in enumerate(rotation)}
    size = max(len(rotation), 1)
    start = position[last] + 1 if last in position else 0
    denominator = math.lcm(*(view.capacity for view in candidates if view.capacity > 0))

    def key(view: ProviderView) -> _RankKey:
        # a provider without capacity counts as full (load ratio 1); only admissible
        # providers are ranked, so this only keeps the key total
        load = view.in_flight * (denominator // view.capacity) if view.capacity > 0 else denominator
        turn = (position[view.id] - start) % size if view.id in position else size
        return (not view.native, load, view.priority, turn, view.id)

    return key


@dataclass(frozen=True, slots=True)
class Preference:
    """Where a run would rather go (Rule 7)."""

    key: int
    """Its rendezvous key (`core.routing.affinity`)."""
    holders: frozenset[str] = frozenset()
    """The providers holding the longest known prefix of its prompt."""
    bound: float = 0.25
    """How much busier than the idlest admissible provider a preferred one may be."""


#: Load ratios within this of each other are equal (they are fractions of small ints).
_RATIO_EPSILON: Final = 1e-9


def preferred(
    candidates: Sequence[ProviderView],
    preference: Preference,
    *,
    rotation: Sequence[str],
    last: str | None,
) -> ProviderView:
    """Rule 7's choice among admissible `candidates` (not empty).

    No sort, and a second pass only when no provider holding the prompt is within the
    bound: the first pass finds Rule 4's first choice's nativeness, load ratio and
    priority (all the bound needs) and the holders among the candidates, and the
    rendezvous score is worked out inline (`core.routing.affinity.rendezvous_score`). So
    an agent's turn over thousands of providers costs a third of Rule 4's ranking, and a
    conversation's first turn no more than it."""
    native = any(view.native for view in candidates)
    key, holders = preference.key, preference.holders
    lowest = math.inf
    priority = 0
    held: list[ProviderView] = []
    for view in candidates:
        if view.native != native:
            continue
        if holders and view.id in holders:
            held.append(view)
        ratio = view.in_flight / view.capacity
        if ratio < lowest - _RATIO_EPSILON:
            lowest, priority = ratio, view.priority
        elif ratio <= lowest + _RATIO_EPSILON and view.priority < priority:
            priority = view.priority
    limit = lowest + preference.bound + _RATIO_EPSILON
    holding = [
        view
        for view in held
        if view.priority == priority and view.in_flight / view.capacity <= limit
    ]
    if len(holding) == 1:
        return holding[0]  # the conversation's provider
    if holding:
        # a prompt many sent, which every one of them holds: Rule 4 among them
        return min(holding, key=_rank_key(holding, rotation=rotation, last=last))
    best = candidates[0]
    best_score = -1
    seeds = SEEDS
    for view in candidates:
        if (
            view.native != native
            or view.priority != priority
            or view.in_flight / view.capacity > limit
        ):
            continue
        seed = seeds.get(view.id)
        if seed is None:
            seed = provider_seed(view.id)
        mixed = ((key ^ seed) * _GOLDEN) & _MASK
        score = mixed ^ (mixed >> 31)
        if score > best_score:
            best, best_score = view, score
    return best


@dataclass(frozen=True, slots=True)
class Grant:
    """Take a slot on `provider` now."""

    provider: ProviderView


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing is free, but these providers could serve the run once something changes."""

    eligible: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Refuse:
    """No provider could serve the run now; waiting would not help."""

    reason: str
    retry_after_s: float | None = None
    """When the refusal is (partly) due to cooldowns or rests: seconds until the first
    one ends."""


Decision = Grant | Wait | Refuse


def decide(
    model_id: str,
    rotation: Sequence[str],
    views: Mapping[str, ProviderView],
    *,
    long: bool,
    exclude: frozenset[str] = frozenset(),
    last: str | None = None,
    preference: Preference | None = None,
    waiting: int = 0,
    placing: bool = False,
) -> Decision:
    """Where a run of `model_id` goes now (Rule 5).

    `rotation` lists the model's provider ids in config order; `views` describes them
    (an id without a view is not configured); `exclude` names providers already tried
    for this run; `last` is the model's previous pick, for round-robin; `preference`
    where the run would rather go (Rule 7); `waiting`: the model's runs already waiting
    for a slot, and `placing`: some view may not hold the model (Rule 8; False spares a
    decision over a model whose runtimes report no states that pass).
    """
    if not rotation:
        return Refuse(f"model {model_id!r} has no providers")
    eligible: list[ProviderView] = []
    causes: dict[str, Ineligible] = {}
    for provider_id in rotation:
        view = views.get(provider_id)
        cause: Ineligible | None
        if provider_id in exclude:
            cause = "excluded"
        elif view is None:
            cause = "not_configured"
        else:
            cause = ineligibility(view, long=long)
        if cause is not None:
            causes[provider_id] = cause
        elif view is not None:
            eligible.append(view)
    admissible = [view for view in eligible if is_admissible(view, long=long)]
    if placing and any(view.holds == "cold" for view in admissible):  # Rule 8
        holders = [view for view in admissible if view.holds == "held"]
        if holders:
            admissible = holders
        elif _a_holder_will_free(eligible, waiting):
            return Wait(tuple(view.id for view in eligible))
        else:
            loadable = [view for view in admissible if view.can_load]
            if loadable:
                return Grant(_placed(model_id, loadable, rotation=rotation, last=last))
            admissible = []
    if admissible:
        if preference is not None:
            return Grant(preferred(admissible, preference, rotation=rotation, last=last))
        return Grant(min(admissible, key=_rank_key(admissible, rotation=rotation, last=last)))
    if eligible:
        return Wait(tuple(view.id for view in eligible))
    return Refuse(
        _refusal_reason(model_id, causes),
        retry_after_s=_first_return(views, causes),
    )


def _a_holder_will_free(eligible: Sequence[ProviderView], waiting: int) -> bool:
    """Rule 8: a provider holding the model will take the run once a slot frees, and the
    model's demand does not need a second copy yet."""
    slots = sum(view.capacity for view in eligible if view.holds == "held")
    return slots > 0 and waiting < slots


def _placed(
    model_id: str,
    loadable: Sequence[ProviderView],
    *,
    rotation: Sequence[str],
    last: str | None,
) -> ProviderView:
    """Rule 8: where the model is loaded, the same on every Edge."""
    key = placement_key(model_id)
    rank = _rank_key(loadable, rotation=rotation, last=last)

    def order(view: ProviderView) -> tuple[bool, bool, bool, int, _RankKey]:
        score = rendezvous_score(key, provider_seed(view.id))
        return (not view.native, not view.asleep, not view.room, -score, rank(view))

    return min(loadable, key=order)


def _refusal_reason(model_id: str, causes: Mapping[str, Ineligible]) -> str:
    distinct = set(causes.values())
    if len(distinct) == 1:
        return _ALL_INELIGIBLE[distinct.pop()].format(model=model_id)
    # Counted, not named: a caller reads this, and provider ids are the operator's.
    counts = Counter(causes.values())
    detail = "; ".join(f"{counts[cause]} {INELIGIBLE_DETAIL[cause]}" for cause in sorted(counts))
    return f"no provider of model {model_id!r} can serve this request now ({detail})"


def _first_return(
    views: Mapping[str, ProviderView], causes: Mapping[str, Ineligible]
) -> float | None:
    """Seconds until the first provider out for a while (cooling down, Rule 6, or
    resting, Rule 9) is back."""
    remaining: list[float] = []
    for provider_id, cause in causes.items():
        view = views.get(provider_id)
        if view is None:
            continue
        if cause == "cooling_down" and view.cooldown_remaining_s is not None:
            remaining.append(view.cooldown_remaining_s)
        elif cause == "rate_limited" and view.rest_remaining_s is not None:
            remaining.append(view.rest_remaining_s)
    return min(remaining) if remaining else None
