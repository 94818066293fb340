"""Usage metering end to end: the ledger, `GET /usage` and `iop-edge usage`."""

from __future__ import annotations

import hashlib
from pathlib import Path

import trio

from iop_edge.cli import main as edge_cli
from tests.e2e.stack import one_sim_config, start_stack

TOKENS = {"app-a": "usage-test-token-a", "app-b": "usage-test-token-b"}


async def test_every_finished_run_is_metered_per_principal(
    nursery: trio.Nursery, tmp_path: Path, capsys: object
) -> None:
    principals = [
        {
            "token_ref": ref,
            "principal_ref": "team-x" if ref == "app-a" else "team-y",
            "token_hash_sha256": hashlib.sha256(token.encode()).hexdigest(),
        }
        for ref, token in TOKENS.items()
    ]
    text = one_sim_config(
        tmp_path / "state",
        openai_section={"principal_tokens": principals},
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    messages = [{"role": "user", "content": "hello"}]
    async with stack.client(api_key=TOKENS["app-a"]) as client:
        await client.chat.completions.create(model="m", max_tokens=3, messages=messages)
        stream = await client.chat.completions.create(
            model="m", max_tokens=4, messages=messages, stream=True
        )
        async for _chunk in stream:
            pass
    async with stack.client(api_key=TOKENS["app-b"]) as client:
        await client.chat.completions.create(model="m", max_tokens=5, messages=messages)

    with trio.fail_after(5):
        await stack.edge.ledger.wait_flushed()  # the ledger writes off the request path
    async with stack.admin() as admin:
        report = (await admin.get("/usage", params={"group_by": "token_ref"})).json()
        rows = {row["token_ref"]: row for row in report["rows"]}
        assert rows["app-a"]["requests"] == 2
        assert rows["app-a"]["completion_tokens"] == 7  # streamed runs are metered too
        assert rows["app-b"]["completion_tokens"] == 5
        assert rows["app-a"]["prompt_tokens"] > 0

        future = (await admin.get("/usage", params={"since": "2999-01-01T00:00:00"})).json()
        assert future["rows"] == []
        bad = await admin.get("/usage", params={"group_by": "colour"})
        assert bad.status_code == 400 and "colour" in bad.json()["error"]["message"]

    code = await trio.to_thread.run_sync(
        edge_cli, ["usage", "--admin", stack.addresses.admin_url, "--group-by", "principal_ref"]
    )
    assert code == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "team-x" in out and "team-y" in out
