"""The soak's budget phase: a daily budget holds across Edge replicas (design §15,
limits Rule 7).

Two Edges share one PostgreSQL usage ledger (a throwaway cluster, `bench.postgres`),
one Node serving both. One principal with a small `tokens_per_day` (`BUDGET`) sends a
burst of `BURST` concurrent requests of `MAX_TOKENS` each, alternating the Edges. Each
Edge reserves every request's bound against the one counter the ledger keeps per
principal and day, so the burst spends the budget once, not once per replica. The phase
holds when

- the tokens of the admitted requests are at most the budget plus one request per
  replica (`BUDGET + REPLICAS * largest request`);
- every refused request is a 429 `budget_exceeded`, and both Edges admitted some.

Without the PostgreSQL server binaries (or psycopg) the phase cannot run: it says so,
and why, and counts as skipped, not held.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Final

import httpx2
import trio

from bench.postgres import PostgresUnavailable, create_database, throwaway_postgres
from bench.soak_stack import (
    Verdict,
    caller_token,
    error_code,
    principal_tokens,
    sim_provider,
    start_phase_stack,
)

__all__ = ["budget_phase"]

BUDGET: Final = 4_000
BURST: Final = 60
MAX_TOKENS: Final = 200
REPLICAS: Final = 2
_PASSWORD_ENV: Final = "IOP_SOAK_LEDGER_PASSWORD"
_PRINCIPAL: Final = "alice"
_CLEANUP_S: Final = 30.0


async def budget_phase(folder: Path) -> Verdict:
    """Run the phase (module docstring) in `folder`; print its books; its verdict."""
    print("\nbudgets across replicas:")
    with ExitStack() as cleanup:
        try:
            server = await trio.to_thread.run_sync(cleanup.enter_context, throwaway_postgres())
        except PostgresUnavailable as exc:
            print(f"  SKIPPED: no throwaway PostgreSQL here: {exc}")
            return Verdict("skipped", str(exc))
        try:
            url = await trio.to_thread.run_sync(create_database, server, "iop_soak_budgets")
            return await _burst(folder, url, server.password)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_S):
                await trio.to_thread.run_sync(cleanup.close)


async def _burst(folder: Path, ledger_url: str, password: str) -> Verdict:
    config = {
        "edge": {"ledger": ledger_url, "ledger_password_env": _PASSWORD_ENV},
        "openai": principal_tokens([_PRINCIPAL]),
        "principals": [{"ref": _PRINCIPAL, "tokens_per_day": BUDGET}],
        "models": [{"id": "m", "providers": {"sim-1": "sim-small"}}],
        "providers": [sim_provider("sim-1", 16)],
    }
    async with trio.open_nursery() as nursery:
        stack = await start_phase_stack(
            nursery, folder, [config] * REPLICAS, env={_PASSWORD_ENV: password}
        )
        ends: list[tuple[int, int, str, int]] = []
        """(replica, status, error code, total tokens) of each request."""
        headers = {"Authorization": f"Bearer {caller_token(_PRINCIPAL)}"}
        clients = [
            httpx2.AsyncClient(base_url=edge.ready.openai, timeout=60, headers=headers)
            for edge in stack.edges
        ]

        async def one(replica: int) -> None:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "spend"}],
                "max_tokens": MAX_TOKENS,
            }
            response = await clients[replica].post("/v1/chat/completions", json=body)
            if response.status_code == 200:
                ends.append((replica, 200, "", response.json()["usage"]["total_tokens"]))
            else:
                ends.append((replica, response.status_code, error_code(response.content), 0))

        try:
            async with trio.open_nursery() as burst:
                for index in range(BURST):
                    burst.start_soon(one, index % REPLICAS)
        finally:
            for client in clients:
                await client.aclose()
        nursery.cancel_scope.cancel()
    return _report(ends)


def _report(ends: list[tuple[int, int, str, int]]) -> Verdict:
    admitted = [tokens for _, status, _, tokens in ends if status == 200]
    by_replica = Counter(replica for replica, status, _, _ in ends if status == 200)
    refused = Counter(f"{status} {code}" for _, status, code, _ in ends if status != 200)
    largest = max(admitted, default=0)
    bound = BUDGET + REPLICAS * largest
    spent = sum(admitted)
    print(
        f"  {len(ends)} requests of max_tokens {MAX_TOKENS} from one principal over "
        f"{REPLICAS} Edges sharing a PostgreSQL ledger, tokens_per_day {BUDGET}"
    )
    per_edge = ", ".join(f"Edge {replica + 1}: {n}" for replica, n in sorted(by_replica.items()))
    refusals = ", ".join(f"{n} {end}" for end, n in refused.most_common()) or "none"
    print(f"  admitted {len(admitted)} ({per_edge}), refused: {refusals}")
    print(
        f"  admitted tokens {spent} = {100 * spent / BUDGET:.0f}% of the budget "
        f"(bound: budget + one request per replica = {bound})"
    )
    held = (
        spent <= bound and set(refused) == {"429 budget_exceeded"} and len(by_replica) == REPLICAS
    )
    verdict = Verdict.of(held)
    print(
        f"  {verdict.state}: {spent} <= {bound}: {spent <= bound}; refusals all 429 budget_exceeded"
    )
    return verdict
