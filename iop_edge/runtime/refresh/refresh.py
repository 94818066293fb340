"""Config refresh (design §5): validate a candidate, decide, swap the snapshot, push to nodes.

The `Refresher` coordinates; the pure parts live in the core (`refresh_diff` diffs and
classifies, `refresh_plan` decides) and run in the refresh worker, a child process
(`refresh.worker`: reading a fleet's candidate is seconds of Python, which the Edge's
loop must not share); the Edge is reached only through the small `RefreshTarget`
interface, so all of this is testable with a fake Edge. It answers with a
`RefreshResult`: a verdict (accepted, invalid, conflict) and the report; what a verdict
means in HTTP is the admin API's business.

One refresh runs at a time. A second one that arrives meanwhile is a conflict at once
instead of queueing: the operator is told to look at the result of the first, and two
candidates can never be applied on top of each other. Between deciding and swapping the
one await is the audit line's write, and only the Refresher swaps snapshots, so the
decision is made against the very snapshot it replaces.

An apply goes through these steps, and stops at the first that says no (every attempt,
rejected ones too, ends with one audit log line):

1. another refresh is running -> conflict at once;
2. load the candidate (inline YAML, or the config file re-read), in the worker: invalid
   -> every error and its path; a worker that crashed or did not answer in time ->
   `unavailable`, nothing applied (the next refresh starts another worker); then
   `if_revision` not the running revision -> conflict;
3. plan (`refresh_plan.plan_apply`): a restart-required change that is not already
   pending is a conflict unless `allow_restart_required`; then the live subset is applied
   and the rest becomes `pending_restart`. A dry run stops here with the same report (its
   `errors` say what an apply would be refused for);
4. write the attempt's audit line ahead (`AuditLog.reserve`): a line that cannot be
   written (a full disk) refuses the refresh (`unavailable`), nothing applied;
5. swap a new snapshot (revision + 1), even when nothing changed;
6. push each affected connected node its own config and wait, bounded, for its ack;
   write an applied inline candidate to the config file (keeping `.prev`); complete the
   audit line with what the push reported.

Steps 4 to 6 run shielded (each with a deadline): once the line is written, a caller
who hangs up must not leave the attempt half done, the nodes unpushed or the file stale.

`pending_restart` holds the restart-required paths where the last applied candidate
differs from what runs. It is recomputed by every apply (a candidate that reverts a
pending change clears it) and otherwise kept until the process restarts.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

import msgspec
import trio

from iop_edge.core.configuration.config import ConfigInvalid
from iop_edge.core.refresh.refresh_plan import error_order
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.refresh.assemble import assemble
from iop_edge.runtime.refresh.audit import (
    AuditLog,
    Reservation,
    reserve_room,
    write_config_atomically,
)
from iop_edge.runtime.refresh.json_pieces import encode_in_pieces
from iop_edge.runtime.refresh.push import AckListener, CatchUp, PushPolicy, push_all
from iop_edge.runtime.refresh.worker_client import RefreshWorker, WorkerFailed
from iop_edge.runtime.refresh.worker_protocol import Invalid, Plan, Prepare, Prepared
from schemas.config import ConfigError, NodeConfig
from schemas.refresh import (
    NodeResult,
    NodeStatus,
    RefreshError,
    RefreshOutcome,
    RefreshReport,
    RefreshRequest,
    RefreshVerdict,
    StatusReport,
)

__all__ = [
    "RefreshResult",
    "RefreshTarget",
    "Refresher",
    "RefresherStatistics",
]

log = logging.getLogger(__name__)

#: Default deadline for each shielded file write (config file, audit line); the shielded
#: push gets the push timeout plus this.
WRITE_DEADLINE_S = 5.0


@dataclass(frozen=True, slots=True)
class RefreshResult:
    """How one refresh attempt ended: the verdict and the report (design §5 step 3)."""

    verdict: RefreshVerdict
    report: RefreshReport

    async def report_json(self) -> bytearray:
        """The report as JSON; a fleet's (megabytes) a piece a step (`json_pieces`)."""
        await trio.lowlevel.checkpoint()
        return await encode_in_pieces(_REPORT_ENCODER, self.report, _LONG_LISTS)


