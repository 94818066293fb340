"""A run's plan carries its affinity only when its model has providers to choose between:
a model with one provider routes every run to it, so its runs neither hash their prompt
nor record it in the prefix index (the scheduler records only a run's affinity)."""

from __future__ import annotations

from typing import Any

from iop_edge.core.routing.affinity import affinity_of, chat_conversation
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.auth import ANONYMOUS
from iop_edge.http.protocols.caller_protocol import Caller
from iop_edge.http.protocols.chat import CHAT, plan_chat
from schemas.config import EdgeConfig, ModelEntry, NodeEntry, ProviderConfig, RoutingPolicy

HASH = "0" * 64


def _snapshot() -> Snapshot:
    """`solo` on one provider, `pair` on two, `plain` on two but routed by load alone."""
    providers = [
        ProviderConfig(id=pid, type="sim", models=["served"], capacity=4) for pid in ("p1", "p2")
    ]
    config = EdgeConfig(
        models=[
            ModelEntry(id="solo", providers={"p1": "served"}),
            ModelEntry(id="pair", providers={"p1": "served", "p2": "served"}),
            ModelEntry(
                id="plain",
                providers={"p1": "served", "p2": "served"},
                routing=RoutingPolicy(affinity=False),
            ),
        ],
        nodes=[NodeEntry(id="n", token_hash_sha256=HASH, providers=providers)],
    )
    return Snapshot.build(config, revision=1, config_sha256=HASH)


def _body(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Fix the failing test."},
        ],
    }


def _caller(**sessions: str) -> Caller:
    return Caller(
        run_id="req_1",
        request_id="req_1",
        principal=ANONYMOUS,
        anthropic_headers={},
        session_headers=sessions,
    )


def test_a_model_with_several_providers_plans_its_runs_affinity() -> None:
    snapshot = _snapshot()
    body = _body("pair")
    plan = plan_chat("chat", body, snapshot, _caller())
    expected = affinity_of(
        chat_conversation, body, {}, principal=ANONYMOUS.principal_ref, model="pair"
    )
    assert plan.affinity == expected
    assert plan.affinity is not None and plan.affinity.blocks


def test_a_model_with_one_provider_plans_no_affinity_even_with_a_session() -> None:
    snapshot = _snapshot()
    plan = plan_chat("chat", _body("solo"), snapshot, _caller(**{"x-session-id": "s-1"}))
    assert plan.affinity is None
    assert plan.protocol == CHAT.name and plan.model_id == "solo"


def test_a_model_routed_by_load_alone_plans_no_affinity() -> None:
    assert plan_chat("chat", _body("plain"), _snapshot(), _caller()).affinity is None
