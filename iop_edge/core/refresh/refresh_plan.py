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
4. An apply can be impossible however it is asked: a live change that depends on a
   restart-required one (a model mapped to a provider being added) is an error. It is
   named beside the paths that block (a dry run predicts every reason an apply would be
   refused), and then allowing restart-required changes is not advised: it cannot help.
5. The Nodes an apply pushes to are those whose own config (`Snapshot.node_config`: its
   providers and its idle rules) differs between the running snapshot and the new one.

The refresh worker (`runtime.refresh.worker`), a process of its own, plans with these
rules: for a fleet's config that is seconds of work, and the Edge's event loop keeps
serving callers meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass

from iop_edge.core.refresh.refresh_diff import (
    ConfigDiff,
    compare_configs,
    live_subset,
    live_subset_errors,
)
from schemas.config import EdgeConfig, IdleRule, NodeEntry
from schemas.refresh import RefreshError

__all__ = [
    "ApplyPlan",
    "error_order",
    "needs_push",
    "plan_apply",
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
    impossible = live_subset_errors(effective)
    advice = (
        ""
        if impossible
        else " (with allow_restart_required the live changes apply now and this waits for "
        "the restart)"
    )
    errors = [
        RefreshError(
            path=path,
            message="changing this needs a restart (`iop-edge restart`, no downtime); nothing "
            f"was applied{advice}",
        )
        for path in blocking
    ] + impossible
    return ApplyPlan(
        diff=diff,
        effective=effective,
        pending_restart=restart_paths,
        errors=tuple(sorted(errors, key=error_order)),
    )


def error_order(error: RefreshError) -> tuple[str, str]:
    """Reports list errors sorted by path, then message."""
    return (error.path, error.message)


def needs_push(
    before: NodeEntry | None,
    after: NodeEntry,
    idle_before: tuple[IdleRule, ...] = (),
    idle_after: tuple[IdleRule, ...] = (),
) -> bool:
    """Whether a Node's own config (`Snapshot.node_config`: its providers) differs between
    its entry in the running config (None: a new Node) and in the new one (rule 5).

    An entry a refresh left alone is the very same Struct in both
    (`core.configuration.config_proof`), so comparing them costs next to nothing; what
    changed is compared field by field. `idle_before` and `idle_after` are the Node's idle
    rules in each (`core.lifecycle` Rule 1, `Snapshot.idle`): they go to the Node with its
    providers, so a change of them alone is pushed too."""
    providers = before.providers if before is not None else []
    moved = after.providers is not providers and after.providers != providers
    return moved or idle_before != idle_after
