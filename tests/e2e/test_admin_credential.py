"""The admin credential (`iop_edge.runtime.lifecycle.admin_credential`) through a real
Edge: a change through the admin API presents it, a read does not need it, and the
`iop-edge` commands find it in the Edge's `state_dir`, or are told where it is."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import httpx2
import pytest
import trio

from iop_edge.cli import main
from iop_edge.runtime.lifecycle.admin_credential import ADMIN_TOKEN_FILE
from tests.e2e.stack import Stack, edge_config, sim_provider, start_stack


async def run_cli(*argv: str) -> int:
    return await trio.to_thread.run_sync(main, list(argv))


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    text = edge_config(
        tmp_path / "state",
        providers=[sim_provider("sim-a")],
        models=[{"id": "m", "providers": {"sim-a": "sim-small"}}],
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


async def test_a_change_presents_the_credential_and_a_read_needs_none(stack: Stack) -> None:
    token_file = tmp_state(stack) / ADMIN_TOKEN_FILE
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600  # readable by the Edge's user
    dry_run = {"mode": "dry_run"}
    async with httpx2.AsyncClient(base_url=stack.addresses.admin_url, timeout=30) as anyone:
        refused = await anyone.post("/refresh", json=dry_run)
        wrong = await anyone.post(
            "/refresh", json=dry_run, headers={"authorization": "Bearer not-the-token"}
        )
        read = await anyone.get("/catalog")
    assert (refused.status_code, wrong.status_code, read.status_code) == (401, 401, 200)
    message = refused.json()["error"]["message"]
    assert str(token_file) in message and "POST /refresh changes the Edge" in message
    assert stack.edge.snapshot.revision == 1
    async with stack.admin() as operator:  # holds the credential
        accepted = await operator.post("/refresh", json=dry_run)
    assert accepted.status_code == 200


async def test_the_edge_keeps_its_credential_across_starts(
    nursery: trio.Nursery, stack: Stack, tmp_path: Path
) -> None:
    token_file = tmp_state(stack) / ADMIN_TOKEN_FILE
    first = token_file.read_text()
    again = await start_stack(
        nursery, stack.config_path.read_text(), tmp_path / "again.yaml", nodes=()
    )
    assert token_file.read_text() == first  # a restart's successor, a replica: the same
    async with again.admin() as operator:
        assert (await operator.post("/refresh", json={"mode": "dry_run"})).status_code == 200


async def test_the_command_line_finds_the_credential_or_says_where_it_is(
    stack: Stack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path / "state")  # no edge.yaml found by default here
    admin = stack.addresses.admin_url
    assert await run_cli("refresh", *stack.admin_flags) == 0  # from --config's state_dir
    capsys.readouterr()
    token_file = tmp_state(stack) / ADMIN_TOKEN_FILE
    assert await run_cli("refresh", "--admin", admin, "--admin-token-file", str(token_file)) == 0
    capsys.readouterr()
    assert await run_cli("catalog", "--admin", admin) == 0  # a read needs none
    capsys.readouterr()

    assert await run_cli("refresh", "--admin", admin) == 1
    err = capsys.readouterr().err
    assert "a change to the Edge needs its admin credential" in err
    assert "--admin-token-file" in err
    missing = tmp_path / "nowhere.token"
    assert await run_cli("refresh", "--admin", admin, "--admin-token-file", str(missing)) == 1
    err = capsys.readouterr().err
    assert f"cannot read {missing}" in err and "run this as a user who may read it" in err
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    assert await run_cli("refresh", "--admin", admin, "--admin-token-file", str(empty)) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"{empty} does not hold an admin credential: give --admin-token-file the Edge" in err
    # A relative state_dir is the Edge's, from the folder it started in (a service's).
    relative = tmp_path / "relative.yaml"
    text = stack.config_path.read_text().replace(str(tmp_state(stack)), "./var")
    relative.write_text(text)
    assert await run_cli("restart", "--admin", admin, "--config", str(relative)) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "var is relative to the folder the Edge started in" in err


def tmp_state(stack: Stack) -> Path:
    return Path(stack.edge.snapshot.config.edge.state_dir)
