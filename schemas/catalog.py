"""Catalog records (design §6): what `GET /catalog` and `iop-edge catalog` show.

The Edge's scheduler builds one `Catalog` on demand from its live state; the admin API
encodes it as JSON and the CLI renders it as a table, so both read the very same
records. Every record is frozen and keyword-only; lists are never null (an empty list
is an answer, a null is a question) and are sorted by id so two catalogs diff cleanly.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.config import Category, ProviderType
from schemas.protocols import CallerProtocol
from schemas.wire import Health, ModelLoadState, ModelState

Unapplied = Literal["pending", "refused"]
"""How a provider's Node stands with a served name a refresh gave the provider: it has
not acked the refresh yet, or it refused it (`CatalogProvider.unapplied`)."""


class CatalogRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Base of every catalog record: immutable, keyword-only.

    Not tracked by the cycle collector (`gc=False`): a record holds strings, numbers,
    lists of strings and other records, never a cycle, and a catalog of thousands of
    providers, built on every request, would otherwise push the collector into full
    collections of the whole heap."""


class CatalogLifecycle(CatalogRecord, frozen=True, kw_only=True):
    """Coarse lifecycle capabilities: declared in config (`lifecycle: [...]`) or found in
    the runtime's API by the provider's Node."""

    list_models: bool = False
    load_model: bool = False
    unload_model: bool = False
    pull_model: bool = False
    delete_model: bool = False


class CatalogProvider(CatalogRecord, frozen=True, kw_only=True):
    """One provider as the dispatch pool sees it right now."""

    id: str
    node_id: str
    type: ProviderType
    category: Category
    enabled: bool
    connected: bool
    health: Health
    """`unavailable` whenever the provider's node is disconnected."""
    health_reason: str | None = None
    """Why the provider is not `available` (or cannot take runs although it is: cooling
    down, disabled); null when it is fully in the pool."""
    capacity: int
    in_flight: int
    """Runs on the provider: this Edge's, plus those other Edges hold (as its Node last
    reported, `other_edges_in_flight`)."""
    load_ratio: float | None
    """`in_flight / capacity`; null when the capacity is unknown."""
    long_context_slots: int | None
    long_in_flight: int
    other_edges_in_flight: int = 0
    """Of `in_flight`, the runs other Edges sharing the provider's Node hold."""
    models: list[str] = []
    """Served model names from config: what the Edge routes to this provider."""
    discovered_models: list[str] = []
    """Served model names the Node last reported in its `status` message."""
    queued: int = 0
    """Requests waiting in a model queue that this provider could serve."""
    priority: int = 100
    lifecycle: CatalogLifecycle = CatalogLifecycle()
    """The lifecycle flags declared in config."""
    discovered_lifecycle: CatalogLifecycle | None = None
    """The lifecycle operations the runtime's API offers, as the Node last reported them
    (Ollama: from its native API); null when the adapter cannot tell."""
    cooling_down: bool = False
    consecutive_failures: int = 0
    rate_limited_s: float | None = None
    """While its upstream asked, by a 429/503's `Retry-After`, to be left alone: the
    seconds still to run (it takes no runs meanwhile, design §4); null otherwise."""
    protocols: list[CallerProtocol] = []
    """The caller protocols it speaks natively (design §14), as its Node last reported
    them, else as configured (`adapter.protocols` or the type's default); it serves the
    others translated to chat by its Node."""
    model_states: list[ModelState] | None = None
    """Each served model's load state in the runtime (`loaded`, `loading`, `unloaded`,
    `sleeping`, `failed` with a reason; design §18), as its Node last reported them; null
    when the runtime does not say (its models count as loaded)."""
    max_loaded: int | None = None
    """How many models the runtime keeps loaded at once, where it says (llama.cpp's
    `--models-max`)."""
    pinned: list[str] = []
    """The served models pinned on it (`models[].lifecycle.keep_loaded`, the operator's
    `iop-edge models pin`; design §18.4), sorted."""
    cached_share: float | None = None
    """Of the prompt tokens its runtime reported over its recent runs, the share it took
    from its prefix cache (0..1, recent runs weighing most: `core.routing.cache_share`); null
    before it reported any."""
    unapplied: dict[str, Unapplied] = {}
    """Served names a refresh gave it that its Node does not serve yet (design §5 step
    6): `pending` until the Node acks the refresh (runs go elsewhere or wait), `refused`
    when the Node refused it (runs are refused saying so); empty when the Node runs them
    all."""