#: Encodes the reports `RefreshResult.report_json` answers with.
_REPORT_ENCODER: Final = msgspec.json.Encoder()
#: The lists of a report that grow with the fleet (`encode_in_pieces`).
_LONG_LISTS: Final = (
    "changed_nodes",
    "changed_providers",
    "changes",
    "live_paths",
    "restart_required_paths",
    "nodes",
)
#: The longest a refresh waits for the worker to read, check and plan a candidate before
#: it fails the refresh and restarts the worker (a fleet's candidate takes seconds).
WORKER_DEADLINE_S: Final = 120.0
#: How much longer the Edge waits for a worker that did not end itself at its deadline.
WORKER_GRACE_S: Final = 1.0
#: Nodes from which the worker is started as the Edge starts, to read the running config
#: (`Refresher.run`): reading a config of a thousand Nodes takes about as long as
#: starting a worker (a tenth of a second or two). A smaller Edge runs without a worker
#: until its first refresh, which starts one for a fraction of a second more.
WARM_UP_NODES: Final = 1000


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A candidate read and decided by the worker, ready to be applied."""

    config_sha256: str
    plan: Plan
    snapshot: Snapshot | None
    """What an apply swaps in (revision + 1); None for a dry run or a refused plan."""
    to_push: tuple[str, ...]
    """The Nodes an apply pushes to (`core.refresh.refresh_plan`, rule 5)."""


@dataclass(frozen=True, slots=True)
class RefresherStatistics:
    """The coordinator's state at one instant (for tests and diagnostics); what waits for
    a restart is in `status()`."""

    busy: bool
    """A refresh is running: another one now is refused as a conflict."""
    parsed_nodes: int
    """Node entries the last valid candidate had read from its YAML: those the worker's
    proof did not know by their text (`core.configuration.config_proof`)."""
    checked_nodes: int
    """Node entries the last valid candidate had checked: those the proof did not hold."""


class RefreshTarget(Protocol):
    """What the Refresher needs from the Edge."""

    @property
    def snapshot(self) -> Snapshot:
        """The running snapshot (its `revision`, `config`, `config_sha256`)."""
        ...

    def swap_snapshot(self, snapshot: Snapshot) -> None:
        """Install `snapshot` in one step, no await: config, catalog, scheduler state."""
        ...

    def connected_nodes(self) -> frozenset[str]: ...

    def applied_revisions(self) -> Mapping[str, int]:
        """Each connected node's last acked (or welcomed-with) revision, for `/status`."""
        ...

    async def push_node_config(
        self, node_id: str, revision: int, node_config: NodeConfig, answer: AckListener
    ) -> None:
        """Send the Node its config; `answer` is told its ack, or None if the node is not
        (or no longer) connected (`push.PushTarget`). The Refresher bounds the wait."""
        ...


def _nothing_to_keep() -> None:
    """`keep` where no heap is held."""


# --- the coordinator ---------------------------------------------------------------------


