"""The usage ledger in PostgreSQL, shared by Edge replicas (design §7, §13).

A real PostgreSQL server (`tests/e2e/postgres.py`) and real Edges in-process; the
password travels only in the environment variable the config names.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import anthropic
import psycopg
import pytest
import trio
import yaml

from iop_edge.cli import main as edge_cli
from iop_edge.core.configuration.config import parse_config
from iop_edge.edge import Edge, EdgeStartupError
from iop_edge.runtime.metering.usage_ledger.usage_store import UsageRecord
from tests.e2e.postgres import PASSWORD_ENV, Postgres
from tests.e2e.stack import Stack, edge_config, sim_provider, start_stack
from tests.timing import GUARD_S

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def _config(state_dir: Path, ledger_url: str, *, capacity: int = 4) -> str:
    return edge_config(
        state_dir,
        providers=[sim_provider("sim-1", capacity=capacity)],
        models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
        edge_section={"ledger": ledger_url, "ledger_password_env": PASSWORD_ENV},
    )


async def _chat(stack: Stack, count: int, max_tokens: int = 3) -> None:
    async with stack.client() as client:
        for _ in range(count):
            await client.chat.completions.create(
                model="m", max_tokens=max_tokens, messages=MESSAGES
            )


async def _usage(stack: Stack, group_by: str = "model") -> list[dict[str, Any]]:
    async with stack.admin() as admin:
        response = await admin.get("/usage", params={"group_by": group_by})
        response.raise_for_status()
        rows: list[dict[str, Any]] = response.json()["rows"]
        return rows


async def test_two_edges_share_one_ledger(
    nursery: trio.Nursery, tmp_path: Path, ledger_url: str
) -> None:
    stacks = [
        await start_stack(
            nursery,
            _config(tmp_path / name, ledger_url),
            tmp_path / f"{name}.yaml",
            wait_models=("m",),
        )
        for name in ("a", "b")
    ]
    await _chat(stacks[0], 3)
    await _chat(stacks[1], 2, max_tokens=5)
    for stack in stacks:
        with trio.fail_after(GUARD_S):
            await stack.edge.ledger.wait_flushed()
    for stack in stacks:  # either Edge's GET /usage reads the shared ledger
        [row] = await _usage(stack)
        assert row["model"] == "m" and row["requests"] == 5
        assert row["completion_tokens"] == 3 * 3 + 2 * 5
    password = os.environ[PASSWORD_ENV]
    with psycopg.connect(ledger_url, password=password) as db:
        [(count,)] = db.execute("SELECT COUNT(*) FROM iop_usage").fetchall()
    assert count == 5
    # No secret sits in any config file or ledger URL.
    for name in ("a", "b"):
        assert password not in (tmp_path / f"{name}.yaml").read_text()


async def test_a_refresh_reports_which_replicas_run_another_config(
    nursery: trio.Nursery, tmp_path: Path, ledger_url: str
) -> None:
    """The procedure the README gives: refresh each replica; every report lists the
    replicas and whether each runs the same config as the one that answered."""
    stacks = {
        name: await start_stack(
            nursery,
            _config(tmp_path / name, ledger_url),
            tmp_path / f"{name}.yaml",
            wait_models=("m",),
        )
        for name in ("a", "b")
    }
    candidate = _config(tmp_path / "a", ledger_url, capacity=8)

    async def refresh(name: str, text: str) -> dict[str, Any]:
        async with stacks[name].admin() as admin:
            response = await admin.post("/refresh", json={"mode": "apply", "config_yaml": text})
        assert response.status_code == 200, response.text
        report: dict[str, Any] = response.json()
        return report

    report = await refresh("a", candidate)
    assert len(report["replicas"]) == 2
    mine = [r for r in report["replicas"] if r["current"]]
    others = [r for r in report["replicas"] if not r["current"]]
    assert len(mine) == 1 and mine[0]["revision"] == 2 and mine[0]["same_config"]
    assert len(others) == 1 and others[0]["revision"] == 1 and not others[0]["same_config"]

    # b, refreshed with the same config text (its own state_dir is the one difference):
    candidate_b = candidate.replace(str(tmp_path / "a"), str(tmp_path / "b"))
    report = await refresh("b", candidate_b)
    by_revision = sorted(r["revision"] for r in report["replicas"])
    assert by_revision == [2, 2]
    status = stacks["a"].edge.status()
    assert {r.instance for r in status.replicas} == {r["instance"] for r in report["replicas"]}


async def test_the_writer_reconnects_after_losing_its_connection(
    nursery: trio.Nursery, tmp_path: Path, ledger_url: str, postgres_server: Any
) -> None:
    stack = await start_stack(
        nursery, _config(tmp_path, ledger_url), tmp_path / "edge.yaml", wait_models=("m",)
    )
    await _chat(stack, 1)
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    with psycopg.connect(postgres_server.admin_url(), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE usename = 'iop' AND application_name = '' AND pid <> pg_backend_pid()"
        )
    await _chat(stack, 1)  # its batch meets the dead connection: lost, and counted
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    await _chat(stack, 2)  # the next batches reconnect
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    [row] = await _usage(stack)
    assert row["requests"] + stack.edge.ledger.dropped == 4
    assert stack.edge.ledger.dropped <= 1 and row["requests"] >= 3


async def test_an_older_table_gains_the_protocol_column_its_rows_chat(
    nursery: trio.Nursery, tmp_path: Path, ledger_url: str
) -> None:
    with psycopg.connect(ledger_url, password=os.environ[PASSWORD_ENV], autocommit=True) as db:
        db.execute(
            "CREATE TABLE iop_usage (time DOUBLE PRECISION NOT NULL, run_id TEXT NOT NULL, "
            "principal_ref TEXT NOT NULL, token_ref TEXT NOT NULL, alias TEXT, "
            "model TEXT NOT NULL, provider TEXT NOT NULL, node TEXT NOT NULL, "
            "prompt_tokens BIGINT NOT NULL, completion_tokens BIGINT NOT NULL, "
            "status BIGINT NOT NULL, latency_ms DOUBLE PRECISION NOT NULL, "
            "ttft_ms DOUBLE PRECISION, usage_source TEXT NOT NULL)"
        )
        db.execute(
            "INSERT INTO iop_usage VALUES "
            "(1, 'old', 'p', 't', NULL, 'm', 'sim-1', 'node-1', 1, 2, 200, 1, NULL, 'provider')"
        )
    stack = await start_stack(
        nursery, _config(tmp_path, ledger_url), tmp_path / "edge.yaml", wait_models=("m",)
    )
    await _chat(stack, 1)
    async with anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url, api_key="open", max_retries=0
    ) as client:
        await client.messages.create(model="m", max_tokens=2, messages=MESSAGES)
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    rows = await _usage(stack, group_by="protocol")
    assert [(row["protocol"], row["requests"]) for row in rows] == [("chat", 2), ("messages", 1)]


async def test_an_unreachable_ledger_stops_the_edge_from_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "not-used")
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    text = _config(tmp_path, f"postgresql://iop@127.0.0.1:{port}/iop")
    edge = Edge(parse_config(text))
    with pytest.raises(
        EdgeStartupError, match=f"cannot reach the ledger at postgresql://iop@127.0.0.1:{port}/iop"
    ):
        await edge.check_ledger()


async def test_a_missing_password_variable_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    edge = Edge(parse_config(_config(tmp_path, "postgresql://iop@127.0.0.1:1/iop")))
    with pytest.raises(EdgeStartupError, match=f"names {PASSWORD_ENV}, which is not set"):
        await edge.check_ledger()


def test_the_config_refuses_a_password_in_the_ledger_url(tmp_path: Path) -> None:
    from iop_edge.core.configuration.config import ConfigInvalid

    text = yaml.safe_dump(
        {"edge": {"ledger": "postgresql://iop:hunter2@db.example/iop"}}, sort_keys=False
    )
    with pytest.raises(ConfigInvalid) as caught:
        parse_config(text)
    [error] = caught.value.errors
    assert error.path == "edge.ledger" and "must not contain a password" in error.message
    assert "hunter2" not in str(caught.value)


async def test_an_outage_is_a_503_two_log_lines_and_nothing_lost(
    nursery: trio.Nursery,
    tmp_path: Path,
    ledger_url: str,
    postgres_server: Postgres,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While the server is down: runs are served (their records wait in the journal),
    `GET /usage` answers 503 with the reason, and the writer logs one line when the
    outage begins and one when it ends, with how many records waited."""
    stack = await start_stack(
        nursery, _config(tmp_path, ledger_url), tmp_path / "edge.yaml", wait_models=("m",)
    )
    await _chat(stack, 2)
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    caplog.clear()
    await trio.to_thread.run_sync(postgres_server.stop)
    try:
        await _chat(stack, 5)
        with trio.move_on_after(2.5):  # the writer retries every second, and fails
            await stack.edge.ledger.wait_flushed()
        assert stack.edge.ledger.store_problem() is not None
        async with stack.admin() as admin:
            down = await admin.get("/usage")
        assert down.status_code == 503
        assert down.headers["retry-after"] == "5"
        message = down.json()["error"]["message"]
        assert f"the usage ledger (PostgreSQL {ledger_url}) cannot be read now" in message
        assert "cannot reach the ledger" in message
    finally:
        await trio.to_thread.run_sync(postgres_server.start)
    with trio.fail_after(10):
        await stack.edge.ledger.wait_flushed()
    [row] = await _usage(stack)
    assert row["requests"] == 7
    lines = [r for r in caplog.records if r.name == "iop_edge.runtime.metering.usage_ledger.usage"]
    began = [r.getMessage() for r in lines if "refuses writes" in r.getMessage()]
    ended = [r.getMessage() for r in lines if "takes writes again" in r.getMessage()]
    assert len(began) == 1 and len(ended) == 1, [r.getMessage() for r in lines]
    assert "the 5 record(s) that waited in the journal are written" in ended[0]
    assert not [r for r in lines if r.exc_info], "a traceback in the log"


