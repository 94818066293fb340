"""The soak's restart-limits phase: per-minute limits go on across a zero-downtime
restart (design §13, `runtime.lifecycle.handoff`).

One Edge and one Node; a principal with `requests_per_minute: RPM` spends it all, the
Edge restarts (`POST /restart`: a new process takes the ports over), and the principal
asks again within the same minute. The phase holds when the successor answers that
request 429 `rate_limit_requests` (the old process's counters went over) and serves
another principal (the successor does serve). A successor that started the minute afresh
would answer 200: a restart would hand out a fresh minute of requests.

The mixed load's restart shows the other half: no request fails across it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Final

import httpx2
import trio

from bench.services import ServiceFailed
from bench.soak_stack import (
    Verdict,
    caller_token,
    error_code,
    principal_tokens,
    sim_provider,
    start_phase_stack,
)

__all__ = ["restart_limits_phase"]

RPM: Final = 10
_LIMITED: Final = "alice"
_OTHER: Final = "bob"
#: The old process's drain and exit, the successor's start.
_HANDOVER_S: Final = 60.0
_STOP_S: Final = 30.0


async def _ask(http: httpx2.AsyncClient, principal: str) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {caller_token(principal)}"}
    response = await http.post("/v1/chat/completions", json=body, headers=headers)
    if response.status_code == 200:
        return "200"
    return f"{response.status_code} {error_code(response.content)}"


async def restart_limits_phase(folder: Path) -> Verdict:
    """Run the phase (module docstring) in `folder`; print its books; its verdict."""
    print("\nper-minute limits across a restart:")
    config = {
        "openai": principal_tokens([_LIMITED, _OTHER]),
        "principals": [{"ref": _LIMITED, "requests_per_minute": RPM}],
        "models": [{"id": "m", "providers": {"sim-1": "sim-small"}}],
        "providers": [sim_provider("sim-1", 4)],
    }
    successor: int | None = None
    before: list[str] = []
    after: dict[str, str] = {}
    report: dict[str, object] = {}
    stopping = False
    try:
        async with trio.open_nursery() as nursery:
            stack = await start_phase_stack(nursery, folder, [config])
            edge = stack.edges[0]
            async with (
                httpx2.AsyncClient(base_url=stack.urls.openai, timeout=60) as http,
                httpx2.AsyncClient(
                    base_url=stack.urls.admin, timeout=_HANDOVER_S, headers=stack.admin_headers()
                ) as admin,
            ):
                started = time.monotonic()
                before = [await _ask(http, _LIMITED) for _ in range(RPM)]
                report = (await admin.post("/restart")).json()
                if report.get("outcome") == "handed_over":
                    successor = int(str(report["successor_pid"]))
                    with trio.fail_after(_HANDOVER_S):
                        await edge.process.wait()  # the successor alone serves from here
                    after = {who: await _ask(http, who) for who in (_LIMITED, _OTHER)}
                within_s = time.monotonic() - started
            stopping = True
            if successor is not None:
                # Not this process's child: stopped by pid. Once it exits the Edge's
                # output ends, and its service says so (ServiceFailed, expected now).
                os.kill(successor, signal.SIGTERM)
                with trio.move_on_after(_STOP_S):
                    await trio.sleep_forever()
            nursery.cancel_scope.cancel()
    except* ServiceFailed:
        if not stopping:
            raise
    spent = sum(end == "200" for end in before)
    print(
        f"  requests_per_minute {RPM}: {spent} of {len(before)} answered before the restart; "
        f"restart {report.get('outcome')} (pid {report.get('pid')} -> {successor})"
    )
    print(
        f"  after it, {within_s:.1f}s into the minute: the limited principal "
        f"{after.get(_LIMITED)}, another principal {after.get(_OTHER)}"
    )
    held = spent == RPM and after == {_LIMITED: "429 rate_limit_requests", _OTHER: "200"}
    verdict = Verdict.of(held)
    print(f"  {verdict.state}: the successor went on from the old process's counters")
    return verdict
