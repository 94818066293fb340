"""The Edge's immutable runtime snapshot: everything a request reads from config.

A snapshot is built purely from a validated `EdgeConfig` and never mutated. Refresh builds
a new one and swaps a single reference (no await in between), so a request sees the old
snapshot or the new one, never a mix. Mutable runtime state (slots, health, connections)
lives elsewhere and outlives snapshots.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Final

from iop_edge.core.lifecycle import idle_rules
from iop_edge.core.principals import PrincipalPolicies
from schemas.config import (
    EdgeConfig,
    IdleRule,
    ModelEntry,
    NodeConfig,
    NodeEntry,
    PrincipalToken,
    ProviderConfig,
)

#: Nodes `Snapshot.building` looks at between two of its steps.
STEP_NODES: Final = 128
#: Models' provider entries `Snapshot.building` looks at between two of its steps: a
#: fleet's models list tens of thousands, and each lookup made from them would take a
#: step of several milliseconds.
STEP_ENTRIES: Final = 1024


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    max_queue: int
    queue_timeout_s: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    config: EdgeConfig
    revision: int
    config_sha256: str
    models: dict[str, ModelEntry] = field(default_factory=dict)
    providers: dict[str, ProviderConfig] = field(default_factory=dict)
    provider_node: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, NodeEntry] = field(default_factory=dict)
    principals: dict[str, PrincipalToken] = field(default_factory=dict)
    """Principal tokens keyed by their sha256 hex."""
    policies: PrincipalPolicies = field(default_factory=lambda: PrincipalPolicies([]))
    """Each principal's limits and allow-list (`principals[]`)."""
    node_providers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Each node's provider ids, in config order."""
    provider_models: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """The models each provider serves (`models[].providers`), in config order."""
    rivals: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """For each model, every model that shares a provider with it (itself included), in
    config order: whose waiters a slot freed for this model's providers may serve."""
    provider_order: tuple[str, ...] = ()
    """Every provider id, sorted: the catalog's order."""
    rotations: dict[str, tuple[tuple[str, ProviderConfig, str], ...]] = field(default_factory=dict)
    """For each model, its providers in config order, each with its config and Node: what
    a decision reads of every one of them (`runtime.runs.scheduler`)."""
    idle: dict[str, tuple[IdleRule, ...]] = field(default_factory=dict)
    """Each Node's idle rules (`core.lifecycle` Rule 1)."""

    @classmethod
    def build(cls, config: EdgeConfig, *, revision: int, config_sha256: str) -> Snapshot:
        """Everything a request or the scheduler looks up, worked out once."""
        steps = cls.building(config, revision=revision, config_sha256=config_sha256)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                snapshot: Snapshot = done.value
                return snapshot

    @classmethod
    def building(
        cls, config: EdgeConfig, *, revision: int, config_sha256: str
    ) -> Generator[None, None, Snapshot]:
        """`build` in steps of `STEP_NODES` Nodes or `STEP_ENTRIES` models' provider
        entries: it yields between them and returns the snapshot. For a fleet's config
        the whole is a hundred milliseconds or more; the refresh that builds it on the
        event loop lets the loop run between steps of a millisecond or two."""
        providers: dict[str, ProviderConfig] = {}
        provider_node: dict[str, str] = {}
        node_providers: dict[str, tuple[str, ...]] = {}
        nodes: dict[str, NodeEntry] = {}
        for index, node in enumerate(config.nodes):
            if index % STEP_NODES == STEP_NODES - 1:
                yield
            nodes[node.id] = node
            for provider in node.providers:
                providers[provider.id] = provider
                provider_node[provider.id] = node.id
            node_providers[node.id] = tuple(provider.id for provider in node.providers)
        entries = itertools.count(1)  # models' provider entries looked at
        serving: dict[str, list[str]] = {}
        for model in config.models:
            for provider_id in model.providers:
                if next(entries) % STEP_ENTRIES == 0:
                    yield
                serving.setdefault(provider_id, []).append(model.id)
        provider_models: dict[str, tuple[str, ...]] = {}
        for provider_id, models in serving.items():
            if next(entries) % STEP_ENTRIES == 0:
                yield
            provider_models[provider_id] = tuple(models)
        rivals: dict[str, tuple[str, ...]] = {}
        for model in config.models:
            shared: dict[str, None] = {}
            for provider_id in model.providers:
                if next(entries) % STEP_ENTRIES == 0:
                    yield
                shared.update(dict.fromkeys(provider_models[provider_id]))
            rivals[model.id] = tuple(shared) or (model.id,)
        rotations: dict[str, tuple[tuple[str, ProviderConfig, str], ...]] = {}
        for model in config.models:
            rotation: list[tuple[str, ProviderConfig, str]] = []
            for provider_id in model.providers:
                if next(entries) % STEP_ENTRIES == 0:
                    yield
                if provider_id in providers:
                    rotation.append(
                        (provider_id, providers[provider_id], provider_node[provider_id])
                    )
            rotations[model.id] = tuple(rotation)
        yield
        provider_order = tuple(sorted(providers))
        yield
        idle = idle_rules(config.models, provider_node)
        yield
        policies = PrincipalPolicies.from_config(config)
        yield
        return cls(
            config=config,
            revision=revision,
            config_sha256=config_sha256,
            models={model.id: model for model in config.models},
            providers=providers,
            provider_node=provider_node,
            nodes=nodes,
            principals={t.token_hash_sha256: t for t in config.openai.principal_tokens},
            policies=policies,
            node_providers=node_providers,
            provider_models=provider_models,
            rivals=rivals,
            provider_order=provider_order,
            rotations=rotations,
            idle=idle,
        )

    @property
    def long_context_threshold_tokens(self) -> int:
        return self.config.openai.long_context_threshold_tokens

    def queue_policy(self, model_id: str) -> QueuePolicy:
        """The model's queue override where set, else the `dispatch` defaults."""
        dispatch = self.config.dispatch
        override = self.models[model_id].queue if model_id in self.models else None
        max_queue = dispatch.max_queue
        timeout_ms = dispatch.queue_timeout_ms
        if override is not None:
            if override.max_queue is not None:
                max_queue = override.max_queue
            if override.queue_timeout_ms is not None:
                timeout_ms = override.queue_timeout_ms
        return QueuePolicy(max_queue=max_queue, queue_timeout_s=timeout_ms / 1000)

    def node_config(self, node_id: str) -> NodeConfig:
        node = self.nodes.get(node_id)
        return NodeConfig(
            node_id=node_id,
            providers=list(node.providers) if node else [],
            idle=list(self.idle.get(node_id, ())),
        )