def _record(run_id: str, principal: str) -> UsageRecord:
    return UsageRecord(
        time=1.0, run_id=run_id, principal_ref=principal, token_ref="t", alias=None,
        model="m", provider="sim-1", node="node-1", prompt_tokens=3, completion_tokens=4,
        status=200, latency_ms=1.0, ttft_ms=None,
    )  # fmt: skip


async def test_usage_pages_in_postgresql_as_in_sqlite(
    nursery: trio.Nursery, tmp_path: Path, ledger_url: str
) -> None:
    stack = await start_stack(nursery, _config(tmp_path, ledger_url), tmp_path / "edge.yaml")
    for index in range(5):
        stack.edge.ledger.record(_record(f"r{index}", f"team-{index}"))
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    params = {"group_by": "principal_ref,model", "limit": "2"}
    seen = []
    async with stack.admin() as admin:
        while True:
            page = (await admin.get("/usage", params=params)).json()
            assert page["totals"]["requests"] == 5
            seen += [row["principal_ref"] for row in page["rows"]]
            if not page["truncated"]:
                break
            params["after"] = page["next"]
    assert seen == [f"team-{index}" for index in range(5)]


def test_check_config_refuses_the_ledger_serve_would_refuse(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ledger_url: str,
) -> None:
    """`check-config` asks what `serve` asks before it serves (design §12): the password
    variable, the server (connected to, not changed); `--offline` checks the file only."""
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    unreachable = tmp_path / "unreachable.yaml"
    unreachable.write_text(_config(tmp_path, f"postgresql://iop@127.0.0.1:{port}/iop"))
    reachable = tmp_path / "reachable.yaml"
    reachable.write_text(_config(tmp_path, ledger_url))

    assert edge_cli(["check-config", str(reachable)]) == 0
    assert "OK" in capsys.readouterr().out
    assert edge_cli(["check-config", str(unreachable)]) == 1
    assert f"edge.ledger: cannot reach the ledger at postgresql://iop@127.0.0.1:{port}/iop" in (
        capsys.readouterr().err
    )
    monkeypatch.delenv(PASSWORD_ENV)
    assert edge_cli(["check-config", str(reachable)]) == 1
    assert f"edge.ledger_password_env names {PASSWORD_ENV}, which is not set" in (
        capsys.readouterr().err
    )
    assert edge_cli(["check-config", "--offline", str(unreachable)]) == 0
