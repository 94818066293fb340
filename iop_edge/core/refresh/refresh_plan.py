"""Whether and how to apply a refresh candidate (design §5 step 4), decided without effects.

Rules:

1. A candidate with no restart-required change applies whole.
2. Otherwise what would run is the *live subset*: the candidate with every
   restart-required change put back to its running value (`refresh_diff`, rule 6); the
   restart-required paths become `pending_restart`.
3. A restart-required path that is not already pending blocks the apply, unless the
   operator allowed restart-required changes: the operator must not be surprised by a
   change that silently waits for a restart. A path already pending does not block: the
   operator accepted that it waits, and whatever the file says at restart wins.
4. An apply that is not blocked can still be impossible: a live change that depends on a
   restart-required one (a model mapped to a provider being added) is an error.
5. The Nodes an apply pushes to are those whose own config (`Snapshot.node_config`)
   differs between the running snapshot and the new one.

`prepare_refresh` does all of a refresh that needs no I/O and no event loop - reading
the candidate, planning, building the new snapshot, choosing the Nodes to push - as one
call, so the Refresher runs it in a worker thread: for a fleet's config that is seconds
of work, and the event loop keeps serving callers meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from iop_edge.core.configuration.config import ParsedConfig
from iop_edge.core.gc_pause import gc_paused
from iop_edge.core.refresh.refresh_diff import (
    ConfigDiff,
    compare_configs,
    live_subset,
    live_subset_errors,
)
from iop_edge.core.snapshot import Snapshot
from schemas.config import EdgeConfig
from schemas.refresh import RefreshError
from schemas.runtime.give_way import give_way

__all__ = [
    "ApplyPlan",
    "PreparedRefresh",
    "error_order",
    "nodes_to_push",
    "plan_apply",
    "prepare_refresh",
]


@dataclass(frozen=True, slots=True)
class ApplyPlan:
    """What an apply of one candidate would do, decided without side effects."""

    diff: ConfigDiff
    """Running config -> candidate: what the operator changed."""
    effective: EdgeConfig
    """The config that would run: the candidate, minus restart-required changes."""
    pending_restart: tuple[str, ...]
    """Restart-required paths the effective config leaves at their running value."""
    errors: tuple[RefreshError, ...]
    """Why an apply would be refused (a conflict); empty when it can go ahead."""


def plan_apply(
    running: EdgeConfig,
    candidate: EdgeConfig,
    *,
    pending_restart: tuple[str, ...] = (),
    allow_restart_required: bool = False,
) -> ApplyPlan:
    """Decide an apply of `candidate` over `running` (rules 1-4)."""
    diff = compare_configs(running, candidate)
    restart_paths = diff.restart_required_paths
    if not restart_paths:
        return ApplyPlan(diff=diff, effective=candidate, pending_restart=(), errors=())
    effective = live_subset(running, candidate, diff)
    already_pending = set(pending_restart)
    blocking = (
        []
        if allow_restart_required
        else [path for path in restart_paths if path not in already_pending]
    )
    errors = [
        RefreshError(
            path=path,
            message="changing this needs a restart (`iop-edge restart`, no downtime); nothing "
            "was applied (with allow_restart_required the live changes apply now and this "
            "waits for the restart)",
        )
        for path in blocking
    ]
    if not blocking:
        errors = live_subset_errors(effective)
    return ApplyPlan(
        diff=diff,
        effective=effective,
        pending_restart=restart_paths,
        errors=tuple(sorted(errors, key=error_order)),
    )


def error_order(error: RefreshError) -> tuple[str, str]:
    """Reports list errors sorted by path, then message."""
    return (error.path, error.message)


def nodes_to_push(running: Snapshot, new: Snapshot) -> tuple[str, ...]:
    """The Nodes whose own config differs between the two snapshots (rule 5), sorted.

    An entry a refresh left alone is the very same Struct in both
    (`core.configuration.config_proof`),
    so comparing them costs next to nothing; what changed is compared field by field."""
    changed: list[str] = []
    for node_id, node in new.nodes.items():
        give_way()  # ten thousand Nodes (`schemas.runtime.give_way`)
        before = running.nodes.get(node_id)
        providers = before.providers if before is not None else []
        if node.providers is not providers and node.providers != providers:
            changed.append(node_id)
    return tuple(sorted(changed))


@dataclass(frozen=True, slots=True)
class PreparedRefresh:
    """A candidate read and decided against a running snapshot, ready to be applied."""

    parsed: ParsedConfig
    plan: ApplyPlan
    snapshot: Snapshot | None
    """What an apply swaps in (revision + 1); None for a dry run or a refused plan."""
    to_push: tuple[str, ...]
    """The Nodes an apply pushes to (rule 5)."""


def prepare_refresh(
    load: Callable[[], ParsedConfig],
    running: Snapshot,
    *,
    pending_restart: tuple[str, ...],
    allow_restart_required: bool,
    build: bool,
) -> PreparedRefresh:
    """Read the candidate (`load` raises `ConfigInvalid`), plan it over `running` and,
    with `build` (an apply) and nothing refusing it, build the snapshot to swap in.

    Pure and synchronous: no await, nothing shared is touched, so it may run in a worker
    thread while `running` keeps serving (snapshots are immutable). The collector is
    paused throughout, and what it built frozen at the end (`core.gc_pause` Rules 1, 2:
    the caller holds the heap, `gc_held`)."""
    with gc_paused(freeze=True):
        return _prepare(load, running, pending_restart, allow_restart_required, build)


def _prepare(
    load: Callable[[], ParsedConfig],
    running: Snapshot,
    pending_restart: tuple[str, ...],
    allow_restart_required: bool,
    build: bool,
) -> PreparedRefresh:
    parsed = load()
    plan = plan_apply(
        running.config,
        parsed.config,
        pending_restart=pending_restart,
        allow_restart_required=allow_restart_required,
    )
    if not build or plan.errors:
        return PreparedRefresh(parsed=parsed, plan=plan, snapshot=None, to_push=())
    snapshot = Snapshot.build(
        plan.effective, revision=running.revision + 1, config_sha256=parsed.sha256
    )
    return PreparedRefresh(
        parsed=parsed, plan=plan, snapshot=snapshot, to_push=nodes_to_push(running, snapshot)
    )