class CatalogModel(CatalogRecord, frozen=True, kw_only=True):
    """One logical model id callers may name, and the providers that serve it."""

    id: str
    display_name: str | None = None
    providers: dict[str, str] = {}
    """Provider id -> the served model name a run on that provider targets."""
    queued: int = 0


class Catalog(CatalogRecord, frozen=True, kw_only=True):
    revision: int
    models: list[CatalogModel] = []
    providers: list[CatalogProvider] = []
    next: str | None = None
    """A page's cursor for the page after it (`GET /catalog?limit=&cursor=`); null on
    the last page and when the catalog is not paged."""


class CatalogSummary(CatalogRecord, frozen=True, kw_only=True):
    """The pool in a few numbers (`GET /catalog/summary`): what a page shows of a fleet
    before it lists anyone."""

    revision: int
    models: int
    nodes: int
    providers: int
    by_health: dict[str, int] = {}
    """Providers per catalog health (`unavailable` while their Node is not connected)."""


# --- models on demand: the operator's commands (design §18) ------------------------------

ModelCommandAction = Literal["load", "unload", "pin", "unpin"]
ModelCommandOutcome = Literal["done", "failed", "unknown", "no_provider", "refused"]
"""`done`: every provider acted on did it; `failed`: one did not (its result says why);
`unknown`: the model, or the provider named, is not in the catalog; `no_provider`: no
provider of the model could take the load (`error` says why of each); `refused`: an
unload where the model is pinned (its result says so; the others were unloaded)."""


class ModelCommandRequest(CatalogRecord, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /models/load` or `/models/unload`: a catalog model, and the provider to act
    on; without one, a load picks a provider (one that holds it already, else one with
    room, else the least recently used idle one) and an unload acts on every provider
    that holds it."""

    model: str
    provider: str | None = None


class ModelCommandResult(CatalogRecord, frozen=True, kw_only=True):
    """What one provider's runtime did."""

    provider: str
    served_model: str
    ok: bool
    error: str | None = None


class ModelCommandReport(CatalogRecord, frozen=True, kw_only=True):
    """The answer to a load or unload: each provider acted on, and how it went."""

    action: ModelCommandAction
    model: str
    outcome: ModelCommandOutcome
    results: list[ModelCommandResult] = []
    error: str | None = None
    """Why nothing was done (an unknown model, no provider could act)."""


class ProviderLoadState(CatalogRecord, frozen=True, kw_only=True):
    """One provider serving a model, and the model's load state in its runtime: every
    field is present, null where it is not known."""

    provider: str
    node: str
    served_model: str
    """The name the model has on this provider (`models[].providers`' value)."""
    connected: bool
    state: ModelLoadState | None = None
    """As the runtime last reported it; null when the runtime does not say."""
    reason: str | None = None
    """The runtime's reason for `state` (a failed load's), when it gave one."""
    max_loaded: int | None = None
    """How many models the runtime keeps loaded at once, where it says."""
    pinned: bool = False
    """Whether the model is pinned on this provider (`models[].lifecycle.keep_loaded`, or
    the operator's `POST /models/pin`)."""


class ModelLoadStates(CatalogRecord, frozen=True, kw_only=True):
    """One catalog model and, per provider serving it, its load state."""

    model: str
    providers: list[ProviderLoadState] = []
    """Sorted by provider id."""


class ModelsReport(CatalogRecord, frozen=True, kw_only=True):
    """`GET /models` (design §18): every catalog model, sorted by id."""

    models: list[ModelLoadStates] = []
