"""Zero-downtime restart of a real `iop-edge serve` process (design §13).

The Edge runs as its own process, as an operator runs it; the Node runs in the test (so
its slot counts can be read) and callers use the official `openai` SDK with its default
retries (`SDK_RETRIES`): the draining Edge closes its idle keep-alive connections, and a
request sent on one at that very instant gets no answer, so the SDK sends it again, to
the successor. Every error the callers see counts, and so does a stream cut short.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
import trio
import yaml

from iop_edge.core.configuration.tokens import hash_token
from iop_node.main import run_node
from iop_node.uplink.edges import EdgeLinks
from tests.e2e.processes import (
    MESSAGES,
    MixedLoad,
    admin_get,
    pid_alive,
    run_cli,
    sim_config,
    start_edge,
    stop_pid,
)
from tests.e2e.stack import CLIENT_TLS, NODE_TOKEN, NODE_TOKEN_HASH, one_sim_config, start_stack

CAPACITY = 16
#: The openai SDK's default `max_retries`.
SDK_RETRIES = 2


def _write(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


async def test_restart_under_continuous_load_fails_nothing(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """32 streams and 8 non-stream callers, back to back, on a provider of 16 slots
    (so the two Edges share it during the overlap): `iop-edge restart` in the middle."""
    path = _write(
        tmp_path / "edge.yaml",
        sim_config(tmp_path / "state", NODE_TOKEN_HASH, capacity=CAPACITY, tokens_per_second=400),
    )
    edge = await start_edge(nursery, path)
    successor = 0
    try:
        node: EdgeLinks = await nursery.start(
            partial(run_node, edge.urls["node"], "node-1", NODE_TOKEN)
        )
        load = MixedLoad(edge.urls["openai"], streams=32, non_streams=8, retries=SDK_RETRIES)
        async with trio.open_nursery() as callers:
            callers.start_soon(load.run)
            with trio.fail_after(60):
                await load.wait_total(48)
            result = await run_cli("restart", *edge.admin_flags, "--json")
            assert result.returncode == 0, result.stderr.decode() + edge.log
            report = json.loads(result.stdout)
            assert report["outcome"] == "handed_over" and report["revision"] == 2
            successor = report["successor_pid"]
            with trio.fail_after(60):
                assert await edge.process.wait() == 0  # the old Edge drained and exited
                await load.wait_total(load.tally.total + 48)
            load.stop()
        tally = load.tally
        assert tally.failed == [], edge.log
        assert tally.truncated == 0
        slots = node.statistics().slots
        assert slots.peak["sim-1"] <= CAPACITY
        assert slots.in_flight == {"sim-1": 0}
        assert len(node.statistics().links) == 1  # the old link closed
        # same address: the successor answers
        status = await admin_get(edge.urls["admin"], "/status")
        assert status["revision"] == 2 and status["pending_restart"] == []
        assert status["nodes"] == [{"id": "node-1", "connected": True, "applied_revision": 2}]
    finally:
        stop_pid(successor)
        stop_pid(edge.pid)


async def test_sigusr2_applies_a_pending_restart_required_change(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A new caller token (restart-required) is applied by a restart: `pending_restart`
    clears, the token works, callers of the old token never notice."""
    old_token, new_token = "caller-one", "caller-two"

    def tokens(*names: str) -> dict[str, Any]:
        return {
            "principal_tokens": [
                {"token_ref": name, "token_hash_sha256": hash_token(name), "principal_ref": name}
                for name in names
            ]
        }

    config = sim_config(tmp_path / "state", NODE_TOKEN_HASH, capacity=8, tokens_per_second=400)
    config["openai"].update(tokens(old_token))
    path = _write(tmp_path / "edge.yaml", config)
    edge = await start_edge(nursery, path)
    successor = 0
    try:
        await nursery.start(partial(run_node, edge.urls["node"], "node-1", NODE_TOKEN))
        config["openai"].update(tokens(old_token, new_token))
        candidate = yaml.safe_dump(config, sort_keys=False)
        async with httpx2.AsyncClient(
            base_url=edge.urls["admin"], timeout=30, verify=CLIENT_TLS, headers=edge.admin_headers()
        ) as admin:
            response = await admin.post(
                "/refresh",
                json={"mode": "apply", "config_yaml": candidate, "allow_restart_required": True},
            )
        assert response.status_code == 200, response.text
        status = await admin_get(edge.urls["admin"], "/status")
        assert status["pending_restart"] == ["openai.principal_tokens[caller-two]"]

        async def call(token: str) -> int:
            async with httpx2.AsyncClient(
                base_url=edge.urls["openai"], timeout=30, verify=CLIENT_TLS
            ) as http:
                response = await http.post(
                    "/v1/chat/completions",
                    headers={"authorization": f"Bearer {token}"},
                    json={
                        "model": "m",
                        "max_tokens": 2,
                        "messages": [{"role": "user", "content": "x"}],
                    },
                )
                return response.status_code

        assert await call(new_token) == 401
        load = MixedLoad(
            edge.urls["openai"], streams=4, non_streams=2, api_key=old_token, retries=SDK_RETRIES
        )
        async with trio.open_nursery() as callers:
            callers.start_soon(load.run)
            with trio.fail_after(30):
                await load.wait_total(20)
            os.kill(edge.pid, signal.SIGUSR2)
            with trio.fail_after(60):
                assert await edge.process.wait() == 0
                await load.wait_total(load.tally.total + 20)
            load.stop()
        assert load.tally.failed == [] and load.tally.truncated == 0
        status = await admin_get(edge.urls["admin"], "/status")
        assert status["pending_restart"] == [] and status["revision"] == 3
        assert await call(new_token) == 200
        successor = status.get("pid", 0)
    finally:
        stop_pid(successor)
        stop_pid(edge.pid)


