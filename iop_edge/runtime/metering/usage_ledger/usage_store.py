"""What a usage store takes and answers (design §7): the contract both ledgers keep.

The ledger (`usage.UsageLedger`) moves `UsageRecord`s into a `LedgerStore`: SQLite
(`ledger_sqlite`, the embedded default) or PostgreSQL (`ledger_postgres`, shared by
replicas). Both answer a `UsageSelection` with the same `UsageReport`, built by the same
standard SQL (`aggregate_sql`, `totals_sql`) and paged by the same opaque cursors, so
`GET /usage` reads alike whichever store is behind it.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import msgspec

from schemas.principals import PrincipalsReport

GROUP_COLUMNS = (
    "principal_ref",
    "token_ref",
    "model",
    "provider",
    "node",
    "usage_source",
    "status",
    "protocol",
)


class UsageRecord(msgspec.Struct, frozen=True, gc=False):
    """One finished run, as the ledger keeps it: a journal line (JSON, an object of these
    fields) and a row of the `usage` table (these columns, in this order). A struct: one
    is built, encoded and decoded for every run."""

    time: float
    run_id: str
    principal_ref: str
    token_ref: str
    alias: str | None
    model: str
    provider: str
    node: str
    prompt_tokens: int
    completion_tokens: int
    status: int
    latency_ms: float
    ttft_ms: float | None
    usage_source: str = "provider"
    """"provider" or "estimated" (see the module docstring)."""
    protocol: str = "chat"
    """The caller's protocol: "chat", "messages" or "responses"."""
    cached_tokens: int = 0
    """Of `prompt_tokens`, those the runtime reported taking from its prefix cache."""


#: A record's values in its fields' order: the `usage` table's columns.
row_of: Final = msgspec.structs.astuple