class Refresher:
    """Runs config refreshes against a `RefreshTarget`, one at a time."""

    def __init__(
        self,
        target: RefreshTarget,
        *,
        config_path: Path | None,
        audit: AuditLog,
        push_timeout_s: float = 10.0,
        push_policy: PushPolicy | None = None,
        worker: RefreshWorker | None = None,
        worker_deadline_s: float = WORKER_DEADLINE_S,
        write_deadline_s: float = WRITE_DEADLINE_S,
        running_text: str | None = None,
        hold: Callable[[], AbstractContextManager[Callable[[], None]]] = lambda: (
            contextlib.nullcontext(_nothing_to_keep)
        ),
        blocked: Callable[[], str | None] = lambda: None,
    ) -> None:
        """`push_timeout_s` is a Node's time to ack, unless a whole `push_policy` is
        given. `worker` reads and plans candidates (`refresh.worker`); one is started on
        the first refresh if not given, and `aclose` stops it. `worker_deadline_s` bounds
        its work on one candidate (infinite: unbounded), and `write_deadline_s` each file
        write (the audit line, the config file): both are for hangs in real time.
        `running_text` is the text the
        running config was read from: when it has `WARM_UP_NODES` Nodes or more, `run`
        has the worker read it as the Edge starts, so that its first candidate is checked
        only where it changed. `hold` keeps the Edge's heap out of the collector's sight
        for an apply, from before the worker answers to the apply's end
        (`lifecycle.heap_keeper.HeapKeeper.held`), and gives a `keep` that says what was made is
        alive (the snapshot, as it is assembled). `blocked` says why no refresh may run
        now, or None (a restart in progress: its new process has read the config)."""
        self._target = target
        self._config_path = config_path
        self._audit = audit
        self.worker = worker or RefreshWorker()
        self._worker_deadline_s = worker_deadline_s
        self._write_deadline_s = write_deadline_s
        self._read = (0, 0)
        self._running_text = running_text
        self._push = push_policy or PushPolicy(timeout_s=push_timeout_s)
        self.catch_up = CatchUp(target, self._push)
        """Pushes the running config again to the Nodes that missed a refresh; its `run`
        is a service of the Edge."""
        self._busy = False
        self._blocked = blocked
        self._pending_restart: tuple[str, ...] = ()
        self._hold = hold
        self._holding = ExitStack()
        """The open hold of the refresh that runs, if it builds (`_prepare`)."""

    async def aclose(self) -> None:
        """Stop the refresh worker (bounded)."""
        await self.worker.aclose()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """A service of the Edge: the refresh worker lives as long as this runs, and is
        stopped when it is cancelled."""
        try:
            task_status.started()
            await self._warm_up()
            await trio.sleep_forever()
        finally:
            await self.aclose()

    async def _warm_up(self) -> None:
        """For a config of `WARM_UP_NODES` Nodes or more: start the worker and have it
        read the running config's text, as a dry run nobody asked for (not audited): it
        then holds the running config and its proof. A worker that fails here is logged;
        the first refresh starts another."""
        text, self._running_text = self._running_text, None
        base = self._target.snapshot
        if text is None or len(base.nodes) < WARM_UP_NODES:
            return
        ask = Prepare(base_revision=base.revision, deadline_s=self._deadline_in_worker())
        with trio.move_on_after(self._worker_deadline_s + WORKER_GRACE_S):
            try:
                answer = await self.worker.prepare(ask, base.config, config_yaml=text)
            except WorkerFailed as failed:
                log.warning("refresh worker: %s; the first refresh starts another", failed)
                return
            if isinstance(answer, Prepared):
                self._read = (answer.parsed_nodes, answer.checked_nodes)
            return
        log.warning("refresh worker: it did not read the running config in time")

    def _deadline_in_worker(self) -> float | None:
        deadline = self._worker_deadline_s
        return deadline if math.isfinite(deadline) else None

    def statistics(self) -> RefresherStatistics:
        return RefresherStatistics(
            busy=self._busy, parsed_nodes=self._read[0], checked_nodes=self._read[1]
        )

    @property
    def pending_restart(self) -> tuple[str, ...]:
        """Restart-required paths the running config leaves at their old value."""
        return self._pending_restart

    def status(self) -> StatusReport:
        """`GET /status`: the running revision, what waits for a restart, and each node."""
        snapshot = self._target.snapshot
        connected = self._target.connected_nodes()
        applied = self._target.applied_revisions()
        return StatusReport(
            revision=snapshot.revision,
            config_sha256=snapshot.config_sha256,
            config_file=None if self._config_path is None else str(self._config_path.resolve()),
            pending_restart=list(self._pending_restart),
            nodes=[
                NodeStatus(
                    id=node_id,
                    connected=node_id in connected,
                    applied_revision=applied.get(node_id),
                )
                for node_id in sorted(snapshot.nodes.keys() | connected)
            ],
        )

    async def refresh(self, request: RefreshRequest, *, source: str = "admin API") -> RefreshResult:
        """Run one refresh; returns its verdict and report (design §5). `source` says who
        asked (the admin API, SIGHUP) in the log line every attempt gets."""
        blocked = "another refresh is in progress" if self._busy else self._blocked()
        if blocked is not None:
            report = self._rejected(request, "", f"{blocked}; retry when it has finished")
            result = await self._finish("conflict", report, config_sha256=None)
        else:
            self._busy = True
            try:
                with ExitStack() as self._holding:
                    result = await self._refresh(request)
            finally:
                self._busy = False
        _log_attempt(source, request, result, self._config_path)
        return result

    async def _refresh(self, request: RefreshRequest) -> RefreshResult:
        """Steps 2-6 of a refresh."""
        base = self._target.snapshot
        try:
            prepared = await self._prepare(request, base)
        except ConfigInvalid as invalid:
            errors = [RefreshError(path=e.path, message=e.message) for e in invalid.errors]
            report = self._report(request, "rejected", self._target.snapshot, errors=errors)
            return await self._finish("invalid", report, config_sha256=None)
        except WorkerFailed as failed:
            log.error("refresh: %s; nothing was applied", failed)
            report = self._rejected(
                request,
                "",
                f"{failed}; nothing was applied, and the worker is restarted for the next refresh",
            )
            return await self._finish("unavailable", report, config_sha256=None)
        sha256, plan = prepared.config_sha256, prepared.plan
        if self._target.snapshot is not base:  # only the Refresher swaps: a safety net
            report = self._rejected(
                request, "", "the running config changed while this candidate was checked; retry"
            )
            return await self._finish("conflict", report, config_sha256=sha256)
        if request.if_revision is not None and request.if_revision != base.revision:
            report = self._rejected(
                request,
                "if_revision",
                f"the running revision is {base.revision}, not {request.if_revision}",
            )
            return await self._finish("conflict", report, config_sha256=sha256)
        if request.mode == "dry_run":
            report = self._report(request, "dry_run", base, plan=plan, errors=plan.errors)
            return await self._finish("accepted", report, config_sha256=sha256)
        if plan.errors:
            report = self._report(request, "rejected", base, plan=plan, errors=plan.errors)
            return await self._finish("conflict", report, config_sha256=sha256)
        snapshot, to_push = prepared.snapshot, list(prepared.to_push)
        assert snapshot is not None  # an apply whose plan has no errors is built
        planned = self._report(
            request,
            "applied" if plan else "no_change",
            base,
            revision=snapshot.revision,
            plan=plan,
            nodes=_interrupted(to_push),
            pending_restart=tuple(plan.pending_restart),
        )
        reservation = await self._reserve(planned, config_sha256=sha256)
        if isinstance(reservation, str):
            report = self._rejected(request, "", reservation)
            return RefreshResult("unavailable", report)
        self._target.swap_snapshot(snapshot)
        self._pending_restart = tuple(plan.pending_restart)

        return await self._commit(
            request,
            base=base,
            snapshot=snapshot,
            config_sha256=sha256,
            plan=plan,
            to_push=to_push,
            interrupted=planned.nodes,
            reservation=reservation,
        )

    async def _reserve(self, planned: RefreshReport, *, config_sha256: str) -> Reservation | str:
        """Step 4: the audit line, written ahead; or why it could not be (the refresh is
        then refused). Shielded: once written, the attempt goes ahead. The deadline bounds
        the wait for the log; the write itself is always waited for (`audit`)."""
        problem = f"did not finish within {self._write_deadline_s:g}s"
        with trio.move_on_after(self._write_deadline_s, shield=True):
            try:
                return await self._audit.reserve(
                    planned,
                    verdict="accepted",
                    config_sha256=config_sha256,
                    room=reserve_room(len(planned.nodes)),
                )
            except OSError as exc:
                problem = exc.strerror or str(exc)
        directory = self._audit.path.parent
        log.error(
            "refresh refused: the audit log %s cannot be written: %s", self._audit.path, problem
        )
        return (
            f"the refresh audit log {self._audit.path} cannot be written ({problem}), so "
            f"nothing was applied: a refresh is never applied unaudited. Make room in "
            f"edge.state_dir ({directory}) and retry"
        )

    async def _commit(
        self,
        request: RefreshRequest,
        *,
        base: Snapshot,
        snapshot: Snapshot,
        config_sha256: str,
        plan: Plan,
        to_push: list[str],
        interrupted: list[NodeResult],
        reservation: Reservation,
    ) -> RefreshResult:
        """After the swap: push to the nodes, persist an inline candidate, report, and
        complete the audit line written ahead. `interrupted`: each push as it stands
        before it is made (`_interrupted`), what the report says if the Edge stops.

        Shielded with deadlines: the swap has happened, so a caller who hangs up must not
        leave the nodes unpushed or the file stale. The push's own deadline (it grows
        with the Nodes pushed, `push.PushPolicy`) ends it well before the shield's. A
        connected Node that did not apply the new revision is pushed again later
        (`push.CatchUp`), and its line in the report says so.
        """
        with trio.move_on_after(self._write_deadline_s, shield=True):
            # The audit line's reservation and the swap took a step of the loop; the
            # rest of the commit starts in the next.
            await trio.lowlevel.checkpoint()
        nodes = interrupted  # the planned report's
        self.catch_up.forget(to_push)
        with trio.move_on_after(
            self._push.deadline_s(len(to_push)) + self._write_deadline_s, shield=True
        ):
            nodes = await push_all(self._target, to_push, snapshot, self._push)
        nodes = self.catch_up.take_failures(nodes)
        errors: list[RefreshError] = []
        if request.config_yaml is not None and self._config_path is not None:
            errors = await self._persist(self._config_path, request.config_yaml)
        outcome: RefreshOutcome = "applied" if plan else "no_change"
        report = self._report(
            request,
            outcome,
            base,
            revision=snapshot.revision,
            plan=plan,
            errors=errors,
            nodes=nodes,
        )
        return await self._finish(
            "accepted", report, config_sha256=config_sha256, reservation=reservation
        )

    async def _persist(self, path: Path, text: str) -> list[RefreshError]:
        """Write an applied inline candidate to the config file; problems as report errors."""
        problem = f"did not finish within {self._write_deadline_s:g}s"
        with trio.move_on_after(self._write_deadline_s, shield=True):
            try:
                await write_config_atomically(path, text)
                return []
            except OSError as exc:
                problem = exc.strerror or type(exc).__name__
        log.error("refresh applied, but writing the config file %s failed: %s", path, problem)
        return [
            RefreshError(
                path="",
                message=f"applied, but the config file could not be written ({problem}); "
                "a restart would revert this refresh",
            )
        ]

    async def _prepare(self, request: RefreshRequest, base: Snapshot) -> _Prepared:
        """Steps 2 and 3 in the refresh worker (`refresh.worker`: for a fleet's config
        that is seconds of work and a million objects, in a process of its own), then
        the new snapshot assembled here from its per-Node delta (`refresh.assemble`).
        Raises `ConfigInvalid`, or `WorkerFailed` when the worker crashed or did not
        answer within the deadline (it is restarted for the next refresh)."""
        if request.config_yaml is None and self._config_path is None:
            raise ConfigInvalid([_no_candidate()])
        ask = Prepare(
            base_revision=base.revision,
            config_path=None if self._config_path is None else str(self._config_path),
            pending_restart=list(self._pending_restart),
            allow_restart_required=request.allow_restart_required,
            build=request.mode == "apply",
            deadline_s=self._deadline_in_worker(),
        )
        keep: Callable[[], None] = _nothing_to_keep
        if ask.build:
            # From the worker's answer (a fleet's plan, read here) to the apply's end the
            # loop makes a fleet's worth of objects; opened now, the hold's first
            # collection has only what is young before the answer to look at.
            keep = self._holding.enter_context(self._hold())
        # The worker ends itself at its deadline (in real time); this one, a little later,
        # is for a worker that cannot even do that.
        with trio.move_on_after(self._worker_deadline_s + WORKER_GRACE_S):
            answer = await self.worker.prepare(ask, base.config, config_yaml=request.config_yaml)
            if isinstance(answer, Invalid):
                raise ConfigInvalid(answer.errors)
            self._read = (answer.parsed_nodes, answer.checked_nodes)
            snapshot: Snapshot | None = None
            to_push: tuple[str, ...] = ()
            if answer.built is not None:
                snapshot = await assemble(
                    answer.built, base, config_sha256=answer.config_sha256, keep=keep
                )
                to_push = tuple(answer.built.to_push)
            return _Prepared(answer.config_sha256, answer.plan, snapshot, to_push)
        raise WorkerFailed(f"the refresh worker did not answer within {self._worker_deadline_s:g}s")

    # --- reports -------------------------------------------------------------------------

    def _report(
        self,
        request: RefreshRequest,
        outcome: RefreshOutcome,
        base: Snapshot,
        *,
        revision: int | None = None,
        plan: Plan | None = None,
        errors: tuple[RefreshError, ...] | list[RefreshError] = (),
        nodes: list[NodeResult] | None = None,
        pending_restart: tuple[str, ...] | None = None,
    ) -> RefreshReport:
        """A report with every list present and sorted (the diff arrives sorted).

        `revision` defaults to the base revision: nothing was swapped; `pending_restart`
        to what waits for a restart now.
        """
        diff = plan
        return RefreshReport(
            mode=request.mode,
            outcome=outcome,
            base_revision=base.revision,
            revision=base.revision if revision is None else revision,
            changed_nodes=list(diff.changed_nodes) if diff else [],
            changed_providers=list(diff.changed_providers) if diff else [],
            changed_models=list(diff.changed_models) if diff else [],
            changes=list(diff.changes) if diff else [],
            live_paths=list(diff.live_paths) if diff else [],
            restart_required_paths=list(diff.restart_required_paths) if diff else [],
            pending_restart=list(
                self._pending_restart if pending_restart is None else pending_restart
            ),
            errors=sorted(errors, key=error_order),
            nodes=sorted(nodes or [], key=lambda result: result.id),
        )

    def _rejected(self, request: RefreshRequest, path: str, message: str) -> RefreshReport:
        error = RefreshError(path=path, message=message)
        return self._report(request, "rejected", self._target.snapshot, errors=[error])

    async def refuse_unreadable(self, problem: str) -> None:
        """A refresh request that could not be read is an attempt too: audit it."""
        revision = self._target.snapshot.revision
        with trio.move_on_after(self._write_deadline_s, shield=True):
            try:
                await self._audit.append_unreadable(problem, revision=revision)
            except OSError as exc:
                log.error("refresh audit log %s not written: %s", self._audit.path, exc)

    async def _finish(
        self,
        verdict: RefreshVerdict,
        report: RefreshReport,
        *,
        config_sha256: str | None,
        reservation: Reservation | None = None,
    ) -> RefreshResult:
        """Audit the attempt (completing its line written ahead, if any), then hand back
        the answer.

        Shielded (with a deadline) so an attempt is audited even if its caller hung up. A
        failed audit write is logged, not raised: the attempt has already happened (an
        apply's line was written ahead, and says what it decided) and its caller deserves
        the report. A dry run's report says an apply would be refused.
        """
        problem = f"not written within {self._write_deadline_s:g}s"
        with trio.move_on_after(self._write_deadline_s, shield=True):
            try:
                if reservation is None:
                    await self._audit.append(report, verdict=verdict, config_sha256=config_sha256)
                else:
                    await self._audit.complete(
                        reservation, report, verdict=verdict, config_sha256=config_sha256
                    )
                return RefreshResult(verdict, report)
            except OSError as exc:
                problem = exc.strerror or str(exc)
        log.error("refresh audit log %s not written: %s", self._audit.path, problem)
        if report.mode == "dry_run":
            unaudited = RefreshError(
                path="",
                message=f"the refresh audit log {self._audit.path} cannot be written "
                f"({problem}): an apply is refused until it can",
            )
            errors = sorted([*report.errors, unaudited], key=error_order)
            report = msgspec.structs.replace(report, errors=errors)
        return RefreshResult(verdict, report)


