"""`GET /catalog` at fleet size: filtered pages, and the whole pool streamed in slices.

Thirty thousand provider records are about ten megabytes of JSON and a few hundred
milliseconds of building. Built at once, that would hold the Edge's event loop (callers
wait) and the whole answer in memory. So the answer is written as it is built: the
head (revision, models), then the providers a slice at a time - records built, encoded
and handed to the connection - with a checkpoint between slices, and the tail (`next`).
Which providers, and how many, is `core.catalog_query`'s business.

Rules:
1. No step builds more than `SLICE` records or looks at more than `SCAN` providers'
   health: other tasks run between slices, whatever the fleet's size.
2. The answer is the same JSON document as `schemas.catalog.Catalog` encodes (its
   field order), whether it is one page or the whole pool.
3. The provider set and revision are the running snapshot's when the answer starts;
   each record is its provider's state when its slice is built (a refresh or a Node's
   status meanwhile changes what later slices say, never a record's consistency).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Final, Protocol

import msgspec
import trio

from iop_edge.core.catalog_query import CatalogQuery
from iop_edge.core.snapshot import Snapshot
from schemas.catalog import CatalogModel, CatalogProvider, CatalogSummary
from schemas.wire import Health

__all__ = ["SCAN", "SLICE", "CatalogSource", "catalog_chunks", "catalog_summary"]

#: Provider records built per step (Rule 1).
SLICE: Final = 256
#: Providers whose health a step looks at, at most (Rule 1).
SCAN: Final = 4096

_encode = msgspec.json.Encoder().encode


class CatalogSource(Protocol):
    """What the catalog is read from (the scheduler)."""

    @property
    def snapshot(self) -> Snapshot: ...

    def catalog_models(self, model_ids: Iterable[str] | None = None) -> list[CatalogModel]: ...

    def catalog_providers(self, provider_ids: Iterable[str]) -> list[CatalogProvider]: ...

    def catalog_health(self, provider_id: str) -> Health | None: ...


async def catalog_chunks(source: CatalogSource, query: CatalogQuery) -> AsyncIterator[bytes]:
    """The catalog `query` selects, as JSON in pieces (module Rules 1-3)."""
    snapshot = source.snapshot
    models = source.catalog_models(None if query.model is None else (query.model,))
    yield b'{"revision":%d,"models":%b,"providers":[' % (snapshot.revision, _encode(models))
    selection = _Selection(query, query.candidates(snapshot), source.catalog_health)
    written = 0
    last: str | None = None
    limit = query.limit
    while limit is None or written < limit:
        ids = await selection.take(SLICE if limit is None else min(SLICE, limit - written))
        if not ids:
            break
        last = ids[-1]
        records = source.catalog_providers(ids)
        if records:
            body = _encode(records)[1:-1]  # the list's items, without its brackets
            yield body if written == 0 else b"," + body
            written += len(records)
        await trio.lowlevel.checkpoint()  # Rule 1: the next slice is another step
    following = last if limit is not None and await selection.more() else None
    yield b'],"next":%b}' % _encode(following)


async def catalog_summary(source: CatalogSource) -> CatalogSummary:
    """Providers counted by health, `SCAN` looks a step (Rule 1)."""
    snapshot = source.snapshot
    order = snapshot.provider_order
    counts: Counter[str] = Counter()
    for start in range(0, len(order), SCAN):
        if start:
            await trio.lowlevel.checkpoint()
        for provider_id in order[start : start + SCAN]:
            health = source.catalog_health(provider_id)
            if health is not None:
                counts[health] += 1
    return CatalogSummary(
        revision=snapshot.revision,
        models=len(snapshot.models),
        nodes=len(snapshot.nodes),
        providers=sum(counts.values()),
        by_health=dict(sorted(counts.items())),
    )


class _Selection:
    """The query's providers, found a window of `SCAN` candidates at a time (Rule 1)."""

    def __init__(
        self,
        query: CatalogQuery,
        candidates: Sequence[str],
        health_of: Callable[[str], Health | None],
    ) -> None:
        self._query = query
        self._candidates = candidates
        self._health_of = health_of
        self._position = 0
        self._found: deque[str] = deque()

    async def _find(self, count: int) -> None:
        """Scan windows until `count` are found or the candidates end."""
        while len(self._found) < count and self._position < len(self._candidates):
            window = self._candidates[self._position : self._position + SCAN]
            self._position += len(window)
            self._found.extend(self._query.select(window, self._health_of))
            if len(self._found) < count and self._position < len(self._candidates):
                await trio.lowlevel.checkpoint()

    async def take(self, count: int) -> list[str]:
        """Up to `count` more selected ids, fewer only once the candidates end."""
        await self._find(count)
        return [self._found.popleft() for _ in range(min(count, len(self._found)))]

    async def more(self) -> bool:
        """Whether another selected id follows what was taken."""
        await self._find(1)
        return bool(self._found)
