"""`GET /catalog` filters and pages, `/catalog/summary` and `iop-edge catalog --limit`
against a running Edge (design §6), through real sockets."""

from __future__ import annotations

import shlex
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from iop_edge.cli import main
from tests.e2e.stack import NODE_TOKEN_HASH, Stack, edge_config, sim_provider, start_stack

OFFLINE_NODES = 6


def _config(state_dir: Path) -> str:
    """`m` on node-1's two providers; `other` on providers of Nodes that never connect."""
    offline = [
        {
            "id": f"far-{i}",
            "token_hash_sha256": NODE_TOKEN_HASH,
            "providers": [sim_provider(f"far-{i}-sim")],
        }
        for i in range(OFFLINE_NODES)
    ]
    return edge_config(
        state_dir,
        providers=[sim_provider("sim-a"), sim_provider("sim-b")],
        models=[
            {"id": "m", "providers": {"sim-a": "sim-small", "sim-b": "sim-small"}},
            {
                "id": "other",
                "providers": {f"far-{i}-sim": "sim-small" for i in range(OFFLINE_NODES)},
            },
        ],
        extra_nodes=offline,
    )


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with trio.open_nursery() as nursery:
        yield await start_stack(
            nursery, _config(tmp_path / "state"), tmp_path / "edge.yaml", wait_models=("m",)
        )
        nursery.cancel_scope.cancel()


async def _get(stack: Stack, path: str) -> tuple[int, Any]:
    async with stack.admin() as admin:
        response = await admin.get(path)
    return response.status_code, response.json()


def _ids(catalog: dict[str, Any]) -> list[str]:
    return [provider["id"] for provider in catalog["providers"]]


async def test_filters_select_providers_and_pages_follow_their_cursor(stack: Stack) -> None:
    status, node = await _get(stack, "/catalog?node=node-1")
    assert (status, _ids(node)) == (200, ["sim-a", "sim-b"])
    status, available = await _get(stack, "/catalog?health=available")
    assert _ids(available) == ["sim-a", "sim-b"]
    status, other = await _get(stack, "/catalog?model=other&health=unavailable")
    assert [m["id"] for m in other["models"]] == ["other"]
    assert _ids(other) == [f"far-{i}-sim" for i in range(OFFLINE_NODES)]

    pages: list[list[str]] = []
    cursor = ""
    while True:
        status, page = await _get(stack, f"/catalog?limit=3&cursor={cursor}")
        assert status == 200
        pages.append(_ids(page))
        if page["next"] is None:
            break
        cursor = page["next"]
    assert pages == [
        ["far-0-sim", "far-1-sim", "far-2-sim"],
        ["far-3-sim", "far-4-sim", "far-5-sim"],
        ["sim-a", "sim-b"],
    ]


async def test_a_bad_argument_is_400_naming_it(stack: Stack) -> None:
    status, body = await _get(stack, "/catalog?health=sleepy")
    assert status == 400
    assert body["error"]["message"].startswith("health must be one of")
    status, body = await _get(stack, "/catalog?nodes=node-1")
    assert status == 400
    assert "unknown catalog argument(s) nodes" in body["error"]["message"]


async def test_the_summary_counts_providers_by_health(stack: Stack) -> None:
    status, summary = await _get(stack, "/catalog/summary")
    assert status == 200
    assert summary == {
        "revision": 1,
        "models": 2,
        "nodes": 1 + OFFLINE_NODES,
        "providers": 2 + OFFLINE_NODES,
        "by_health": {"available": 2, "unavailable": OFFLINE_NODES},
    }


async def test_the_cli_pages_and_says_how_to_ask_for_the_next_page(
    stack: Stack, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    admin = stack.addresses.admin_url
    argv = ["catalog", "--admin", admin, "--model", "other", "--limit", "4"]
    assert await trio.to_thread.run_sync(main, argv) == 0
    out = capsys.readouterr().out
    providers = out[out.index("Providers (revision 1)") :]
    assert "far-3-sim" in providers and "far-4-sim" not in providers
    more = f"more: iop-edge catalog --model other --limit 4 --admin {admin} --cursor far-3-sim"
    assert more in out
    argv = shlex.split(more)[2:]  # the command as printed works pasted anywhere
    assert await trio.to_thread.run_sync(main, argv) == 0
    out = capsys.readouterr().out
    providers = out[out.index("Providers (revision 1)") :]
    assert "far-5-sim" in providers and "far-3-sim" not in providers and "more:" not in out
