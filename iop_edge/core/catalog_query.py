"""Which providers a `GET /catalog` shows: filters and pages over a fleet's pool (design §6).

A fleet of ten thousand Nodes has thirty thousand providers: an operator looks for one
Node, one model, or what is unavailable, and a client reads the rest a page at a time.
Pure: the query is read from the request's arguments, and the providers it selects are
worked out from the running snapshot and each provider's health, which the caller reads
from the scheduler.

Rules:
1. Providers are listed sorted by id (the snapshot's `provider_order`).
2. `model=M` keeps the providers of model M (its `providers` map); `node=N` those of Node
   N; `health=H` those whose catalog health is H (`schemas.wire.Health`; a provider
   whose Node is not connected is `unavailable`). Filters combine (all must hold). An
   unknown model or Node selects nothing, which is an answer, not an error: configs
   change.
3. `limit=K` (1..`MAX_LIMIT`) makes a page: at most K providers, and `next`, the cursor of
   the page after it, or null on the last page. Without `limit` every selected provider
   is listed and `next` is null.
4. `cursor=C` starts after provider id C (the `next` of the page before). A cursor is a
   provider id, not a position: a provider added or removed between two pages moves no
   other provider to the wrong page.
5. A malformed argument is an error that names it and says what it takes; an argument
   this module does not know is an error too (a typo must not return the whole fleet).
"""

from __future__ import annotations

import bisect
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from iop_edge.core.snapshot import Snapshot
from schemas.wire import Health

__all__ = ["MAX_LIMIT", "CatalogQuery", "CatalogQueryError"]

#: The largest page (Rule 3).
MAX_LIMIT: Final = 5000
_HEALTHS: Final[tuple[str, ...]] = typing.get_args(Health)
_ARGUMENTS: Final = ("model", "node", "health", "limit", "cursor")


class CatalogQueryError(ValueError):
    """A catalog query argument that cannot be used; the message names it (Rule 5)."""


@dataclass(frozen=True, slots=True)
class CatalogQuery:
    """One `GET /catalog`'s filters and page (module Rules 2-4)."""

    model: str | None = None
    node: str | None = None
    health: Health | None = None
    limit: int | None = None
    cursor: str | None = None

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, str]) -> CatalogQuery:
        """The query of a request's arguments; raises `CatalogQueryError` (Rule 5)."""
        unknown = sorted(set(arguments) - set(_ARGUMENTS))
        if unknown:
            raise CatalogQueryError(
                f"unknown catalog argument(s) {', '.join(unknown)}; use " + ", ".join(_ARGUMENTS)
            )
        health = arguments.get("health") or None
        if health is not None and health not in _HEALTHS:
            raise CatalogQueryError(f"health must be one of {', '.join(_HEALTHS)}")
        limit_text = arguments.get("limit") or None
        limit: int | None = None
        if limit_text is not None:
            try:
                limit = int(limit_text)
            except ValueError:
                raise CatalogQueryError(f"limit must be a whole number, 1..{MAX_LIMIT}") from None
            if not 1 <= limit <= MAX_LIMIT:
                raise CatalogQueryError(f"limit must be 1..{MAX_LIMIT}")
        return cls(
            model=arguments.get("model") or None,
            node=arguments.get("node") or None,
            health=typing.cast(Health | None, health),
            limit=limit,
            cursor=arguments.get("cursor") or None,
        )

    @property
    def filtered(self) -> bool:
        """Whether the query narrows the pool or pages it (else: the whole catalog)."""
        return any(value is not None for value in (self.model, self.node, self.health)) or (
            self.limit is not None or self.cursor is not None
        )

    def candidates(self, snapshot: Snapshot) -> Sequence[str]:
        """The provider ids the model and Node filters and the cursor leave, sorted
        (Rules 1, 2, 4); health is judged as they are read (`select`)."""
        order = snapshot.provider_order
        if self.model is not None or self.node is not None:
            kept: set[str] | None = None
            if self.model is not None:
                model = snapshot.models.get(self.model)
                kept = set(model.providers) if model is not None else set()
            if self.node is not None:
                of_node = set(snapshot.node_providers.get(self.node, ()))
                kept = of_node if kept is None else kept & of_node
            chosen = sorted(pid for pid in kept or () if pid in snapshot.providers)
            if self.cursor is not None:
                chosen = chosen[bisect.bisect_right(chosen, self.cursor) :]
            return chosen
        start = 0 if self.cursor is None else bisect.bisect_right(order, self.cursor)
        return order[start:]

    def select(
        self, candidates: Sequence[str], health_of: Callable[[str], Health | None]
    ) -> Iterator[str]:
        """The `candidates` whose health matches (Rule 2), in order; `health_of` answers
        None for a provider that is gone."""
        wanted = self.health
        for provider_id in candidates:
            health = health_of(provider_id)
            if health is not None and (wanted is None or health == wanted):
                yield provider_id