def _break_config(config: dict[str, Any]) -> list[str]:
    """The file no longer validates: what the failed restart says."""
    config["nodes"][0]["providers"][0]["capacity"] = 0
    return ["restart failed", "nodes[0].providers[0].capacity"]


def _move_node_listener(config: dict[str, Any]) -> list[str]:
    """The Nodes dial the old address: sent away, they would find nobody there."""
    with socket.socket() as probe:  # a free port for the moved listener
        probe.bind(("127.0.0.1", 0))
        moved = f"127.0.0.1:{probe.getsockname()[1]}"
    config["edge"]["listen"] = moved
    return [f"listens for Nodes on {moved}", "node(s) node-1 dial"]


@pytest.mark.parametrize(
    "change", [_break_config, _move_node_listener], ids=["invalid", "node-listener-moved"]
)
async def test_a_restart_that_cannot_take_over_changes_nothing(
    nursery: trio.Nursery, tmp_path: Path, change: Callable[[dict[str, Any]], list[str]]
) -> None:
    """The restart fails before the Nodes are sent away, saying why; the Edge serves on
    with the Node it had."""
    config = sim_config(tmp_path / "state", NODE_TOKEN_HASH, capacity=4, tokens_per_second=400)
    path = _write(tmp_path / "edge.yaml", config)
    edge = await start_edge(nursery, path)
    try:
        node: EdgeLinks = await nursery.start(
            partial(run_node, edge.urls["node"], "node-1", NODE_TOKEN)
        )
        said = change(config)
        _write(path, config)
        result = await run_cli("restart", *edge.admin_flags)
        assert result.returncode == 1
        stderr = result.stderr.decode()
        assert all(words in stderr for words in said), stderr
        assert pid_alive(edge.pid)
        load = MixedLoad(edge.urls["openai"], streams=2, non_streams=2)
        async with trio.open_nursery() as callers:
            callers.start_soon(load.run)
            with trio.fail_after(30):
                await load.wait_total(8)
            load.stop()
        assert load.tally.failed == []
        assert node.sessions == 1  # the Node was never told to go away
    finally:
        stop_pid(edge.pid)


async def test_an_in_process_edge_cannot_restart_itself(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Only `iop-edge serve` knows how to start itself again; an embedded Edge refuses."""
    text = one_sim_config(tmp_path)
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", nodes=())
    async with stack.admin() as admin:
        response = await admin.post("/restart")
    assert response.status_code == 409
    assert response.json()["outcome"] == "refused"
    assert "cannot start itself again" in response.json()["detail"]


async def test_a_keep_alive_callers_next_request_is_never_cut_by_the_drain(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A caller whose pooled keep-alive connection is idle when the old Edge starts to
    drain sends a stream that lasts longer than the old Edge's grace period: it is served
    whole (by the successor: the old Edge closed the idle connection, the SDK's pool
    opened a new one), not started on the old Edge and cut when its grace ran out."""
    config = sim_config(tmp_path / "state", NODE_TOKEN_HASH, capacity=4, tokens_per_second=20)
    config["edge"]["shutdown_grace_s"] = 3
    path = _write(tmp_path / "edge.yaml", config)
    edge = await start_edge(nursery, path)
    successor = 0
    try:
        await nursery.start(partial(run_node, edge.urls["node"], "node-1", NODE_TOKEN))
        base_url = f"{edge.urls['openai']}/v1"
        keep_alive = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=SDK_RETRIES)
        busy = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=SDK_RETRIES)
        async with keep_alive, busy:
            await keep_alive.chat.completions.create(model="m", max_tokens=1, messages=MESSAGES)
            # A stream in progress on the old Edge (3 s) keeps it draining for a while.
            in_progress = await busy.chat.completions.create(
                model="m", max_tokens=60, messages=MESSAGES, stream=True
            )
            first = await in_progress.__anext__()
            result = await run_cli("restart", *edge.admin_flags, "--json")
            assert result.returncode == 0, result.stderr.decode() + edge.log
            successor = json.loads(result.stdout)["successor_pid"]
            # The old Edge drains now; the pooled connection is its. A 5 s stream, longer
            # than the old Edge's 3 s of grace:
            with trio.fail_after(30):
                stream = await keep_alive.chat.completions.create(
                    model="m", max_tokens=100, messages=MESSAGES, stream=True
                )
                chunks = [chunk async for chunk in stream]
                rest = [chunk async for chunk in in_progress]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length", chunks[-3:]
        assert [c.choices[0].finish_reason for c in [first, *rest] if c.choices][-1] == "length"
        with trio.fail_after(30):
            assert await edge.process.wait() == 0
        assert "run(s) cut" not in edge.log, edge.log
    finally:
        stop_pid(successor)
        stop_pid(edge.pid)


