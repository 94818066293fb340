"""Two Edge replicas behind a real L4 balancer, two Nodes linked to both (design §13).

Each replica is its own `iop-edge serve` process with the same config file (every
listener on port 0, so each binds its own ports; they share the `state_dir`, and so the
SQLite ledger and the replica roster). HAProxy (TCP mode) balances callers over the two
OpenAI listeners. The Nodes run in the test, linked to both replicas' node listeners, so
the test can see which runs each replica holds and every slot count.

Under mixed load one replica is killed (SIGKILL: no goodbye). Then:
- every request that failed was in flight at the kill, and every failed stream whose run
  id is known ran on the killed replica;
- callers retrying through the balancer (the SDK's own retries) succeed afterwards;
- no slot leaks on either Node, and the surviving replica no longer counts the dead
  one's runs; capacity was never exceeded.
"""

from __future__ import annotations

import signal
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import trio
import yaml

from iop_node.main import run_node
from iop_node.uplink.edges import EdgeLinks
from tests.e2e.balancer import require_haproxy, start_balancer
from tests.e2e.processes import MixedLoad, admin_get, start_edge, stop_pid
from tests.e2e.stack import NODE_TOKEN, NODE_TOKEN_HASH

CAPACITY = 6


def _config(state_dir: Path) -> dict[str, Any]:
    def node(index: int) -> dict[str, Any]:
        return {
            "id": f"node-{index}",
            "token_hash_sha256": NODE_TOKEN_HASH,
            "providers": [
                {
                    "id": f"sim-{index}",
                    "type": "sim",
                    "models": ["sim-small"],
                    "capacity": CAPACITY,
                    "adapter": {"ttft_ms": 5, "tokens_per_second": 100},
                }
            ],
        }

    return {
        "edge": {"id": "edge-replica", "listen": "127.0.0.1:0", "state_dir": str(state_dir)},
        "admin": {"listen": "127.0.0.1:0"},
        "openai": {"listen": "127.0.0.1:0"},
        "dispatch": {"max_queue": 1024, "queue_timeout_ms": 60_000},
        "models": [{"id": "m", "providers": {"sim-1": "sim-small", "sim-2": "sim-small"}}],
        "nodes": [node(1), node(2)],
    }


async def test_killing_one_replica_fails_only_its_in_flight_runs(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    require_haproxy()
    path = tmp_path / "edge.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path / "state")), encoding="utf-8")
    replicas = [await start_edge(nursery, path) for _ in range(2)]
    try:
        victim, survivor = replicas
        node_urls = [edge.urls["node"] for edge in replicas]
        nodes: list[EdgeLinks] = [
            await nursery.start(partial(run_node, node_urls, f"node-{index}", NODE_TOKEN))
            for index in (1, 2)
        ]
        # They share the state_dir, so the SQLite ledger and its replica roster.
        async with httpx2.AsyncClient(
            base_url=survivor.urls["admin"], timeout=10, headers=survivor.admin_headers()
        ) as admin:
            roster = (await admin.post("/refresh", json={"mode": "dry_run"})).json()["replicas"]
        assert sorted(r["pid"] for r in roster) == sorted(edge.pid for edge in replicas)
        assert all(r["same_config"] and r["state"] == "serving" for r in roster)

        backends = [edge.urls["openai"].removeprefix("http://") for edge in replicas]
        balancer_url, _ = await start_balancer(nursery, tmp_path, backends)

        # Streams that know no retry once they started; non-streams the SDK retries.
        load = MixedLoad(balancer_url, streams=8, non_streams=8, max_tokens=40, retries=3)
        on_victim: set[str] = set()  # every run the victim ever sent a Node
        on_survivor: set[str] = set()  # and the survivor

        async def watch(node: EdgeLinks) -> None:
            assert node.host is not None
            while True:
                on_victim.update(_runs_of([node], node_urls[0]))
                on_survivor.update(_runs_of([node], node_urls[1]))
                await node.host.wait_changed()

        async with trio.open_nursery() as callers:
            for node in nodes:
                callers.start_soon(watch, node)
            callers.start_soon(load.run)
            with trio.fail_after(60):
                await load.wait_total(40)
                # Both replicas carry runs right now (the balancer spreads connections),
                # and a stream that already had chunks runs on the victim: killing it
                # must cut that stream (non-streams are retried elsewhere and succeed).
                while not (
                    _on_both(nodes, node_urls) and load.streaming & _runs_of(nodes, node_urls[0])
                ):
                    await load.wait_progress()
            on_victim.update(_runs_of(nodes, node_urls[0]))
            killed_at = trio.current_time()
            victim.process.send_signal(signal.SIGKILL)
            with trio.fail_after(60):
                assert await victim.process.wait() == -signal.SIGKILL
                await load.wait_total(load.tally.total + 60)
            load.stop()
            callers.cancel_scope.cancel()

        tally = load.tally
        assert on_victim, "the killed replica held no run: the test proved nothing"
        for failure in tally.failures:
            assert failure.started < killed_at, failure  # it was in flight at the kill
            if failure.run_id is not None:
                # On the killed replica: running on its Nodes, or still in its queue (then
                # no Node ever saw it). Never a run the survivor had sent a Node.
                assert failure.run_id not in on_survivor, failure
        assert any(f.run_id in on_victim for f in tally.failures if f.run_id), (
            "no failure was a run of the killed replica: the test proved nothing"
        )
        assert tally.complete >= 60

        # No slot leaks; the survivor does not count the dead replica's runs.
        for node in nodes:
            host = node.host
            assert host is not None
            with trio.fail_after(10):
                while any(host.statistics().slots.in_flight.values()):
                    await host.wait_changed()
            slots = host.statistics().slots
            assert max(slots.peak.values()) <= CAPACITY
        catalog = await admin_get(survivor.urls["admin"], "/catalog")
        for provider in catalog["providers"]:
            assert provider["in_flight"] == 0 and provider["other_edges_in_flight"] == 0
            assert provider["connected"]
    finally:
        for edge in replicas:
            stop_pid(edge.pid)


def _runs_of(nodes: list[EdgeLinks], edge_url: str) -> set[str]:
    """The requests whose runs the Nodes hold for the Edge at `edge_url`, right now, by
    the caller's request id (a retried attempt's run id `req_x.1` counts as `req_x`)."""
    runs: set[str] = set()
    for node in nodes:
        statistics = node.statistics()
        for serial, label in statistics.links.items():
            if label == edge_url:
                runs.update(
                    run_id.partition(".")[0] for run_id in statistics.run_ids.get(serial, ())
                )
    return runs


def _on_both(nodes: list[EdgeLinks], edge_urls: list[str]) -> bool:
    return all(_runs_of(nodes, url) for url in edge_urls)
