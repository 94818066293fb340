"""Usage metering end to end: the ledger, `GET /usage` and `iop-edge usage`."""

from __future__ import annotations

import hashlib
import shlex
import time
from pathlib import Path

import pytest
import trio

from iop_edge.cli import main as edge_cli
from iop_edge.runtime.metering.usage_ledger.usage import UsageRecord
from tests.e2e.stack import one_sim_config, start_stack
from tests.timing import GUARD_S

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

    with trio.fail_after(GUARD_S):
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
        for nowhen in ("1e300", "-1", "inf"):  # no time a report could show
            refused = await admin.get("/usage", params={"since": nowhen})
            assert refused.status_code == 400 and nowhen in refused.json()["error"]["message"]

    code = await trio.to_thread.run_sync(
        edge_cli, ["usage", "--admin", stack.addresses.admin_url, "--group-by", "principal_ref"]
    )
    assert code == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "team-x" in out and "team-y" in out


def _record(run_id: str, principal: str) -> UsageRecord:
    return UsageRecord(
        time=time.time(), run_id=run_id, principal_ref=principal, token_ref="t", alias=None,
        model="m", provider="sim-1", node="node-1", prompt_tokens=3, completion_tokens=4,
        status=200, latency_ms=1.0, ttft_ms=None,
    )  # fmt: skip


async def test_usage_comes_in_bounded_pages(
    nursery: trio.Nursery, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = await start_stack(nursery, one_sim_config(tmp_path / "state"), tmp_path / "e.yaml")
    for index in range(5):
        stack.edge.ledger.record(_record(f"r{index}", f"team-{index}"))
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    async with stack.admin() as admin:
        seen: list[str] = []
        params = {"group_by": "principal_ref", "limit": "2"}
        for expected in (["team-0", "team-1"], ["team-2", "team-3"], ["team-4"]):
            page = (await admin.get("/usage", params=params)).json()
            assert [row["principal_ref"] for row in page["rows"]] == expected
            assert page["totals"]["requests"] == 5  # the window, whatever the page
            assert page["truncated"] is (expected != ["team-4"])
            seen += expected
            params["after"] = page["next"]
        assert page["next"] is None
        for bad, named in (
            ({"limit": "0"}, "limit"),
            ({"after": "x"}, "after"),
            ({"bogus": "1"}, "bogus"),
            ({"since": "2026-12-02", "until": "2026-12-01"}, "since"),
            ({"since": "-1"}, "since"),
            ({"since": "1969-12-31T23:59:59Z"}, "since"),  # the same instant, as a date
            ({"until": "9999-12-31T23:59:59-14:00"}, "until"),
        ):
            refused = await admin.get("/usage", params=bad)
            assert refused.status_code == 400
            assert refused.json()["error"]["message"].startswith(f"{named}: ")
    code = await trio.to_thread.run_sync(
        edge_cli,
        ["usage", "--admin", stack.addresses.admin_url, "--group-by", "principal_ref",
         "--limit", "3"],
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "team-2" in out and "team-3" not in out
    assert "3 groups shown, more follow" in out and "total" in out and " 5 " in out
    command = out[out.index("next page: ") :].splitlines()[0].removeprefix("next page: ")
    admin = stack.addresses.admin_url
    assert command.startswith(f"iop-edge usage --group-by principal_ref --limit 3 --admin {admin}")
    assert await trio.to_thread.run_sync(edge_cli, shlex.split(command)[1:]) == 0
    out = capsys.readouterr().out
    assert "team-3" in out and "team-4" in out and "team-2" not in out