async def test_keep_alive_callers_without_retries_see_no_failure_across_a_restart(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Callers with no retries at all, each on its keep-alive connection, back to back
    with short requests (so at the handover most connections are idle only for an
    instant, a request on its way): the old Edge hands its idle connections to the
    successor as they are, and every request is answered by one of the two."""
    path = _write(
        tmp_path / "edge.yaml",
        sim_config(tmp_path / "state", NODE_TOKEN_HASH, capacity=CAPACITY, tokens_per_second=4000),
    )
    edge = await start_edge(nursery, path)
    successor = 0
    try:
        await nursery.start(partial(run_node, edge.urls["node"], "node-1", NODE_TOKEN))
        load = MixedLoad(edge.urls["openai"], streams=8, non_streams=24, max_tokens=4, retries=0)
        async with trio.open_nursery() as callers:
            callers.start_soon(load.run)
            with trio.fail_after(60):
                await load.wait_total(200)
            result = await run_cli("restart", *edge.admin_flags, "--json")
            assert result.returncode == 0, result.stderr.decode() + edge.log
            successor = json.loads(result.stdout)["successor_pid"]
            with trio.fail_after(60):
                assert await edge.process.wait() == 0
                await load.wait_total(load.tally.total + 200)
            load.stop()
        tally = load.tally
        assert tally.failed == [], edge.log
        assert tally.truncated == 0
        # Whether a connection was idle at the drain's instant (and handed over) depends
        # on timing; tests/hostile/test_restart_handoff.py makes that race deterministic.
    finally:
        stop_pid(successor)
        stop_pid(edge.pid)


async def test_per_minute_limits_carry_over_a_restart(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """`requests_per_minute: 10` spent on the old Edge stays spent on its successor: a
    restart hands out no fresh minute."""
    token = "sk-alice-not-a-secret"
    config = sim_config(tmp_path / "state", NODE_TOKEN_HASH, capacity=4, tokens_per_second=4000)
    config["openai"]["principal_tokens"] = [
        {"token_ref": "alice-key", "principal_ref": "alice", "token_hash_sha256": hash_token(token)}
    ]
    config["principals"] = [{"ref": "alice", "requests_per_minute": 10}]
    path = _write(tmp_path / "edge.yaml", config)
    edge = await start_edge(nursery, path)
    successor = 0
    try:
        await nursery.start(partial(run_node, edge.urls["node"], "node-1", NODE_TOKEN))
        client = openai.AsyncOpenAI(
            base_url=f"{edge.urls['openai']}/v1", api_key=token, max_retries=0
        )
        async with client:
            for _ in range(10):
                await client.chat.completions.create(model="m", max_tokens=1, messages=MESSAGES)
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(model="m", max_tokens=1, messages=MESSAGES)
            result = await run_cli("restart", *edge.admin_flags, "--json")
            assert result.returncode == 0, result.stderr.decode() + edge.log
            successor = json.loads(result.stdout)["successor_pid"]
            with trio.fail_after(60):
                assert await edge.process.wait() == 0
            status = await admin_get(edge.urls["admin"], "/status")
            assert status["pid"] == successor  # the successor answers from now on
            with pytest.raises(openai.RateLimitError) as refused:
                await client.chat.completions.create(model="m", max_tokens=1, messages=MESSAGES)
        assert refused.value.code == "rate_limit_requests"
        principals = await admin_get(edge.urls["admin"], "/principals")
        alice = next(p for p in principals["principals"] if p["principal_ref"] == "alice")
        assert alice["requests_remaining"] == 0
        # The old Edge took no new request once its successor served: the limits are not
        # split with it while its row lingers.
        assert principals["replicas"] == 1
        assert refused.value.response.headers["x-ratelimit-limit-requests"] == "10"
    finally:
        stop_pid(successor)
        stop_pid(edge.pid)
