"""What the admin API reads and drives (`AdminServices`): the composition root wires each
service, and each route group (`admin_state`, `admin_usage`, `admin_control`,
`admin_models`) uses the ones it answers for."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from iop_edge.core.routing.readiness import Readiness
from iop_edge.http.admin_api.admin_models import ModelCommandRunner
from iop_edge.http.admin_api.catalog_stream import CatalogSource
from iop_edge.runtime.metering.activity import ActivityReport
from iop_edge.runtime.metering.usage_ledger.usage_store import UsageReport
from iop_edge.runtime.refresh.refresh import RefreshResult
from schemas.principals import PrincipalsReport
from schemas.refresh import RefreshRequest, StatusReport
from schemas.restart import RestartReport


class UsageQuery(Protocol):
    def __call__(
        self,
        *,
        since: float | None,
        until: float | None,
        group_by: Sequence[str],
        limit: int | None,
        after: str | None,
    ) -> Awaitable[UsageReport]: ...


@dataclass(frozen=True, slots=True)
class AdminServices:
    """What the admin API reads and drives; the composition root wires each one."""

    revision: Callable[[], int]
    status: Callable[[], StatusReport]
    catalog: CatalogSource
    """The pool, read a slice at a time (`catalog_stream`)."""
    metrics: Callable[[], bytes]
    usage: UsageQuery
    refresh: Callable[[RefreshRequest], Awaitable[RefreshResult]]
    readiness: Callable[[], Readiness]
    activity: Callable[[], ActivityReport]
    refuse_refresh: Callable[[str], Awaitable[None]]
    """Audit a refresh request that could not be read."""
    restart: Callable[[], Awaitable[RestartReport]] | None = None
    principals: Callable[[], PrincipalsReport] | None = None
    """Each principal against its limits now (design §15)."""
    model_command: ModelCommandRunner | None = None
    """The operator's model loads and unloads (design §18); None: not offered."""
    admin_token: str = ""
    """What every change (`POST`) presents (`lifecycle.admin_credential`)."""
    admin_token_path: str = ""
    """Where the credential is kept, for the refusal's message."""
