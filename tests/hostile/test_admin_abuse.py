"""Admin abuse: what a local process (or a browser page) can throw at the admin API is
refused with a clear status and audited, and never changes what runs."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from iop_edge.runtime.refresh.audit import AUDIT_FILE_NAME
from tests.e2e.stack import Stack


def _bomb() -> str:
    lines = ["x0: &x0 [a, a, a, a, a, a, a, a, a, a]"]
    lines += [f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return "\n".join(lines)


async def test_refresh_candidates_built_to_hurt_are_invalid_and_audited(
    stack_one: Stack, tmp_path: Path
) -> None:
    revision = stack_one.edge.snapshot.revision
    candidates = [
        _bomb(),  # 10^9 leaves by alias
        "k: " + "[" * 10_000 + "]" * 10_000,  # nesting
        "openai: {max_request_bytes: 999999999}",  # past the wire
        "admin: {listen: 0.0.0.0:7701}",  # serve would refuse it
    ]
    async with stack_one.admin() as admin:
        for candidate in candidates:
            for mode in ("dry_run", "apply"):
                body = {"mode": mode, "config_yaml": candidate, "allow_restart_required": True}
                with trio.fail_after(10):
                    response = await admin.post("/refresh", json=body)
                assert response.status_code == 400, (candidate[:40], response.text)
                assert response.json()["outcome"] == "rejected"
    assert stack_one.edge.snapshot.revision == revision
    audit = (tmp_path / AUDIT_FILE_NAME).read_text().splitlines()
    assert [json.loads(line)["verdict"] for line in audit] == ["invalid"] * 2 * len(candidates)


async def test_oversized_and_concurrent_refreshes_are_refused(stack_one: Stack) -> None:
    async with stack_one.admin() as admin:
        huge = await admin.post("/refresh", content=b"{" + b" " * (17 * 1024 * 1024) + b"}")
        assert huge.status_code == 413
        statuses: list[int] = []

        async def dry_run() -> None:
            response = await admin.post("/refresh", json={"mode": "dry_run"})
            statuses.append(response.status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(dry_run)
        assert set(statuses) <= {200, 409} and 200 in statuses


async def test_browser_shaped_and_malformed_requests_are_refused(stack_one: Stack) -> None:
    async with stack_one.admin() as admin:
        for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                        {"Host": "evil.example"}):  # fmt: skip
            response = await admin.post("/refresh", json={"mode": "apply"}, headers=headers)
            assert response.status_code == 403
        bad_queries = [
            {"since": "yesterday"},
            {"until": "1e999999"},
            {"since": "nan"},
            {"group_by": "x;DROP"},
        ]
        for params in bad_queries:
            assert (await admin.get("/usage", params=params)).status_code == 400, params
        assert (await admin.get("/refresh")).status_code == 405
