"""The models a refresh gave providers whose Nodes have not applied it yet (design §5 step 6).

A refresh takes effect on the Edge in one step (the snapshot swap) and on each Node when
that Node has built the providers of its push. A run the Edge sends in between reaches the
Node ahead of its config (the push follows the swap), so a model the refresh gave a
provider would not be served there yet. The scheduler asks this book before it sends one.

Rules:
1. A model is *added* to a provider when a swap gives the provider a served name its
   `models` did not have (or gives the Edge the provider: it was not in the old snapshot).
   Each added (provider, served name) is kept for the provider's Node with the new
   snapshot's revision. Only the Nodes whose entry the swap changed are looked into: a
   refresh keeps the very entries of the others, so a fleet's swap costs what changed;
   and a changed provider's served names are compared before they are set apart (a
   refresh of every provider's capacity, in one step of the loop, sets apart none).
   A Node the new snapshot does not have is forgotten.
2. A Node that *applies* revision R (its `refresh_ack` says ok, or it was welcomed with
   R) has every model added up to R: they are forgotten.
3. Until then the added model is `pending` on that provider (`core.routing.pool` Rule 3:
   eligible, not admissible; its runs go elsewhere or wait for the ack). Once the Node
   *refuses* a revision at least as new as the one that added it, it is `refused` there
   (Rule 2: ineligible, so its runs are refused saying so rather than wait), until the
   Node applies a revision that has it (the refresh's catch-up pushes it again).
4. Everything else is `applied`: the book is empty between refreshes, and a decision
   then pays one truth test for it.
"""

from __future__ import annotations

from iop_edge.core.routing.pool import Applied
from iop_edge.core.snapshot import Snapshot
from schemas.catalog import Unapplied

__all__ = ["UnappliedModels"]

_Added = tuple[str, str]
"""A provider id and a served name it was given."""


class UnappliedModels:
    """Per Node, the models added to its providers that it has not applied (see the
    module docstring)."""

    def __init__(self) -> None:
        self._added: dict[str, dict[_Added, int]] = {}
        """Per node id: each model added to one of its providers, with the revision that
        added it (Rule 1)."""
        self._refused: dict[str, int] = {}
        """Per node id in `_added`: the newest revision it refused (Rule 3)."""

    def __bool__(self) -> bool:
        return bool(self._added)

    def swapped(self, old: Snapshot, new: Snapshot) -> None:
        """Keep what `new` adds to `old` (Rule 1)."""
        if old is new:
            return
        for gone in [node_id for node_id in self._added if node_id not in new.nodes]:
            del self._added[gone]  # out of config: nothing of it is routed
            self._refused.pop(gone, None)
        before = old.nodes
        for node_id, node in new.nodes.items():
            if before.get(node_id) is node:
                continue
            for config in node.providers:
                was = old.providers.get(config.id)
                if was is not None and config.models == was.models:
                    continue  # a fleet's refresh of capacities: compared, not set apart
                names = set(config.models).difference(was.models if was is not None else ())
                if names:
                    added = self._added.setdefault(node_id, {})
                    added.update(dict.fromkeys(((config.id, name) for name in names), new.revision))

    def applied(self, node_id: str, revision: int) -> list[str]:
        """Node `node_id` runs `revision` (Rule 2): the providers whose models it now has."""
        added = self._added.get(node_id)
        if added is None:
            return []
        done = [key for key, since in added.items() if since <= revision]
        for key in done:
            del added[key]
        if not added:
            del self._added[node_id]
            self._refused.pop(node_id, None)
        return list(dict.fromkeys(provider_id for provider_id, _ in done))

    def refused(self, node_id: str, revision: int) -> list[str]:
        """Node `node_id` refused `revision` (Rule 3): the providers with models it lacks."""
        added = self._added.get(node_id)
        if added is None:
            return []
        self._refused[node_id] = max(self._refused.get(node_id, 0), revision)
        return list(dict.fromkeys(provider_id for provider_id, _ in added))

    def of(self, node_id: str, provider_id: str) -> dict[str, Unapplied]:
        """The served names of `provider_id` its Node has not applied, and how (the
        catalog's `unapplied`), by name."""
        added = self._added.get(node_id)
        if added is None:
            return {}
        return {
            served: self._standing(node_id, since)
            for (provider, served), since in sorted(added.items())
            if provider == provider_id
        }

    def state(self, node_id: str, provider_id: str, served: str) -> Applied:
        """Whether the Node runs a config that gives `provider_id` the name `served`."""
        added = self._added.get(node_id)
        since = None if added is None else added.get((provider_id, served))
        return "applied" if since is None else self._standing(node_id, since)

    def _standing(self, node_id: str, since: int) -> Unapplied:
        """Rule 3: a model added by revision `since`, not applied yet by the Node."""
        return "refused" if self._refused.get(node_id, 0) >= since else "pending"
