"""Config refresh records (design §5): the admin request, the report, and the status view.

These are what `POST /refresh` accepts and returns, what `GET /status` returns, and what
`iop-edge refresh` decodes to print its diff, so they live in `schemas/` beside the config
they describe. Rules every producer follows:

- Every list is present (empty, never null) and sorted, so two reports of the same
  refresh compare equal and a reader can diff them line by line.
- A change names a *path* and its class, never a value: a token hash that changed shows
  only as changed (design §2.3).
- `revision` is the revision in force after the attempt: the new one for an applied or
  no-change apply, the unchanged base for a dry run or a rejection.
"""

from __future__ import annotations

from typing import Literal

import msgspec

RefreshMode = Literal["dry_run", "apply"]
ChangeClass = Literal["live", "restart_required"]
RefreshOutcome = Literal["no_change", "applied", "rejected", "dry_run"]
RefreshVerdict = Literal["accepted", "invalid", "conflict", "unavailable"]
"""How an attempt was answered: `accepted` (applied, no change, or a dry run), `invalid`
(the candidate failed validation; nothing changed), `conflict` (refused as things stand:
another refresh running, a stale `if_revision`, or restart-required changes not allowed)
or `unavailable` (the Edge cannot record the attempt, its audit log cannot be written:
nothing changed; retry once it can)."""
NodePushStatus = Literal["pushed", "applied", "failed", "not_connected"]
"""`applied`: the node acked the new revision. `failed`: it refused, or no ack came in
time (`detail` says which). `not_connected`: the node was not connected; it receives the
current config in its next `welcome`. `pushed`: sent without awaiting an ack (reserved)."""


class RefreshRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Base of the refresh records: immutable and keyword-only.

    Not tracked by the cycle collector (`gc=False`): a record holds strings, numbers,
    lists of them and other records, never a cycle, and a fleet's report is tens of
    thousands of records, which the Edge's collections would otherwise walk while the
    report is answered."""


class RefreshRequest(RefreshRecord, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `POST /refresh` body. Unknown fields are rejected so a typo such as
    `allow_restart` fails loudly instead of quietly applying all-or-nothing."""

    mode: RefreshMode
    config_yaml: str | None = None
    """Inline candidate; None re-reads the Edge's config file."""
    if_revision: int | None = None
    """Apply only if this is still the running revision (optimistic concurrency)."""
    allow_restart_required: bool = False
    """Apply the live subset and leave restart-required changes pending."""


class Change(RefreshRecord, frozen=True, kw_only=True):
    """One changed config path (`nodes[gpu1].providers[gpu1-vllm].capacity`)."""

    path: str
    class_: ChangeClass = msgspec.field(name="class")


class NodeResult(RefreshRecord, frozen=True, kw_only=True):
    """What happened when the new config was pushed to one node."""

    id: str
    status: NodePushStatus
    revision: int | None = None
    """The revision the node acked, when it acked one."""
    detail: str | None = None


class RefreshError(RefreshRecord, frozen=True, kw_only=True):
    """Why a candidate was not applied, named by its config path ("" = the whole request)."""

    path: str
    message: str


class ReplicaStatus(RefreshRecord, frozen=True, kw_only=True):
    """One Edge process sharing this Edge's ledger (a replica; or, during a zero-downtime
    restart, the old and the new process), as it last reported itself there."""

    instance: str
    """`HOST/PID`: unique per process."""
    edge_id: str
    host: str
    pid: int
    state: Literal["serving", "draining"]
    revision: int
    config_sha256: str
    pending_restart: list[str] = []
    openai_url: str = ""
    node_url: str = ""
    admin_url: str = ""
    started_at: float = 0.0
    seen_at: float = 0.0
    """When it last wrote its row (unix seconds); rows not refreshed for a while are
    left out (a replica that died)."""
    current: bool = False
    """This is the process that answered."""
    same_config: bool = True
    """It runs the same config (sha256) as the process that answered."""


class RefreshReport(RefreshRecord, frozen=True, kw_only=True):
    """The answer to `POST /refresh`, in both modes; also the audit log's core."""

    mode: RefreshMode
    outcome: RefreshOutcome
    base_revision: int
    revision: int
    changed_nodes: list[str] = []
    changed_providers: list[str] = []
    changed_models: list[str] = []
    changes: list[Change] = []
    live_paths: list[str] = []
    restart_required_paths: list[str] = []
    pending_restart: list[str] = []
    errors: list[RefreshError] = []
    nodes: list[NodeResult] = []
    replicas: list[ReplicaStatus] = []
    """Every Edge process sharing this one's ledger, read after the attempt: a refresh
    applies to one replica only, and this says which others still run another config."""


class NodeStatus(RefreshRecord, frozen=True, kw_only=True):
    id: str
    connected: bool
    applied_revision: int | None = None
    """The last revision this node acked or was welcomed with; None if never connected."""


class StatusReport(RefreshRecord, frozen=True, kw_only=True):
    """`GET /status`: which config is running and what still waits for a restart."""

    revision: int
    config_sha256: str
    config_file: str | None = None
    """The absolute path of the config file the Edge runs from (what a refresh without a
    candidate re-reads); null when it runs from a config given in memory."""
    pending_restart: list[str] = []
    nodes: list[NodeStatus] = []
    pid: int | None = None
    """The Edge process answering (it changes with every zero-downtime restart)."""
    replicas: list[ReplicaStatus] = []
    """Every Edge process sharing this one's ledger, as of their last heartbeat."""
