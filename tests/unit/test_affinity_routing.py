"""Cache affinity in the scheduler: conversations keep their provider, the load bound
holds, several Edges agree, principals stay apart, a refresh hands sessions on.

Time is virtual (`autojump_clock`); nothing sleeps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio
import trio.testing

from iop_edge.core.routing.affinity import Affinity, affinity_of, rendezvous_order
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.runs.lease import Lease
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas.config import (
    DispatchSection,
    EdgeConfig,
    ModelEntry,
    NodeEntry,
    ProviderConfig,
    RoutingPolicy,
)
from tests.unit.test_affinity import chat_turns

HASH = "0" * 64
IDS = ("a1", "a2", "b1", "b2")


def snapshot(
    ids: Sequence[str] = IDS, *, routing: RoutingPolicy | None = None, capacity: int = 4
) -> Snapshot:
    """One model `m` over providers on two Nodes (`a*` on node `na`, `b*` on `nb`)."""
    nodes = {
        node: [
            ProviderConfig(id=pid, type="sim", models=["served"], capacity=capacity)
            for pid in ids
            if pid.startswith(node[1])
        ]
        for node in ("na", "nb")
    }
    config = EdgeConfig(
        dispatch=DispatchSection(max_queue=64, queue_timeout_ms=60_000),
        models=[
            ModelEntry(
                id="m",
                providers=dict.fromkeys(ids, "served"),
                routing=routing or RoutingPolicy(),
            )
        ],
        nodes=[
            NodeEntry(id=node, token_hash_sha256=HASH, providers=providers)
            for node, providers in nodes.items()
        ],
    )
    return Snapshot.build(config, revision=1, config_sha256=HASH)


def online(snap: Snapshot) -> Scheduler:
    scheduler = Scheduler(snap)
    for node_id in snap.nodes:
        scheduler.node_connected(node_id)
    for pid in snap.providers:
        scheduler.provider_status(pid, "available", ["served"])
    return scheduler


def of(body: dict[str, Any], principal: str = "alice", **headers: str) -> Affinity:
    return affinity_of("chat", body, headers, principal=principal, model="m")


async def run(scheduler: Scheduler, affinity: Affinity | None, principal: str = "alice") -> str:
    """One run that takes its slot and ends at once: the provider it went to."""
    with await scheduler.acquire(
        "m", "r", long=False, affinity=affinity, principal=principal
    ) as lease:
        return lease.provider_id


async def fill(scheduler: Scheduler, provider_id: str, runs: int) -> list[Lease]:
    """`runs` runs without affinity held on `provider_id` (the others' runs released)."""
    leases = [await scheduler.acquire("m", f"fill{n}", long=False) for n in range(4 * runs)]
    held = [lease for lease in leases if lease.provider_id == provider_id]
    assert len(held) == runs  # round-robin over four idle providers
    for lease in leases:
        if lease not in held:
            lease.release()
    return held


async def test_a_conversations_turns_land_on_one_provider() -> None:
    scheduler = online(snapshot())
    for first in ("fix the test", "write the docs", "plan the release"):
        landed = {await run(scheduler, of(body)) for body in chat_turns(first, 6)}
        assert len(landed) == 1
    # with a session header, every turn lands on the session's provider whatever it sends
    chosen = {
        await run(scheduler, of(body, **{"x-claude-code-session-id": "s-1"}))
        for body in (*chat_turns("one", 3), *chat_turns("two", 3))
    }
    assert len(chosen) == 1


async def test_without_affinity_turns_take_turns() -> None:
    scheduler = online(snapshot(routing=RoutingPolicy(affinity=False)))
    landed = [await run(scheduler, of(body)) for body in chat_turns("fix the test", 4)]
    assert sorted(landed) == sorted(IDS)  # round-robin over idle providers


async def test_a_busy_cached_provider_does_not_hold_a_run_another_could_take() -> None:
    scheduler = online(snapshot())
    turns = chat_turns("fix the test", 3)
    home = await run(scheduler, of(turns[0]))
    # others' runs fill its provider two runs beyond the idlest: beyond the 0.25 bound
    held = await fill(scheduler, home, 2)
    moved = await run(scheduler, of(turns[1]))
    assert moved != home
    # it now holds the conversation's longest prefix: the next turn stays with it,
    # although the rendezvous choice is idle again
    for lease in held:
        lease.release()
    assert await run(scheduler, of(turns[2])) == moved


async def test_one_hot_prompt_spreads_over_the_providers() -> None:
    """Runs of one prompt held at once: its provider is never more than the bound
    ahead; sent again and again one at a time, it takes turns like any run."""
    scheduler = online(snapshot())
    body = chat_turns("the same prompt for everyone", 1)[0]
    one_at_a_time = [await run(scheduler, of(body)) for _ in range(8)]
    assert sorted(one_at_a_time) == sorted(IDS * 2)
    leases: list[Lease] = [
        await scheduler.acquire("m", f"r{n}", long=False, affinity=of(body)) for n in range(12)
    ]
    per_provider = {pid: 0 for pid in IDS}
    for lease in leases:
        per_provider[lease.provider_id] += 1
    assert max(per_provider.values()) - min(per_provider.values()) <= 2
    assert min(per_provider.values()) >= 2
    for lease in leases:
        lease.release()


async def test_two_edges_sharing_the_nodes_agree() -> None:
    """Two schedulers with nothing shared but the config: each conversation's turns,
    sent alternately to one and the other, land on one provider."""
    edges = (online(snapshot()), online(snapshot()))
    for n, first in enumerate(("fix the test", "write the docs", "plan", "ship", "review")):
        landed = {
            await run(edges[(n + turn) % 2], of(body))
            for turn, body in enumerate(chat_turns(first, 4))
        }
        assert len(landed) == 1, first


async def test_another_principals_identical_prompt_does_not_follow() -> None:
    """Bob's runs go where they would on an Edge that never saw Alice's: her history
    steers nothing of his."""
    turns = chat_turns("fix the test", 3)
    body = turns[1]
    seen = online(snapshot())
    fresh = online(snapshot())
    alice = of(body, "alice")
    # Alice's conversation is moved off its rendezvous choice (that one is busy) ...
    first = rendezvous_order(alice.key, IDS)[0]
    busy = await fill(seen, first, 2)
    alice_home = await run(seen, alice, "alice")
    assert alice_home != first
    for lease in busy:
        lease.release()
    assert await run(seen, of(turns[2], "alice"), "alice") == alice_home  # ... and stays
    bob = of(body, "bob")
    assert await run(seen, bob, "bob") == await run(fresh, bob, "bob")
    # shared per model, Bob's prompt that continues Alice's does follow hers
    seen_shared = online(snapshot(routing=RoutingPolicy(shared_prefixes=True)))

    def shared(body: dict[str, Any], principal: str) -> Affinity:
        return affinity_of("chat", body, {}, principal=principal, model="m", shared_prefixes=True)

    shared_first = rendezvous_order(shared(body, "alice").key, IDS)[0]
    busy = await fill(seen_shared, shared_first, 2)
    alice_home = await run(seen_shared, shared(body, "alice"), "alice")
    assert alice_home != shared_first
    for lease in busy:
        lease.release()
    assert await run(seen_shared, shared(turns[2], "bob"), "bob") == alice_home


async def test_a_refresh_that_removes_a_provider_hands_its_sessions_on() -> None:
    scheduler = online(snapshot())
    sessions = [of({"messages": []}, **{"x-session-id": f"s{n}"}) for n in range(40)]
    before = [await run(scheduler, session) for session in sessions]
    gone = before[0]
    remaining = tuple(pid for pid in IDS if pid != gone)
    scheduler.apply_snapshot(snapshot(remaining))
    after = [await run(scheduler, session) for session in sessions]
    for session, was, now in zip(sessions, before, after, strict=True):
        if was == gone:
            assert now == rendezvous_order(session.key, IDS)[1]
        else:
            assert now == was


async def test_a_full_pool_queues_and_the_waiter_gets_the_slot_that_frees() -> None:
    scheduler = online(snapshot(capacity=1))
    held = [await scheduler.acquire("m", f"x{n}", long=False) for n in range(4)]
    body = chat_turns("fix the test", 1)[0]
    got: list[str] = []

    async def waiter() -> None:
        got.append(await run(scheduler, of(body)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        free = rendezvous_order(of(body).key, IDS)[-1]  # not its choice: still taken
        next(lease for lease in held if lease.provider_id == free).release()
    assert got == [free]
    for lease in held:
        lease.release()