def _log_attempt(
    source: str, request: RefreshRequest, result: RefreshResult, config_path: Path | None
) -> None:
    """One line per attempt, its reasons on the following ones (the audit log has all);
    an error of the whole file (its YAML) names the file."""
    report = result.report
    if request.config_yaml is not None:
        candidate = "inline candidate"
    else:
        candidate = "the config file" + ("" if config_path is None else f" {config_path}")
    level = logging.INFO if result.verdict == "accepted" else logging.WARNING
    log.log(
        level,
        "refresh %s of %s from %s: %s, revision %d -> %d, %d change(s) "
        "(%d live, %d restart-required)",
        report.mode,
        candidate,
        source,
        report.outcome,
        report.base_revision,
        report.revision,
        len(report.changes),
        len(report.live_paths),
        len(report.restart_required_paths),
    )
    for error in report.errors[:_ERRORS_LOGGED]:
        where = error.path or candidate
        log.log(level, "refresh %s: %s: %s", report.outcome, where, error.message)
    if len(report.errors) > _ERRORS_LOGGED:  # the report and the audit log have them all
        log.log(
            level,
            "refresh %s: %d more error(s) (see the report)",
            report.outcome,
            len(report.errors) - _ERRORS_LOGGED,
        )
    if report.pending_restart and result.verdict == "accepted":
        log.log(
            level,
            "refresh: %d change(s) wait for a restart: `iop-edge restart` (or SIGUSR2) applies "
            "them with no downtime",
            len(report.pending_restart),
        )
    behind = [node for node in report.nodes if node.status != "applied"]
    for node in behind[:_NODES_LOGGED]:
        log.warning("refresh: node %s %s: %s", node.id, node.status, node.detail or "")
    if len(behind) > _NODES_LOGGED:  # a fleet's: the report and the audit log have them all
        log.warning(
            "refresh: %d more node(s) did not apply it (see the report)",
            len(behind) - _NODES_LOGGED,
        )
    if report.pending_restart and report.mode == "apply" and report.outcome == "applied":
        log.warning(
            "%d change(s) wait for a restart of the Edge: %s",
            len(report.pending_restart),
            ", ".join(report.pending_restart),
        )


#: Nodes that did not apply a refresh named one by one in the log.
_NODES_LOGGED: Final = 20
#: A refused candidate's errors told one by one in the log (a config generated wrong may
#: have thousands: each a line written on the event loop, and an operator's log flooded).
_ERRORS_LOGGED: Final = 20


def _interrupted(node_ids: list[str]) -> list[NodeResult]:
    """Each push, as it stands before it is made (and if the Edge stops meanwhile)."""
    return [
        NodeResult(id=node_id, status="failed", detail="push interrupted") for node_id in node_ids
    ]


def _no_candidate() -> ConfigError:
    return ConfigError(
        path="",
        message="no candidate: this Edge runs without a config file, so send config_yaml",
    )