class UsageRow(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Of `prompt_tokens`, those the runtimes reported taking from their prefix cache."""
    estimated_requests: int
    """How many of `requests` carry estimated token counts (`usage_source: estimated`)."""
    estimated_tokens: int
    """How many of the prompt + completion tokens are estimates."""
    principal_ref: str | None = None
    token_ref: str | None = None
    model: str | None = None
    provider: str | None = None
    node: str | None = None
    usage_source: str | None = None
    status: int | None = None
    """The HTTP status the caller got (when grouped by `status`)."""
    protocol: str | None = None


class UsageReport(msgspec.Struct, frozen=True, kw_only=True):
    since: float | None
    until: float | None
    group_by: list[str]
    rows: list[UsageRow]
    """One page of the groups, in the order of `group_by`'s columns."""
    totals: UsageRow | None = None
    """Every record in the window, whichever page this is (None: there are none)."""
    truncated: bool = False
    """More groups follow this page: ask again with `after` set to `next`."""
    next: str | None = None
    """The cursor of the next page (None on the last one)."""
    principals: PrincipalsReport | None = None
    """Each principal against its limits now (the Edge adds it; a store does not)."""


@dataclass(frozen=True, slots=True)
class UsageSelection:
    """What a store is asked for: the window, the grouping, and one page of the groups.

    The groups come in the order of `columns` (an index serves the default grouping in
    that order, so a page costs what it returns); a page starts after the group `after`
    (the last key of the previous page) and holds at most `limit` groups."""

    since: float | None
    until: float | None
    columns: list[str]
    """Checked against `GROUP_COLUMNS` (they are written into the SQL)."""
    limit: int | None = None
    """None: every group (the principals' budgets read them all)."""
    after: tuple[Any, ...] | None = None


class LedgerUnavailable(Exception):
    """The ledger cannot be used at all (opened, queried); the message says why."""


class LedgerStore(Protocol):
    """Where journaled records end up: SQLite (`SqliteStore`, the embedded default) or a
    database Edge replicas share (`ledger_postgres.PostgresStore`). Every method blocks and
    runs in a worker thread; the ledger calls one at a time."""

    WRITE_ERRORS: tuple[type[Exception], ...]
    """What a refused write raises (the ledger retries it later; the journal keeps the
    records meanwhile), and a query that cannot be answered (`LedgerUnavailable`)."""
    shared: bool
    """Edges with other journal folders checkpoint here too (a database replicas share),
    so a checkpoint whose segment is not in this journal's folder may be theirs."""

    def open(self) -> None:
        """Connect; create or migrate the schema (the usage table, the checkpoints)."""

    def checkpoints(self) -> dict[str, int]:
        """Every journal segment's checkpoint saved so far (journal Rule 2)."""
        ...

    def insert(self, records: Sequence[UsageRecord], segment: str, offset: int) -> None:
        """Insert `records` and set `segment`'s checkpoint to `offset`, in one transaction.
        A record the store cannot hold is logged and skipped; the others go in."""

    def forget(self, segments: Sequence[str]) -> None:
        """Make what is committed durable, then drop these segments' checkpoints."""

    def aggregate(self, selection: UsageSelection) -> UsageReport:
        """One page of the records grouped, summed in the database (`aggregate_sql`)."""
        ...

    def close(self) -> None: ...


#: The sums every usage row carries, in `usage_report`'s order (standard SQL).
AGGREGATES: Final = (
    "COUNT(*)",
    "SUM(prompt_tokens)",
    "SUM(completion_tokens)",
    "SUM(CASE WHEN usage_source = 'estimated' THEN 1 ELSE 0 END)",
    "SUM(CASE WHEN usage_source = 'estimated' THEN prompt_tokens + completion_tokens ELSE 0 END)",
    "SUM(cached_tokens)",
)


def _window(selection: UsageSelection, placeholder: str) -> tuple[list[str], list[Any]]:
    where: list[str] = []
    params: list[Any] = []
    if selection.since is not None:
        where.append(f"time >= {placeholder}")
        params.append(selection.since)
    if selection.until is not None:
        where.append(f"time < {placeholder}")
        params.append(selection.until)
    return where, params


def aggregate_sql(selection: UsageSelection, placeholder: str) -> tuple[str, list[Any]]:
    """One page of groups, in standard SQL (SQLite and PostgreSQL alike): `columns`, then
    `AGGREGATES`, ordered by the columns, from the group after `after`, one row more than
    `limit` (which says whether more follow). The columns come from `GROUP_COLUMNS`."""
    columns = selection.columns
    where, params = _window(selection, placeholder)
    if selection.after is not None and columns:
        # A row value: the groups whose key sorts after the last one of the previous page.
        where.append(f"({', '.join(columns)}) > ({', '.join(placeholder for _ in columns)})")
        params.extend(selection.after)
    sql = f"SELECT {', '.join([*columns, *AGGREGATES])} FROM {{table}}"
    if where:
        sql += " WHERE " + " AND ".join(where)
    if columns:
        sql += f" GROUP BY {', '.join(columns)} ORDER BY {', '.join(columns)}"
        if selection.limit is not None:
            sql += f" LIMIT {placeholder}"
            params.append(selection.limit + 1)
    return sql.format(table="usage"), params


def totals_sql(selection: UsageSelection, placeholder: str) -> tuple[str, list[Any]]:
    """The sums over the whole window (every page's)."""
    where, params = _window(selection, placeholder)
    sql = f"SELECT {', '.join(AGGREGATES)} FROM usage"
    if where:
        sql += " WHERE " + " AND ".join(where)
    return sql, params


def paged(selection: UsageSelection, rows: Sequence[Sequence[Any]]) -> bool:
    """Whether `rows` are one page of several (the totals then take a query of their own)."""
    return selection.after is not None or (
        selection.limit is not None and len(rows) > selection.limit
    )


def usage_report(
    selection: UsageSelection,
    rows: Sequence[Sequence[Any]],
    totals: Sequence[Any] | None = None,
) -> UsageReport:
    """The report of one page of grouped rows (`columns`, then `AGGREGATES`) and, when
    the page is not all of them, the window's `totals` (`AGGREGATES`), whatever the store."""
    columns = selection.columns
    limit = selection.limit
    truncated = limit is not None and len(rows) > limit
    page = rows[:limit] if truncated else rows
    result = [row for row in (_usage_row(values, columns) for values in page) if row is not None]
    total = _sum(result) if totals is None else _usage_row(totals, [])
    return UsageReport(
        since=selection.since,
        until=selection.until,
        group_by=columns,
        rows=result,
        totals=total,
        truncated=truncated,
        next=encode_cursor(columns, page[-1][: len(columns)]) if truncated else None,
    )


def _usage_row(values: Sequence[Any], columns: list[str]) -> UsageRow | None:
    """A row of `columns`' values, then `AGGREGATES`; None for a group of no records."""
    requests, prompt, completion, estimated, estimated_tokens, cached = values[len(columns) :]
    if not requests:
        return None
    return UsageRow(
        requests=int(requests),
        prompt_tokens=int(prompt or 0),
        completion_tokens=int(completion or 0),
        estimated_requests=int(estimated or 0),
        estimated_tokens=int(estimated_tokens or 0),
        cached_tokens=int(cached or 0),
        **dict(zip(columns, values[: len(columns)], strict=True)),
    )


def _sum(rows: list[UsageRow]) -> UsageRow | None:
    if not rows:
        return None
    return UsageRow(
        requests=sum(row.requests for row in rows),
        prompt_tokens=sum(row.prompt_tokens for row in rows),
        completion_tokens=sum(row.completion_tokens for row in rows),
        estimated_requests=sum(row.estimated_requests for row in rows),
        estimated_tokens=sum(row.estimated_tokens for row in rows),
        cached_tokens=sum(row.cached_tokens for row in rows),
    )


_CursorKey = msgspec.json.Decoder(tuple[list[str], list[str | int | float | None]]).decode


def encode_cursor(columns: list[str], key: Sequence[Any]) -> str:
    """An opaque cursor for the page after the group `key` (URL-safe)."""
    raw = msgspec.json.encode([columns, list(key)])
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_cursor(cursor: str, columns: list[str]) -> tuple[Any, ...]:
    """The group key a cursor continues after; `ValueError` unless it came from a report
    grouped by the same `columns`."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        grouped, key = _CursorKey(raw)
    except (ValueError, msgspec.DecodeError):
        raise ValueError("after: not a cursor from a report's `next`") from None
    if grouped != columns or len(key) != len(columns):
        raise ValueError(
            f"after: this cursor continues a report grouped by {','.join(grouped) or '-'}, "
            f"not by {','.join(columns) or '-'}"
        )
    return tuple(key)
